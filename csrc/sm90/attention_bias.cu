// The one-warpgroup kernels that read ΔS (smooth_q) and/or an attn_mask (kBias: every key block on the
// masked path, the biases added in softmax_scores). A translation unit of their own, compiled beside
// attention.cu in parallel (setup.py).
#include "launch.cuh"

namespace sage_sm90 {

// Tensor maps or cp.async, per-key or per-thread-group δK, pair epilogue — as launch_1wg picks them.
template <int D, int CtasPerSm>
static cudaError_t launch_biased_for(const Params& q, cudaStream_t stream) {
  if (!q.tma) return launch_1wg_with<D, CtasPerSm, false, false, false, true>(q, stream);
  const bool pairs = pairs_aligned(q);
  if (q.k_thread_groups) {
    return pairs ? launch_1wg_with<D, CtasPerSm, true, true, true, true>(q, stream)
                 : launch_1wg_with<D, CtasPerSm, true, true, false, true>(q, stream);
  }
  return pairs ? launch_1wg_with<D, CtasPerSm, true, false, true, true>(q, stream)
               : launch_1wg_with<D, CtasPerSm, true, false, false, true>(q, stream);
}

cudaError_t launch_1wg_biased(const Params& q, cudaStream_t stream, int ctas_per_sm) {
  if (q.head_dim_padded == 128)
    return ctas_per_sm == 2 ? launch_biased_for<128, 2>(q, stream) : launch_biased_for<128, 3>(q, stream);
  if (q.head_dim_padded == 64)
    return ctas_per_sm == 2 ? launch_biased_for<64, 2>(q, stream) : launch_biased_for<64, 3>(q, stream);
  return cudaErrorInvalidValue;
}

// The tensor-map instantiation with the pair epilogue (as attributes_for reports the unbiased kernels).
template <int D, int CtasPerSm>
static cudaError_t attributes_of(bool thread_k, cudaFuncAttributes* attr, int* dynamic_smem) {
  *dynamic_smem = SmemLayout1<D, Stages1<D, CtasPerSm>()>::kDynamic;
  return thread_k ? cudaFuncGetAttributes(attr, attention_kernel_1wg<D, CtasPerSm, true, true, true, true>)
                  : cudaFuncGetAttributes(attr, attention_kernel_1wg<D, CtasPerSm, true, false, true, true>);
}

cudaError_t biased_attributes(int head_dim_padded, int ctas_per_sm, bool thread_k, cudaFuncAttributes* attr,
                              int* dynamic_smem) {
  if (head_dim_padded == 128)
    return ctas_per_sm == 2 ? attributes_of<128, 2>(thread_k, attr, dynamic_smem)
                            : attributes_of<128, 3>(thread_k, attr, dynamic_smem);
  if (head_dim_padded == 64)
    return ctas_per_sm == 2 ? attributes_of<64, 2>(thread_k, attr, dynamic_smem)
                            : attributes_of<64, 3>(thread_k, attr, dynamic_smem);
  return cudaErrorInvalidValue;
}

}  // namespace sage_sm90

// The one-warpgroup kernels that read ΔS (smooth_q) and/or an attn_mask (kBias: every key block on the
// masked path, the biases added in softmax_scores). A translation unit of their own, compiled beside
// attention.cu in parallel (setup.py).
#include "launch.cuh"

namespace sage_sm90 {

cudaError_t launch_1wg_biased(const Params& q, cudaStream_t stream, int ctas_per_sm) {
  if (q.head_dim_padded == 128)
    return ctas_per_sm == 2 ? launch_1wg_for_inputs<128, 2, true>(q, stream)
                            : launch_1wg_for_inputs<128, 3, true>(q, stream);
  if (q.head_dim_padded == 64)
    return ctas_per_sm == 2 ? launch_1wg_for_inputs<64, 2, true>(q, stream)
                            : launch_1wg_for_inputs<64, 3, true>(q, stream);
  return cudaErrorInvalidValue;
}

cudaError_t biased_attributes(int head_dim_padded, int ctas_per_sm, bool thread_k, cudaFuncAttributes* attr,
                              int* dynamic_smem) {
  if (head_dim_padded == 128)
    return ctas_per_sm == 2 ? attributes_1wg<128, 2, true>(thread_k, attr, dynamic_smem)
                            : attributes_1wg<128, 3, true>(thread_k, attr, dynamic_smem);
  if (head_dim_padded == 64)
    return ctas_per_sm == 2 ? attributes_1wg<64, 2, true>(thread_k, attr, dynamic_smem)
                            : attributes_1wg<64, 3, true>(thread_k, attr, dynamic_smem);
  return cudaErrorInvalidValue;
}

}  // namespace sage_sm90

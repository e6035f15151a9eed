// The one-warpgroup kernels that rotate and quantize Q in their prologue (kRopeQ, Params::xq): the fused rope prep's
// Q kernel moved into the attention kernel (sage_compile/prep.py routes raw Q here on sm90). A translation unit of
// their own, compiled beside attention.cu in parallel (setup.py).
#include "launch.cuh"

namespace sage_sm90 {

cudaError_t launch_1wg_rope_q(const Params& q, cudaStream_t stream, int ctas_per_sm) {
  if (q.head_dim_padded == 128) {
    if (ctas_per_sm == 2) return launch_1wg_for_inputs<128, 2, false, false, true>(q, stream);
    if (ctas_per_sm == 3) return launch_1wg_for_inputs<128, 3, false, false, true>(q, stream);
  } else if (q.head_dim_padded == 64) {
    if (ctas_per_sm == 2) return launch_1wg_for_inputs<64, 2, false, false, true>(q, stream);
    if (ctas_per_sm == 3) return launch_1wg_for_inputs<64, 3, false, false, true>(q, stream);
    if (ctas_per_sm == 4) return launch_1wg_for_inputs<64, 4, false, false, true>(q, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t rope_q_attributes(int head_dim_padded, int ctas_per_sm, bool thread_k, cudaFuncAttributes* attr,
                              int* dynamic_smem) {
  if (head_dim_padded == 128) {
    if (ctas_per_sm == 2) return attributes_1wg<128, 2, false, false, true>(thread_k, attr, dynamic_smem);
    if (ctas_per_sm == 3) return attributes_1wg<128, 3, false, false, true>(thread_k, attr, dynamic_smem);
  } else if (head_dim_padded == 64) {
    if (ctas_per_sm == 2) return attributes_1wg<64, 2, false, false, true>(thread_k, attr, dynamic_smem);
    if (ctas_per_sm == 3) return attributes_1wg<64, 3, false, false, true>(thread_k, attr, dynamic_smem);
    if (ctas_per_sm == 4) return attributes_1wg<64, 4, false, false, true>(thread_k, attr, dynamic_smem);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sage_sm90

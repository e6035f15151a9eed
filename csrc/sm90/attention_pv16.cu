// The one-warpgroup kernels with fp16 P̂ and V̂ (pv = fp16, Params::pv16; kernel.cuh's kPV16): natural key order,
// eight k16 steps per block, with and without score biases. A translation unit of their own, compiled beside
// attention.cu and attention_bias.cu in parallel (setup.py).
#include "launch.cuh"

namespace sage_sm90 {

template <int D, int CtasPerSm>
static cudaError_t launch_pv16_for(const Params& q, cudaStream_t stream) {
  const bool biased = q.delta_s != nullptr || q.mask != nullptr;
  return biased ? launch_1wg_for_inputs<D, CtasPerSm, true, true>(q, stream)
                : launch_1wg_for_inputs<D, CtasPerSm, false, true>(q, stream);
}

cudaError_t launch_1wg_pv16(const Params& q, cudaStream_t stream, int ctas_per_sm) {
  if (q.head_dim_padded == 128 && ctas_per_sm == 2) return launch_pv16_for<128, 2>(q, stream);
  if (q.head_dim_padded == 64)
    return ctas_per_sm == 2 ? launch_pv16_for<64, 2>(q, stream) : launch_pv16_for<64, 3>(q, stream);
  return cudaErrorInvalidValue;
}

cudaError_t pv16_attributes(int head_dim_padded, int ctas_per_sm, bool biased, cudaFuncAttributes* attr,
                            int* dynamic_smem) {
  if (head_dim_padded == 128 && ctas_per_sm == 2)
    return biased ? attributes_1wg<128, 2, true, true>(false, attr, dynamic_smem)
                  : attributes_1wg<128, 2, false, true>(false, attr, dynamic_smem);
  if (head_dim_padded == 64 && ctas_per_sm == 2)
    return biased ? attributes_1wg<64, 2, true, true>(false, attr, dynamic_smem)
                  : attributes_1wg<64, 2, false, true>(false, attr, dynamic_smem);
  if (head_dim_padded == 64 && ctas_per_sm == 3)
    return biased ? attributes_1wg<64, 3, true, true>(false, attr, dynamic_smem)
                  : attributes_1wg<64, 3, false, true>(false, attr, dynamic_smem);
  return cudaErrorInvalidValue;
}

}  // namespace sage_sm90

// Host-side pieces the launching translation units share (attention.cu: the kernels without score biases;
// attention_bias.cu: the ones with — separate files so that nvcc compiles the two sets in parallel).
#pragma once

#include "kernel.cuh"

namespace sage_sm90 {

template <typename Kernel>
static inline cudaError_t allow_smem(Kernel kernel, int bytes, unsigned& configured) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= 32 || !(configured & (1u << device))) {  // one bit per device (≤ 32 devices)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
    if (device < 32) configured |= 1u << device;
  }
  return cudaSuccess;
}

template <int D, int CtasPerSm, bool kMaps, bool kThreadK, bool kPairs, bool kBias = false, bool kPV16 = false,
          bool kRopeQ = false>
static cudaError_t launch_1wg_with(const Params& p, cudaStream_t stream) {
  static unsigned configured = 0;
  constexpr int kSmem = SmemLayout1<D, Stages1<D, CtasPerSm, kPV16>(), kPV16, kRopeQ>::kDynamic;
  auto kernel = attention_kernel_1wg<D, CtasPerSm, kMaps, kThreadK, kPairs, kBias, kPV16, kRopeQ>;
  cudaError_t err = allow_smem(kernel, kSmem, configured);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.nq + kBlockM1 - 1) / kBlockM1, p.batch * p.hq);
  kernel<<<grid, 128, kSmem, stream>>>(p);
  return cudaGetLastError();
}

// Whether the epilogue may move head-dim elements in pairs (kPairs): bf16 out with its head dim contiguous and
// unpadded, every pair's first element at an even index from a base aligned for two (out, δV, μV), so one
// vector access each. (Pairs start at even d; a row starts at an even element when every stride is even.)
static inline bool pairs_aligned(const Params& p) {
  const auto even = [](int64_t x) { return x % 2 == 0; };
  const auto aligned = [](const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  if (p.out_dtype != kOutBF16 || p.o_sd != 1 || p.head_dim != p.head_dim_padded) return false;
  if (!aligned(p.out, 4) || !even(p.o_sb) || !even(p.o_sh) || !even(p.o_sn)) return false;
  if (!aligned(p.v_scale, 8) || !even(p.vs_sb) || !even(p.vs_sh)) return false;
  return p.v_mean == nullptr || (aligned(p.v_mean, 8) && even(p.vm_sb) && even(p.vm_sh));
}

// The one-warpgroup instantiation for the inputs (`q`'s tensor maps already filled): tensor maps or cp.async,
// per-key or per-thread-group δK, pair epilogue; kBias and kPV16 are fixed by the translation unit that launches
// (fp16 PV has no per_thread δK: its key order is not the one the groups follow). kRopeQ: Q's rotary in the
// prologue (attention_rope_q.cu).
template <int D, int CtasPerSm, bool kBias, bool kPV16 = false, bool kRopeQ = false>
static cudaError_t launch_1wg_for_inputs(const Params& q, cudaStream_t stream) {
  if constexpr (kPV16) {
    if (q.k_thread_groups) return cudaErrorInvalidValue;
    if (!q.tma) return launch_1wg_with<D, CtasPerSm, false, false, false, kBias, true>(q, stream);
    return pairs_aligned(q) ? launch_1wg_with<D, CtasPerSm, true, false, true, kBias, true>(q, stream)
                            : launch_1wg_with<D, CtasPerSm, true, false, false, kBias, true>(q, stream);
  } else {
    if (!q.tma) return launch_1wg_with<D, CtasPerSm, false, false, false, kBias, false, kRopeQ>(q, stream);
    const bool pairs = pairs_aligned(q);
    if (q.k_thread_groups) {
      return pairs ? launch_1wg_with<D, CtasPerSm, true, true, true, kBias, false, kRopeQ>(q, stream)
                   : launch_1wg_with<D, CtasPerSm, true, true, false, kBias, false, kRopeQ>(q, stream);
    }
    return pairs ? launch_1wg_with<D, CtasPerSm, true, false, true, kBias, false, kRopeQ>(q, stream)
                 : launch_1wg_with<D, CtasPerSm, true, false, false, kBias, false, kRopeQ>(q, stream);
  }
}

// Resources kernel_info reports for a one-warpgroup shape: the tensor-map instantiation with the pair epilogue
// (bf16 out; the cp.async one runs only where no map can be made, the element-wise epilogue for other outputs).
template <int D, int CtasPerSm, bool kBias, bool kPV16 = false, bool kRopeQ = false>
static cudaError_t attributes_1wg(bool thread_k, cudaFuncAttributes* attr, int* dynamic_smem) {
  *dynamic_smem = SmemLayout1<D, Stages1<D, CtasPerSm, kPV16>(), kPV16, kRopeQ>::kDynamic;
  if constexpr (kPV16) {
    if (thread_k) return cudaErrorInvalidValue;
    return cudaFuncGetAttributes(attr, attention_kernel_1wg<D, CtasPerSm, true, false, true, kBias, true>);
  } else {
    return thread_k
               ? cudaFuncGetAttributes(attr, attention_kernel_1wg<D, CtasPerSm, true, true, true, kBias, false, kRopeQ>)
               : cudaFuncGetAttributes(attr, attention_kernel_1wg<D, CtasPerSm, true, false, true, kBias, false, kRopeQ>);
  }
}

// The instantiations that read ΔS / attn_mask (CtasPerSm 2 or 3); defined in attention_bias.cu.
cudaError_t launch_1wg_biased(const Params& q, cudaStream_t stream, int ctas_per_sm);
cudaError_t biased_attributes(int head_dim_padded, int ctas_per_sm, bool thread_k, cudaFuncAttributes* attr,
                              int* dynamic_smem);

// The fp16-PV instantiations (p.pv16), with and without score biases; defined in attention_pv16.cu. Launch shapes:
// D=64 two or three CTAs per SM, D=128 two (an fp16 stage does not fit three); others return cudaErrorInvalidValue.
cudaError_t launch_1wg_pv16(const Params& q, cudaStream_t stream, int ctas_per_sm);
cudaError_t pv16_attributes(int head_dim_padded, int ctas_per_sm, bool biased, cudaFuncAttributes* attr,
                            int* dynamic_smem);

// The instantiations with Q's rotary and quantization in the prologue (p.xq; e4m3 PV, no score biases): D=64 two,
// three or four CTAs per SM, D=128 two or three; defined in attention_rope_q.cu.
cudaError_t launch_1wg_rope_q(const Params& q, cudaStream_t stream, int ctas_per_sm);
cudaError_t rope_q_attributes(int head_dim_padded, int ctas_per_sm, bool thread_k, cudaFuncAttributes* attr,
                              int* dynamic_smem);

}  // namespace sage_sm90

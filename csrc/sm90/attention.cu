// Launching the sm90 kernels (csrc/sm90/kernel.cuh): tensor maps, the instantiation for the inputs, the
// resources kernel_info reports. The kernels that read ΔS / an attn_mask are instantiated in attention_bias.cu.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <cstdlib>
#include <cstring>

#include "launch.cuh"

namespace sage_sm90 {

// cuTensorMapEncodeTiled from the driver the runtime already loaded (no -lcuda); null if unavailable.
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// A size-1 dimension's stride is arbitrary in torch; the tensor map wants it to cover the dimension inside.
static uint64_t outer_stride(int64_t stride, int64_t size, uint64_t inner_extent) {
  return size <= 1 ? inner_extent : static_cast<uint64_t>(stride);
}

// SAGE_SM90_TMA=0 turns the tensor maps off (every copy a cp.async) for side-by-side measurement.
static bool tensor_maps_enabled() {
  static const bool enabled = [] {
    const char* text = std::getenv("SAGE_SM90_TMA");
    return text == nullptr || std::strcmp(text, "0") != 0;
  }();
  return enabled;
}

static bool aligned16(uint64_t x) { return x % 16 == 0; }

// Tensor maps of K (permuted-row halves, see KeyOrder; pv16: the block's rows in natural order), Vᵀ (e4m3, or
// fp16 in 64-key boxes) and δK for the one-warpgroup kernel, all or none: tma = 1 only when every map encodes. Keys past Nk read as zeros (the copy engine fills them), so
// the tail block needs no special case. Strides the copy engine cannot take (not multiples of 16 bytes),
// Nk not a multiple of 4 (K's rows are addressed as quads) or shorter than one block leave tma = 0.
static void fill_tensor_maps(Params& q) {
  q.tma = 0;
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || !tensor_maps_enabled() || q.nk < kBlockN || q.nk % 4 != 0) return;
  const int d = q.head_dim_padded;
  const cuuint64_t batch = static_cast<cuuint64_t>(q.batch), heads = static_cast<cuuint64_t>(q.hkv);
  cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  // Vᵀ [B, Hkv, Dp, Nkp]: dims (key, d, head, batch), box 128 keys × Dp rows of e4m3 — or, pv16, 64 keys of fp16
  // (a box row is 128 bytes either way: the swizzle width). Strides in bytes.
  {
    const uint64_t elem = q.pv16 ? 2 : 1;
    const uint64_t sd = q.v_sd * elem, sh = outer_stride(q.v_sh * elem, q.hkv, sd * d);
    const uint64_t sb = outer_stride(q.v_sb * elem, q.batch, sh * q.hkv);
    cuuint64_t dims[4] = {static_cast<cuuint64_t>(q.nkp), static_cast<cuuint64_t>(d), heads, batch};
    cuuint64_t strides[3] = {sd, sh, sb};
    cuuint32_t box[4] = {static_cast<cuuint32_t>(kBlockN / elem), static_cast<cuuint32_t>(d), 1, 1};
    const CUtensorMapDataType type = q.pv16 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8;
    if (!aligned16(reinterpret_cast<uint64_t>(q.v)) || !aligned16(sd) || !aligned16(sh) || !aligned16(sb)) return;
    if (encode(&q.v_map, type, 4, const_cast<uint8_t*>(q.v), dims, strides, box, unit,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return;
  }
  // K [B, Hkv, Nk, Dp] bytes: dims (d, r, quad, head, batch) with key = 4·quad + r; a box is one half
  // (r ∈ {2a, 2a + 1}) of a block's 32 quads — pv16: all four r, the block's rows in natural order.
  {
    const int quads = q.nk / 4;
    const uint64_t sn = q.k_sn, sh = outer_stride(q.k_sh, q.hkv, sn * q.nk);
    const uint64_t sb = outer_stride(q.k_sb, q.batch, sh * q.hkv);
    cuuint64_t dims[5] = {static_cast<cuuint64_t>(d), 4, static_cast<cuuint64_t>(quads), heads, batch};
    cuuint64_t strides[4] = {sn, 4 * sn, sh, sb};
    cuuint32_t box[5] = {static_cast<cuuint32_t>(d), q.pv16 ? 4u : 2u, kBlockN / 4, 1, 1};
    const CUtensorMapSwizzle swizzle = d == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
    if (!aligned16(reinterpret_cast<uint64_t>(q.k)) || !aligned16(sn) || !aligned16(sh) || !aligned16(sb)) return;
    if (encode(&q.k_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 5, const_cast<int8_t*>(q.k), dims, strides, box, unit,
               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return;
  }
  // δK [B, Hkv, Nk] fp32 (keys contiguous): dims (key, head, batch), box 128 keys.
  {
    const uint64_t sh = outer_stride(q.ks_sh, q.hkv, q.nk) * 4;
    const uint64_t sb = outer_stride(q.ks_sb, q.batch, sh / 4 * q.hkv) * 4;
    cuuint64_t dims[3] = {static_cast<cuuint64_t>(q.nk), heads, batch};
    cuuint64_t strides[2] = {sh, sb};
    cuuint32_t box[3] = {kBlockN, 1, 1};
    if (!aligned16(reinterpret_cast<uint64_t>(q.k_scale)) || !aligned16(sh) || !aligned16(sb)) return;
    if (encode(&q.ks_map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<float*>(q.k_scale), dims, strides, box,
               unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return;
  }
  q.tma = 1;
}

// Rows of a score bias aligned for one 4-key load (16 B fp32, 4 B bool) and keys contiguous (add_bias).
static bool bias_vec(const void* base, int elem_bytes, int64_t sb, int64_t sh, int64_t sr, int64_t sk) {
  const auto four = [](int64_t x) { return x % 4 == 0; };
  return reinterpret_cast<uintptr_t>(base) % (4 * elem_bytes) == 0 && sk == 1 && four(sb) && four(sh) && four(sr);
}

// The instantiation for the inputs: tensor maps or cp.async, per-key or per-thread-group δK, pair epilogue,
// score biases, fp16 PV.
template <int D, int CtasPerSm>
static cudaError_t launch_1wg(const Params& p, cudaStream_t stream) {
  Params q = p;
  fill_tensor_maps(q);
  const bool biased = q.delta_s != nullptr || q.mask != nullptr;
  if (biased) {
    q.ds_vec = bias_vec(q.delta_s, 4, q.ds_sb, q.ds_sh, q.ds_sr, q.ds_sk);
    q.mask_vec = bias_vec(q.mask, q.mask_bool ? 1 : 4, q.mask_sb, q.mask_sh, q.mask_sr, q.mask_sk);
  }
  if (q.xq != nullptr) return launch_1wg_rope_q(q, stream, CtasPerSm);
  if (q.pv16) return launch_1wg_pv16(q, stream, CtasPerSm);
  if (biased) return launch_1wg_biased(q, stream, CtasPerSm == 2 ? 2 : 3);  // variant 3 takes v2's (none of 4)
  return launch_1wg_for_inputs<D, CtasPerSm, false>(q, stream);
}

template <int D>
static cudaError_t launch_for(const Params& p, cudaStream_t stream, int variant) {
  if (variant == 1) return launch_1wg<D, 2>(p, stream);
  if (variant == 2) return launch_1wg<D, 3>(p, stream);
  if constexpr (D == 64) {
    if (variant == 3) return launch_1wg<D, 4>(p, stream);
  }
  static unsigned configured = 0;
  constexpr int kSmem = SmemLayout<D>::kDynamic;
  cudaError_t err = allow_smem(attention_kernel<D>, kSmem, configured);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.nq + kBlockM - 1) / kBlockM, p.batch * p.hq);
  attention_kernel<D><<<grid, kConsumerThreads + 128, kSmem, stream>>>(p);
  return cudaGetLastError();
}

const char* launch(const Params& p, int64_t stream, int variant) {
  if (p.batch == 0 || p.hq == 0 || p.nq == 0) return "";
  if (variant < 0 || variant > 3)
    return "sm90 kernel: variant must be 0 (warp-specialized), 1, 2 or 3 (one warpgroup, 2/3/4 CTAs per SM)";
  if (variant == 3 && p.head_dim_padded != 64) return "sm90 kernel: variant 3 (four CTAs per SM) exists at D=64 only";
  if (variant == 0 && (p.delta_s != nullptr || p.mask != nullptr))
    return "sm90 kernel: ΔS and attn_mask are read by the one-warpgroup variants (1-3) only";
  if (p.pv16 && (variant == 0 || variant == 3 || (variant == 2 && p.head_dim_padded == 128)))
    return "sm90 kernel: fp16 PV runs on variant 1, and on variant 2 at head dim 64 only";
  if (p.pv16 && p.k_thread_groups)
    return "sm90 kernel: fp16 PV has no per_thread δK instantiation (its key order is not the groups')";
  if (p.xq != nullptr && (variant == 0 || p.pv16 || p.delta_s != nullptr || p.mask != nullptr))
    return "sm90 kernel: Q's rotary in the prologue runs on variants 1-3 with e4m3 PV and no ΔS / attn_mask";
  if (p.xq != nullptr && p.head_dim != p.head_dim_padded)
    return "sm90 kernel: Q's rotary in the prologue needs an unpadded head dim (64 or 128)";
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t err;
  if (p.head_dim_padded == 128) {
    err = launch_for<128>(p, s, variant);
  } else if (p.head_dim_padded == 64) {
    err = launch_for<64>(p, s, variant);
  } else {
    return "sm90 kernel: padded head dim must be 64 or 128";
  }
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

template <int D>
static cudaError_t attributes_for(int variant, bool thread_k, bool biased, bool pv16, bool rope_q,
                                  cudaFuncAttributes* attr, int* dynamic_smem) {
  if (rope_q) {
    if (variant == 0 || biased || pv16) return cudaErrorInvalidValue;
    return rope_q_attributes(D, variant + 1, thread_k, attr, dynamic_smem);
  }
  if (pv16) {
    if (variant == 0 || thread_k) return cudaErrorInvalidValue;
    return pv16_attributes(D, variant == 1 ? 2 : 3, biased, attr, dynamic_smem);
  }
  if (biased) {
    if (variant == 0) return cudaErrorInvalidValue;
    return biased_attributes(D, variant == 1 ? 2 : 3, thread_k, attr, dynamic_smem);  // as launch_1wg: v3 runs v2's
  }
  if (variant == 0) {
    *dynamic_smem = SmemLayout<D>::kDynamic;
    return cudaFuncGetAttributes(attr, attention_kernel<D>);
  }
  if (variant == 3) {  // four CTAs per SM: D=64 only (launch() refuses the rest)
    if constexpr (D == 64) return attributes_1wg<D, 4, false>(thread_k, attr, dynamic_smem);
    return cudaErrorInvalidValue;
  }
  return variant == 1 ? attributes_1wg<D, 2, false>(thread_k, attr, dynamic_smem)
                      : attributes_1wg<D, 3, false>(thread_k, attr, dynamic_smem);
}

bool kernel_info(int head_dim_padded, int variant, bool thread_k, bool biased, bool pv16, bool rope_q, int* regs,
                 int* local_bytes, int* dynamic_smem, int* max_threads) {
  if (variant < 0 || variant > 3) return false;
  cudaFuncAttributes attr{};
  cudaError_t err;
  if (head_dim_padded == 128) {
    err = attributes_for<128>(variant, thread_k, biased, pv16, rope_q, &attr, dynamic_smem);
  } else if (head_dim_padded == 64) {
    err = attributes_for<64>(variant, thread_k, biased, pv16, rope_q, &attr, dynamic_smem);
  } else {
    return false;
  }
  if (err != cudaSuccess) return false;
  *regs = attr.numRegs;
  *local_bytes = static_cast<int>(attr.localSizeBytes);
  *max_threads = attr.maxThreadsPerBlock;
  return true;
}

}  // namespace sage_sm90

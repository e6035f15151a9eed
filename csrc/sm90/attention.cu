// Launching the sm90 kernel (csrc/sm90/kernel.cuh): the tensor maps, the score-bias load flags, the instantiation
// for the inputs (looked up in the generated table, launch.cuh) and the resources kernel_info reports.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <cstdio>

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

static bool aligned16(uint64_t x) { return x % 16 == 0; }

// Tensor maps of K (permuted-row halves, see KeyOrder; pv16: the block's rows in natural order), Vᵀ (e4m3, or
// fp16 in 64-key boxes) and δK, all or none: tma = 1 only when every map encodes. Keys past Nk read as zeros (the
// copy engine fills them), so the tail block needs no special case. Strides the copy engine cannot take (not multiples of 16 bytes),
// Nk not a multiple of 4 (K's rows are addressed as quads) or shorter than one block leave tma = 0.
static void fill_tensor_maps(Params& q) {
  q.tma = 0;
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || q.nk < kBlockN || q.nk % 4 != 0) return;
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

// Whether the epilogue may move head-dim elements in pairs (kPairs): bf16 out with its head dim contiguous and
// unpadded, every pair's first element at an even index from a base aligned for two (out, δV, μV), so one
// vector access each. (Pairs start at even d; a row starts at an even element when every stride is even.)
static bool pairs_aligned(const Params& p) {
  const auto even = [](int64_t x) { return x % 2 == 0; };
  const auto aligned = [](const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  if (p.out_dtype != kOutBF16 || p.o_sd != 1 || p.head_dim != p.head_dim_padded) return false;
  if (!aligned(p.out, 4) || !even(p.o_sb) || !even(p.o_sh) || !even(p.o_sn)) return false;
  if (!aligned(p.v_scale, 8) || !even(p.vs_sb) || !even(p.vs_sh)) return false;
  return p.v_mean == nullptr || (aligned(p.v_mean, 8) && even(p.vm_sb) && even(p.vm_sh));
}

static bool same_key(const InstanceKey& a, const InstanceKey& b) {
  return a.head_dim == b.head_dim && a.ctas_per_sm == b.ctas_per_sm && a.maps == b.maps && a.thread_k == b.thread_k &&
         a.pairs == b.pairs && a.bias == b.bias && a.pv16 == b.pv16;
}

static const Instance* find_instance(const InstanceKey& key) {
  for (int g = 0; g < kInstanceGroupCount; ++g)
    for (int i = 0; i < kInstanceGroups[g].count; ++i)
      if (same_key(kInstanceGroups[g].rows[i].key, key)) return &kInstanceGroups[g].rows[i];
  return nullptr;
}

static const char* missing_instance(const InstanceKey& key) {
  static thread_local char text[256];
  std::snprintf(text, sizeof(text),
                "sm90 kernel: no instantiation built for head_dim=%d ctas_per_sm=%d maps=%d thread_k=%d pairs=%d "
                "bias=%d pv16=%d (csrc/sm90/instantiations.py builds those sage_compile/kernels/sm90.py's "
                "heuristics pick)",
                key.head_dim, key.ctas_per_sm, key.maps, key.thread_k, key.pairs, key.bias, key.pv16);
  return text;
}

const char* launch(const Params& p, int64_t stream, int ctas_per_sm) {
  if (p.batch == 0 || p.hq == 0 || p.nq == 0) return "";
  Params q = p;
  fill_tensor_maps(q);
  if (q.cu_blk != nullptr && (q.tma == 0 || q.batch != 1 || q.kv_lens != nullptr || q.delta_s != nullptr ||
                              q.mask != nullptr))
    return "sm90 kernel: a packed batch needs tensor maps (16-byte aligned rows, at least 128 key slots), batch 1 "
           "and no kv_lens, delta_s or attn_mask";
  const bool biased = q.delta_s != nullptr || q.mask != nullptr;
  if (biased) {
    q.ds_vec = bias_vec(q.delta_s, 4, q.ds_sb, q.ds_sh, q.ds_sr, q.ds_sk);
    q.mask_vec = bias_vec(q.mask, q.mask_bool ? 1 : 4, q.mask_sb, q.mask_sh, q.mask_sr, q.mask_sk);
  }
  const bool maps = q.tma != 0;
  const InstanceKey key{q.head_dim_padded, ctas_per_sm, maps, maps && q.k_thread_groups != 0, maps && pairs_aligned(q),
                        biased, q.pv16 != 0};
  const Instance* instance = find_instance(key);
  if (instance == nullptr) return missing_instance(key);
  const cudaError_t err = instance->launch(q, reinterpret_cast<cudaStream_t>(stream));
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

bool kernel_info(int head_dim_padded, int ctas_per_sm, bool thread_k, bool biased, bool pv16, int* regs,
                 int* local_bytes, int* dynamic_smem, int* max_threads) {
  const Instance* instance = find_instance(InstanceKey{head_dim_padded, ctas_per_sm, true, thread_k, true, biased, pv16});
  if (instance == nullptr) return false;
  cudaFuncAttributes attr{};
  if (instance->attributes(&attr, dynamic_smem) != cudaSuccess) return false;
  *regs = attr.numRegs;
  *local_bytes = static_cast<int>(attr.localSizeBytes);
  *max_threads = attr.maxThreadsPerBlock;
  return true;
}

int instance_count() {
  int n = 0;
  for (int g = 0; g < kInstanceGroupCount; ++g) n += kInstanceGroups[g].count;
  return n;
}

InstanceKey instance_key(int index) {
  for (int g = 0; g < kInstanceGroupCount; ++g) {
    if (index < kInstanceGroups[g].count) return kInstanceGroups[g].rows[index].key;
    index -= kInstanceGroups[g].count;
  }
  return InstanceKey{0, 0, false, false, false, false, false};
}

}  // namespace sage_sm90

// Shared-memory layout of the sm90 kernel: the block sizes, the CTA's dynamic shared memory (Q tile, the
// pipeline's K / Vᵀ / δK stages, their mbarriers), the 64/128-byte swizzle and wgmma descriptors, and KeyOrder —
// where each key of a block sits among K's shared-memory rows and the S accumulator's columns.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace sage_sm90 {

constexpr int kBlockM = 64;   // query rows per CTA (one warpgroup)
constexpr int kBlockN = 128;  // keys per pipeline stage (the oracle's block_n)


// wgmma shared-memory descriptor of a K-major tile with rows of `row_bytes` (64 or 128) bytes, swizzled
// at that width (the layout our cp.async writes): stride between 8-row groups = 8 rows.
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t addr, int row_bytes) {
  uint64_t desc = (addr & 0x3FFFF) >> 4;
  desc |= uint64_t(1) << 16;                          // leading byte offset: unused when swizzled
  desc |= uint64_t((8 * row_bytes) >> 4) << 32;       // stride byte offset
  desc |= uint64_t(row_bytes == 128 ? 1 : 2) << 62;   // 128-byte or 64-byte swizzle
  return desc;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of `RowBytes`-byte rows, swizzled the
// way wgmma reads it (128B: chunk ^ row%8; 64B: chunk ^ (row/2)%4). Tile bases are 1024-aligned.
template <int RowBytes>
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  const int x = RowBytes == 128 ? (row & 7) : ((row >> 1) & 3);
  return row * RowBytes + ((chunk ^ x) << 4);
}

// Where the keys of a block sit among the S columns, which decides the shared-memory row of each K row.
// Permuted (kNatural = false; the e4m3 P operand, k32 steps): key 16G + 4t + 2a + b goes to row
// 64a + 8G + 2t + b, so S column c = 8i + 2t + e of the accumulator holds key key_of_column(i, t, e) =
// 16(i mod 8) + 4t + 2(i div 8) + e. Natural (kNatural = true; the fp16 P operand, k16 steps, whose A fragment is
// the accumulator's own layout): column c holds key c.
// A thread's 32 keys of one row come in kRuns runs of kRunKeys consecutive keys (run r from key run_start(r, t));
// acc_index(r, c, hr) is the accumulator index of key c of run r in the thread's row hr (index 4i + 2hr + e ↔
// row g + 8hr, column 8i + 2t + e).
template <bool kNatural>
struct KeyOrder {
  static constexpr int kRuns = kNatural ? 16 : 8, kRunKeys = kNatural ? 2 : 4, kRunStride = kNatural ? 8 : 16;
  __device__ static __forceinline__ int k_row_of_key(int n) {
    return kNatural ? n : 64 * ((n >> 1) & 1) + 8 * (n >> 4) + 2 * ((n >> 2) & 3) + (n & 1);
  }
  __device__ static __forceinline__ int key_of_column(int i, int t, int e) {
    return kNatural ? 8 * i + 2 * t + e : 16 * (i & 7) + 4 * t + 2 * (i >> 3) + e;
  }
  __device__ static __forceinline__ int run_start(int r, int t) { return kRunStride * r + kRunKeys * t; }
  __device__ static __forceinline__ int acc_index(int r, int c, int hr) {
    return kNatural ? 4 * r + 2 * hr + c : 4 * (r + 8 * (c >> 1)) + 2 * hr + (c & 1);
  }
  using RunFloats = std::conditional_t<kNatural, float2, float4>;  // one run of fp32 values: one vector load
  __device__ static __forceinline__ void unpack(const RunFloats& f, float* out) {
    out[0] = f.x, out[1] = f.y;
    if constexpr (!kNatural) out[2] = f.z, out[3] = f.w;
  }
};
using PermutedKeys = KeyOrder<false>;

// The CTA's dynamic shared memory: Q [64 rows][D] int8, then per stage K [128 keys][D] int8, Vᵀ [D][128 keys]
// e4m3 (kPV16: fp16, two tiles [D][64 keys], twice the bytes; BlockCopier), δK [128] fp32, and the stages'
// mbarriers. Tile bases are 1024-aligned (128-byte swizzle).
template <int D, int Stages = 3, bool kPV16 = false>
struct SmemLayout {
  static constexpr int kStages = Stages;
  static constexpr int kQBytes = kBlockM * D;
  static constexpr int kKBytes = kBlockN * D;
  static constexpr int kVBytes = D * kBlockN * (kPV16 ? 2 : 1);
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kQBytes;
  static constexpr int kV = kK + kStages * kKBytes;
  static constexpr int kKScale = kV + kStages * kVBytes;
  // Per stage (tensor maps only): "its bytes landed" (full) and "all four warps are done with it" (empty).
  static constexpr int kFull = kKScale + kStages * kBlockN * 4;
  static constexpr int kEmpty = kFull + kStages * 8;
  static constexpr int kBytes = kEmpty + kStages * 8;
  static constexpr int kDynamic = kBytes + 1024;
};

// Pipeline stages: as many as fit beside the other resident CTAs (228 KB; four CTAs per SM at D=64:
// 4 × (55856 + 1024 reserved) bytes). fp16 Vᵀ doubles a stage's V bytes: D=128 fits two CTAs per SM with two
// stages, not three CTAs (0: no such kernel).
template <int D, int CtasPerSm, bool kPV16 = false>
__host__ __device__ constexpr int pipeline_stages() {
  if constexpr (kPV16) return D == 128 ? (CtasPerSm == 2 ? 2 : 0) : (CtasPerSm == 2 ? 3 : 2);
  return CtasPerSm == 2 ? 3 : (D == 128 ? 2 : 3);
}

}  // namespace sage_sm90

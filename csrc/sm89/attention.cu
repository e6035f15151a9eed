// INT4 QKᵀ attention on mma.sync (SageAttention2's 4-bit rung): QK on the 4-bit integer MMA (m16n8k64 .s4) of
// Ampere and Ada (sm80, sm86, sm89), PV on Ada's e4m3 MMA (m16n8k32) or, with pv="fp16", on the fp16 MMA
// (m16n8k16) every one of them has. Hopper (sm90) accepts the same instructions but has no 4-bit or mma.sync-fp8
// units: ptxas rewrites them as int8 / fp16 products (exact, slower), which is how the tests run this kernel on an
// H100.
//
// The spec's kernel contract (sage_compile/numerics/spec.py, steps 4-7) with block_n = 64:
//   S = (q̂·k̂ᵀ)·δK·δQ + ΔS (base 2), online softmax P̃ = exp2(S − m), P̂ = e4m3(448·P̃), l from fp32 P̃,
//   per key block acc = P̂·V̂ from zero, O = O·exp2(m_old − m_new) + acc, out = O/(448·l)·δV + μV, lse.
//
// A CTA is 4 warps; warp w owns query rows 16w..16w+15 of the CTA's 64. Lane = 4·g + t. Per 64-key block:
//   QK: for each 64-channel step, 8 key tiles of m16n8k64; lane holds the scores of rows g, g+8 at its tile
//       columns 2t, 2t+1.
//   Key order (e4m3 PV): K̂ rows are written to shared memory permuted (key_row), so that tile i column 2t+e holds
//       key 16(i/2) + 4t + 2(i%2) + e. A lane's scores of keys 32c + 4t + 0..3 (and + 16) are then exactly the
//       e4m3 A-fragment of the PV step c over keys 32c..32c+31, and V̂ᵀ stays in its natural key order. fp16 PV
//       needs no permutation: tiles 2c, 2c+1 in natural order are the fp16 A fragment of the step over 16c..16c+15.
//   PV: for each 8-channel tile, the block's k steps (two e4m3 k32, or four fp16 k16) into a fresh accumulator,
//       then O = O·α + acc.
// Shared memory rows are padded by 16 bytes: the 32-bit fragment loads of 8 rows × 4 lanes hit 32 banks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "params.h"

namespace sage_sm89 {
namespace {

constexpr int kRows = 64;             // query rows per CTA
constexpr int kKeys = 64;             // keys per block (the spec's block_n)
constexpr int kThreads = 128;
constexpr float kLog2PScale = 8.807354922057604f;  // log2 448: exp2 yields 448·P̃
constexpr float kLn2 = 0.6931471805599453f;

template <int DP, bool kPV16>
struct Stage {
  static constexpr int kKStride = DP / 2 + 16;  // bytes per packed K̂ row
  static constexpr int kVElem = kPV16 ? 2 : 1;  // bytes per V̂ᵀ element
  static constexpr int kVStride = kKeys * kVElem + 16;  // bytes per V̂ᵀ channel row
  alignas(16) uint8_t k[kKeys * kKStride];
  alignas(16) uint8_t v[DP * kVStride];
  float k_scale[kKeys];
  float delta_s[kKeys];
};

// Shared-memory row of key n (0..63) of a block: see the key order above.
template <bool kPV16>
__device__ __forceinline__ int key_row(int n) {
  return kPV16 ? n : 16 * (n >> 4) + 8 * ((n >> 1) & 1) + 2 * ((n >> 2) & 3) + (n & 1);
}

// Key (0..63) of score tile i, column 2t + e.
template <bool kPV16>
__device__ __forceinline__ int tile_key(int i, int t, int e) {
  return kPV16 ? 8 * i + 2 * t + e : 16 * (i >> 1) + 4 * t + 2 * (i & 1) + e;
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared, zeros where !valid (src is then not read).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void mma_s4(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k64.row.col.s32.s4.s4.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The e4m3 MMA and conversion exist from sm89 on; the sm80/86 builds hold the fp16-PV kernels only (sm89.py never
// launches an e4m3 one there).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define SAGE_SM89_E4M3 1
#endif

__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef SAGE_SM89_E4M3
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four fp32 → four e4m3 (round to nearest even, saturating at ±448, NaN kept), x0 in the low byte.
__device__ __forceinline__ uint32_t pack_e4m3(float x0, float x1, float x2, float x3) {
#ifdef SAGE_SM89_E4M3
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
#else
  __trap();
  return 0;
#endif
}

// Two fp32 → two fp16 (round to nearest even), x0 in the low half.
__device__ __forceinline__ uint32_t pack_f16(float x0, float x1) {
  uint32_t packed;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(x1), "f"(x0));
  return packed;
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t load32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Max and sum over the four lanes of a quad (the lanes that hold one row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <typename OutT>
__device__ __forceinline__ OutT to_out(float x);
template <>
__device__ __forceinline__ float to_out<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half to_out<__half>(float x) {  // saturates at ±65504, NaN stays NaN (spec.saturate)
  return __float2half_rn(fabsf(x) > 65504.f ? copysignf(65504.f, x) : x);
}

// One key block's K̂, V̂ᵀ, δK and ΔS into ``stage`` (cp.async for the tiles; δK and ΔS through registers).
template <int DP, bool kPV16>
__device__ __forceinline__ void load_block(const Params& p, Stage<DP, kPV16>& stage, int start, const uint8_t* k_head,
                                           const uint8_t* v_head, const float* ks_head, const float* ds_row) {
  using S = Stage<DP, kPV16>;
  constexpr int kChunks = DP / 32;                      // 16-byte chunks of a packed K̂ row
  constexpr int kVChunks = kKeys * S::kVElem / 16;      // 16-byte chunks of a V̂ᵀ row's block
  constexpr int kChunkKeys = 16 / S::kVElem;
  for (int c = threadIdx.x; c < kKeys * kChunks; c += kThreads) {
    const int n = c / kChunks, chunk = c % kChunks, key = start + n;
    const bool valid = key < p.nk;
    copy16(stage.k + key_row<kPV16>(n) * S::kKStride + 16 * chunk, k_head + (valid ? key : 0) * p.k_sn + 16 * chunk,
           valid);
  }
  for (int c = threadIdx.x; c < DP * kVChunks; c += kThreads) {
    const int d = c / kVChunks, chunk = c % kVChunks, col = start + kChunkKeys * chunk;
    const bool valid = col < p.nkp;  // V̂ᵀ past Nkp reads as zero: P̂ = 0 there must not meet a stale NaN pattern
    copy16(stage.v + d * S::kVStride + 16 * chunk, v_head + (d * p.v_sd + (valid ? col : 0)) * S::kVElem, valid);
  }
  copy_commit();
  const int n = threadIdx.x % kKeys, key = start + n;
  if (threadIdx.x < kKeys) {
    stage.k_scale[n] = key < p.nk ? ks_head[key] : 0.f;
  } else {
    stage.delta_s[n] = (ds_row != nullptr && key < p.nk) ? ds_row[key] : 0.f;
  }
}

template <int DP, bool kPV16, typename OutT>
__global__ void __launch_bounds__(kThreads) attention_kernel(const Params p) {
  using S = Stage<DP, kPV16>;
  constexpr int kSteps = DP / 64;  // 64-channel k steps of the QK product
  constexpr int kTiles = DP / 8;   // 8-channel tiles of O
  __shared__ S stages[2];

  const int block_m = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // heaviest causal blocks first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.gqa;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int q0 = block_m * kRows;
  const int row[2] = {q0 + 16 * warp + g, q0 + 16 * warp + g + 8};
  const bool row_ok[2] = {row[0] < p.nq, row[1] < p.nq};

  // Q̂ fragments for the whole loop: a0/a2 row g, a1/a3 row g + 8; channels 64s + 8t.. and 64s + 32 + 8t..
  const uint8_t* q_head = p.q + b * p.q_sb + h * p.q_sh;
  uint32_t qa[kSteps][4];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int which = r & 1;
      qa[s][r] = row_ok[which] ? load32(q_head + row[which] * p.q_sn + 32 * s + 16 * (r >> 1) + 4 * t) : 0u;
    }
  }
  float dq[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) dq[r] = row_ok[r] ? p.q_scale[b * p.qs_sb + h * p.qs_sh + row[r]] : 0.f;

  const uint8_t* k_head = p.k + b * p.k_sb + hk * p.k_sh;
  const uint8_t* v_head = p.v + (b * p.v_sb + hk * p.v_sh) * S::kVElem;
  const float* ks_head = p.k_scale + b * p.ks_sb + hk * p.ks_sh;
  const float* ds_row = p.delta_s == nullptr ? nullptr
                                             : p.delta_s + b * p.ds_sb + h * p.ds_sh + (q0 / p.q_group) * p.ds_sg;

  int n_valid = p.nk;
  if (p.kv_lens != nullptr) {
    const int64_t len = p.kv_lens_int64 ? static_cast<const int64_t*>(p.kv_lens)[b]
                                        : static_cast<const int32_t*>(p.kv_lens)[b];
    n_valid = static_cast<int>(len < 0 ? 0 : (len > p.nk ? p.nk : len));
  }
  int hi = n_valid, full = n_valid;  // keys to visit; keys every row of the CTA sees
  if (p.causal) {
    const int q_hi = min(q0 + kRows, p.nq);
    hi = min(n_valid, q_hi + p.causal_offset);
    full = min(n_valid, q0 + p.causal_offset + 1);
  }
  hi = max(hi, 0);
  const int full_end = (max(full, 0) / kKeys) * kKeys;
  const int n_blocks = (hi + kKeys - 1) / kKeys;

  float o[kTiles][4];
#pragma unroll
  for (int n = 0; n < kTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this lane's share of the row sum

  if (n_blocks > 0) load_block<DP, kPV16>(p, stages[0], 0, k_head, v_head, ks_head, ds_row);
  for (int j = 0; j < n_blocks; ++j) {
    S& stage = stages[j & 1];
    const int start = j * kKeys;
    if (j + 1 < n_blocks) {
      load_block<DP, kPV16>(p, stages[(j + 1) & 1], start + kKeys, k_head, v_head, ks_head, ds_row);
      copy_wait<1>();
    } else {
      copy_wait<0>();
    }
    __syncthreads();

    // S tiles: exact int32 dots.
    int acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint8_t* kr = stage.k + (8 * i + g) * S::kKStride + 32 * s + 4 * t;
        mma_s4(acc[i], qa[s], load32(kr), load32(kr + 16));
      }
    }

    // Scores (base 2): S = (x·δK)·δQ + ΔS, hidden keys −inf; the row max over the quad.
    const bool masked = start >= full_end;
    float sc[8][4];
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int which = r >> 1, kn = tile_key<kPV16>(i, t, r & 1);
        float s = __fmul_rn(__fmul_rn(static_cast<float>(acc[i][r]), stage.k_scale[kn]), dq[which]);
        s = __fadd_rn(s, stage.delta_s[kn]);
        if (masked) {
          const int key = start + kn;
          const bool allowed = key < n_valid && (!p.causal || key <= row[which] + p.causal_offset);
          s = allowed ? s : -INFINITY;
        }
        sc[i][r] = s;
        block_max[which] = fmaxf(block_max[which], s);
      }
    }
    float alpha[2], shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], quad_max(block_max[r]));
      const float m_safe = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: P̃ = 0, α = 0
      alpha[r] = exp2_approx(m[r] - m_safe);
      shift[r] = m_safe - kLog2PScale;
      m[r] = m_new;
    }

    // 448·P̃, its row sums, and P̂ as the e4m3 A fragments of the two 32-key PV steps.
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        sc[i][r] = exp2_approx(sc[i][r] - shift[r >> 1]);
        sum[r >> 1] += sc[i][r];
      }
    }
    l[0] = l[0] * alpha[0] + sum[0];
    l[1] = l[1] * alpha[1] + sum[1];
    constexpr int kPvSteps = kPV16 ? 4 : 2;  // k steps of the block's PV product (16 or 32 keys each)
    uint32_t pa[kPvSteps][4];
#pragma unroll
    for (int c = 0; c < kPvSteps; ++c) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if constexpr (kPV16) {  // r: a0 (row g, keys 16c + 2t..), a1 (row g + 8), a2 / a3 (keys + 8)
          const int i = 2 * c + (r >> 1), e = 2 * (r & 1);
          pa[c][r] = pack_f16(sc[i][e], sc[i][e + 1]);
        } else {  // r: a0 (row g, keys 32c + 4t..), a1 (row g + 8), a2 / a3 (keys + 16)
          const int i = 4 * c + 2 * (r >> 1), e = 2 * (r & 1);
          pa[c][r] = pack_e4m3(sc[i][e], sc[i][e + 1], sc[i + 1][e], sc[i + 1][e + 1]);
        }
      }
    }

    // O = O·α + P̂·V̂ (a fresh accumulator per key block).
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
      float pv[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int c = 0; c < kPvSteps; ++c) {
        if constexpr (kPV16) {  // b0: keys 16c + 2t, +1 of channel 8n + g; b1: keys + 8
          const uint8_t* vr = stage.v + (8 * n + g) * S::kVStride + 2 * (16 * c + 2 * t);
          mma_f16(pv, pa[c], load32(vr), load32(vr + 16));
        } else {  // b0: keys 32c + 4t..+3 of channel 8n + g; b1: keys + 16
          const uint8_t* vr = stage.v + (8 * n + g) * S::kVStride + 32 * c + 4 * t;
          mma_e4m3(pv, pa[c], load32(vr), load32(vr + 16));
        }
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) o[n][r] = o[n][r] * alpha[r >> 1] + pv[r];
    }
    __syncthreads();  // every read of this stage done before the next block's copies overwrite it
  }

  // Epilogue (spec.py, special values): l + 0·δQ makes a poisoned q row's l NaN; l == 0 is "no key".
  const float* vs = p.v_scale + b * p.vs_sb + hk * p.vs_sh;
  const float* vm = p.v_mean == nullptr ? nullptr : p.v_mean + b * p.vm_sb + hk * p.vm_sh;
  OutT* out = static_cast<OutT*>(p.out) + b * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l448 = quad_sum(l[r]) + dq[r] * 0.f;
    const bool has_keys = l448 != 0.f;
    const float inv = has_keys ? 1.f / l448 : 0.f;
    if (!row_ok[r]) continue;
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int ch = 8 * n + 2 * t + e;
        if (ch >= p.head_dim) continue;
        float x = o[n][2 * r + e] * inv * vs[ch];
        if (vm != nullptr && has_keys) x += vm[ch];
        out[row[r] * p.o_sn + ch * p.o_sd] = to_out<OutT>(x);
      }
    }
    if (t == 0) {
      p.lse[b * p.l_sb + h * p.l_sh + row[r]] =
          has_keys ? (m[r] + (log2f(l448) - kLog2PScale)) * kLn2 : -INFINITY;
    }
  }
}

template <int DP, bool kPV16, typename OutT>
int launch_typed(const Params& p, cudaStream_t stream) {
  const dim3 grid((p.nq + kRows - 1) / kRows, p.hq, p.batch);
  attention_kernel<DP, kPV16, OutT><<<grid, kThreads, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <int DP, bool kPV16>
int launch_pv(const Params& p, int out_dtype, cudaStream_t stream) {
  switch (out_dtype) {
    case kBf16: return launch_typed<DP, kPV16, __nv_bfloat16>(p, stream);
    case kFp16: return launch_typed<DP, kPV16, __half>(p, stream);
    case kFp32: return launch_typed<DP, kPV16, float>(p, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

template <int DP>
int launch_dp(const Params& p, int out_dtype, bool pv16, cudaStream_t stream) {
  return pv16 ? launch_pv<DP, true>(p, out_dtype, stream) : launch_pv<DP, false>(p, out_dtype, stream);
}

}  // namespace

int launch(const Params& p, int head_dim_padded, int out_dtype, bool pv16, void* stream) {
  if (p.nq == 0 || p.hq == 0 || p.batch == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (head_dim_padded) {
    case 64: return launch_dp<64>(p, out_dtype, pv16, s);
    case 128: return launch_dp<128>(p, out_dtype, pv16, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace sage_sm89

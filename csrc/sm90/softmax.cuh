// Softmax of the sm90 kernel: scores from the int32 QKᵀ accumulator (×δK, ×δQ), the score biases (ΔS, attn_mask),
// the causal / kv_lens masks, the online softmax in base 2 (running max and sum, α), the weights P448 = 448·P̃
// packed as the PV product's A operand (e4m3 or fp16), and the two-level O update.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "params.h"
#include "ptx.cuh"
#include "smem.cuh"

namespace sage_sm90 {

constexpr float kLog2_448 = 8.807354922057604f;
constexpr float kLn2 = 0.6931471805599453f;

// Tree reductions over one row's 32 values of this thread (depth 5 instead of a 32-long dependent chain:
// a lone warp per scheduler runs the softmax, so latency, not issue, bounds it). By parity: the row's even and odd
// accumulator columns i reduced apart (i and i + 8, i + 4, i + 2 share a parity) — the fp16 P operand's per_thread δK
// differs between them (softmax_scores); the whole row is the two combined, in the same order.
template <typename Op>
__device__ __forceinline__ void tree_reduce_row_by_parity(const float (&sc)[64], int hr, Op op, float (&out)[2]) {
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = op(sc[4 * i + 2 * hr], sc[4 * i + 2 * hr + 1]);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = op(v[i], v[i + 8]);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = op(v[i], v[i + 4]);
  out[0] = op(v[0], v[2]);
  out[1] = op(v[1], v[3]);
}
template <typename Op>
__device__ __forceinline__ float tree_reduce_row(const float (&sc)[64], int hr, Op op) {
  float by_parity[2];
  tree_reduce_row_by_parity(sc, hr, op, by_parity);
  return op(by_parity[0], by_parity[1]);
}
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// A score bias (ΔS or attn_mask, params.h) at this thread's two query rows. The thread's keys of a block come in
// runs of consecutive keys (KeyOrder): where the host found the rows aligned (vec) and the block lies inside Nk,
// a row's 32 values are one vector load per run (4 keys: 16 B fp32 or 4 B bool; natural order, 2 keys: 8 B or
// 2 B), issued back to back, else one guarded load per key. A bool entry becomes 0 (attend) or −inf, so every
// bias is one fp32 add. `uniform`: both rows read the same values (a mask broadcast over queries; ΔS with
// q_group a multiple of the CTA's 64 rows), loaded once.
struct BiasRows {
  const uint8_t* row[2];  // null: no such bias, or a row past Nq
  int64_t key_stride;     // bytes
  bool is_bool, vec, uniform;
};
struct ScoreBias {
  BiasRows delta_s, mask;
};

__device__ __forceinline__ BiasRows bias_rows(const void* base, int elem_bytes, bool is_bool, bool vec, bool uniform,
                                              int64_t sb, int64_t sh, int64_t sr, int64_t sk, int row_div, int b,
                                              int h, const int (&row)[2], int nq) {
  BiasRows r;
  r.key_stride = sk * elem_bytes;
  r.is_bool = is_bool;
  r.vec = vec;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
    r.row[hr] = base != nullptr && row[hr] < nq
                    ? static_cast<const uint8_t*>(base) + (b * sb + h * sh + (row[hr] / row_div) * sr) * elem_bytes
                    : nullptr;
  r.uniform = uniform || r.row[1] == nullptr;  // row 1 past Nq: its scores are never stored
  return r;
}

__device__ __forceinline__ ScoreBias score_bias(const Params& p, int b, int h, const int (&row)[2]) {
  ScoreBias s;
  s.delta_s = bias_rows(p.delta_s, 4, false, p.ds_vec, p.q_group % 64 == 0, p.ds_sb, p.ds_sh, p.ds_sr, p.ds_sk,
                        p.q_group, b, h, row, p.nq);
  s.mask = bias_rows(p.mask, p.mask_bool ? 1 : 4, p.mask_bool, p.mask_vec, p.mask_sr == 0, p.mask_sb, p.mask_sh,
                     p.mask_sr, p.mask_sk, 1, b, h, row, p.nq);
  return s;
}

// The 32 bias values of one row in block k0 (value kRunKeys·r + c: key k0 + run_start(r, t) + c); keys ≥ nk read
// as 0 (the caller masks them).
template <typename Order>
__device__ __forceinline__ void bias_values(const BiasRows& bias, const uint8_t* r, int k0, int t, int nk,
                                            float (&add)[32]) {
  constexpr int kRuns = Order::kRuns, kRunKeys = Order::kRunKeys;
  if (bias.vec && k0 + 128 <= nk) {
    if (bias.is_bool) {
      uint32_t keep[kRuns];  // all loads first, then the conversions
#pragma unroll
      for (int run = 0; run < kRuns; ++run) {
        const uint8_t* at = r + k0 + Order::kRunStride * run + kRunKeys * t;  // run_start, as byte offsets
        keep[run] = kRunKeys == 4 ? __ldg(reinterpret_cast<const unsigned int*>(at))
                                  : __ldg(reinterpret_cast<const unsigned short*>(at));
      }
#pragma unroll
      for (int run = 0; run < kRuns; ++run)
#pragma unroll
        for (int c = 0; c < kRunKeys; ++c) add[kRunKeys * run + c] = (keep[run] >> (8 * c)) & 0xff ? 0.f : -INFINITY;
    } else {
      using Run = typename Order::RunFloats;
      Run f[kRuns];
#pragma unroll
      for (int run = 0; run < kRuns; ++run)
        f[run] = __ldg(reinterpret_cast<const Run*>(r + 4 * static_cast<int64_t>(k0 + Order::run_start(run, t))));
#pragma unroll
      for (int run = 0; run < kRuns; ++run) Order::unpack(f[run], add + kRunKeys * run);
    }
    return;
  }
#pragma unroll
  for (int run = 0; run < kRuns; ++run)
#pragma unroll
    for (int c = 0; c < kRunKeys; ++c) {
      const int key = k0 + Order::run_start(run, t) + c;
      float a = 0.f;
      if (key < nk) {
        const uint8_t* at = r + key * bias.key_stride;
        a = bias.is_bool ? (__ldg(at) ? 0.f : -INFINITY) : __ldg(reinterpret_cast<const float*>(at));
      }
      add[kRunKeys * run + c] = a;
    }
}

// sc (this thread's scores of block k0, accumulator order) += the bias.
template <typename Order>
__device__ __forceinline__ void add_bias(const BiasRows& bias, int k0, int t, int nk, float (&sc)[64]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    if (hr == 1 && bias.uniform && bias.row[0] != nullptr) break;  // done below for both rows
    const uint8_t* r = bias.row[hr];
    if (r == nullptr) continue;
    float add[32];
    bias_values<Order>(bias, r, k0, t, nk, add);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      if (rr != hr && !bias.uniform) continue;
#pragma unroll
      for (int run = 0; run < Order::kRuns; ++run)
#pragma unroll
        for (int c = 0; c < Order::kRunKeys; ++c) {
          const int idx = Order::acc_index(run, c, rr);
          sc[idx] = __fadd_rn(sc[idx], add[Order::kRunKeys * run + c]);
        }
    }
  }
}

// One key block's softmax for this thread's two rows: scores from the int32 accumulator, the running
// max/sum, α (for the O update) and the weights P448 = 448·P̃ in `sc` (same index as the accumulator).
// kThreadK: δK is one value per thread group (spec's per_thread: keys 16G + 4t + j of a block share it), so
// S = x·(δQ·δK) takes one scale per row and block — the permuted order's 32 keys of a thread are one group — or, in
// natural order (fp16 P), two: the thread's keys 8i + 2t + e are in group 2(i mod 2) + t div 2, one δK for the even
// columns i and one for the odd. Either way the per-score ×δK disappears.
// kBias (Masked only): S = u·δQ + ΔS, then the attn_mask (add_bias), then the causal / kv_lens masks.
template <bool Masked, bool kThreadK, bool kBias = false, typename Order = PermutedKeys>
__device__ __forceinline__ void softmax_scores(const uint32_t (&acc)[64], const float* ks_s, int t, int k0,
                                               const int (&row)[2], const float (&q_scale_in)[2], int n_valid,
                                               int causal, int causal_offset, float (&m)[2], float (&l)[2],
                                               float (&alpha)[2], float (&sc)[64], const ScoreBias* bias = nullptr,
                                               int nk = 0, bool range_masked = true) {
  static_assert(Masked || !kBias, "a biased block takes the masked path");
  constexpr bool kTwoGroups = kThreadK && Order::kRunKeys == 2;  // natural order: δK by column parity
  // the factor from u to S (base-2 units) of row hr at the columns of parity c
  float q_scale[2][2] = {{q_scale_in[0], q_scale_in[0]}, {q_scale_in[1], q_scale_in[1]}};
  if constexpr (kThreadK) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      // key 4t is in the permuted order's group of this thread; key 8c + 4(t div 2) in the natural order's of parity c
      const float ks = kTwoGroups ? ks_s[8 * c + 4 * (t >> 1)] : ks_s[4 * t];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) q_scale[hr][c] *= ks;
    }
#pragma unroll
    for (int idx = 0; idx < 64; ++idx) sc[idx] = __int2float_rn(static_cast<int>(acc[idx]));  // u = x, exact
  } else {
  // u = x·δK[col], column ↔ key as Order says; one vector load of δK serves a run of the thread's keys (permuted:
  // float4, keys 16G + 4t..4t+3 in columns i = G and G + 8; natural: float2, keys 8i + 2t, 8i + 2t + 1).
  // The bits x + 0x4B400000 are the fp32 M + x (M = 1.5·2^23, |x| < 2^22), and u = (M + x)·δK − M·δK in
  // one FMA: exact when M·δK is, which spec.prepare guarantees by giving δK at most 22 significant bits
  // (spec.fma_friendly) — then this is the single rounding of x·δK, as if x were converted first.
  constexpr int kRunKeys = Order::kRunKeys;
#pragma unroll
  for (int run = 0; run < Order::kRuns; ++run) {
    float ksv[kRunKeys];
    Order::unpack(*reinterpret_cast<const typename Order::RunFloats*>(ks_s + Order::run_start(run, t)), ksv);
    float kbias[kRunKeys];
#pragma unroll
    for (int c = 0; c < kRunKeys; ++c) kbias[c] = -12582912.f * ksv[c];
#pragma unroll
    for (int a = 0; a < kRunKeys / 2; ++a)  // key c = 2a + e of the run
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int idx = Order::acc_index(run, 2 * a + e, hr);
          const float mx = __int_as_float(static_cast<int>(acc[idx]) + 0x4B400000);
          sc[idx] = fmaf(mx, ksv[2 * a + e], kbias[2 * a + e]);
        }
  }
  }
  if constexpr (kBias) {  // S = u·δQ, + ΔS, + attn_mask (spec order), both rows
#pragma unroll
    for (int idx = 0; idx < 64; ++idx) sc[idx] = __fmul_rn(sc[idx], q_scale[(idx >> 1) & 1][(idx >> 2) & 1]);
    add_bias<Order>(bias->delta_s, k0, t, nk, sc);
    add_bias<Order>(bias->mask, k0, t, nk, sc);
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    if constexpr (kBias) {  // scaled and biased above; now the causal / kv_lens masks where some key is hidden
#pragma unroll
      for (int i = 0; i < 16 && range_masked; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int idx = 4 * i + 2 * hr + e;
          const int key = k0 + Order::key_of_column(i, t, e);
          const bool ok = key < n_valid && (!causal || key <= row[hr] + causal_offset);
          if (!ok) sc[idx] = -INFINITY;
        }
    } else if constexpr (Masked) {
#pragma unroll
      for (int i = 0; i < 16; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int idx = 4 * i + 2 * hr + e;
          const int key = k0 + Order::key_of_column(i, t, e);
          const bool ok = key < n_valid && (!causal || key <= row[hr] + causal_offset);
          sc[idx] = ok ? sc[idx] * q_scale[hr][i & 1] : -INFINITY;
        }
    }
    // Unmasked: every score finite and the scale > 0, so max_j S = scale·max_j u and S − m' is one FMA below.
    // The scale is applied before the quad's max: with kThreadK each of the four threads has its own.
    float mx;
    if constexpr (!Masked && kTwoGroups) {
      float by_parity[2];
      tree_reduce_row_by_parity(sc, hr, MaxOp(), by_parity);
      mx = fmaxf(by_parity[0] * q_scale[hr][0], by_parity[1] * q_scale[hr][1]);
    } else {
      mx = tree_reduce_row(sc, hr, MaxOp());
      if constexpr (!Masked) mx *= q_scale[hr][0];
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    float m_new, m_safe;
    if constexpr (!Masked) {
      m_new = fmaxf(m[hr], mx);
      m_safe = m_new;
    } else {
      m_new = fmaxf(m[hr], mx);
      m_safe = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: P̃ = 0, α = 0
    }
    alpha[hr] = exp2_approx(m[hr] - m_safe);
    m[hr] = m_new;
#pragma unroll
    for (int i = 0; i < 16; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int idx = 4 * i + 2 * hr + e;
        if constexpr (!Masked) {
          sc[idx] = exp2_approx(fmaf(sc[idx], q_scale[hr][i & 1], kLog2_448 - m_safe));
        } else {
          sc[idx] = exp2_approx(sc[idx] - (m_safe - kLog2_448));
        }
      }
    l[hr] = l[hr] * alpha[hr] + tree_reduce_row(sc, hr, SumOp());
  }
}

// P̂ = e4m3(P448), packed in the A layout of the PV product's four k32 steps: step kc's keys 32kc + 4t + j
// (rows g, g + 8) and 32kc + 16 + 4t + j sit in columns i = G, G + 8 for G = 2kc, 2kc + 1.
__device__ __forceinline__ void pack_weights(const float (&sc)[64], uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int kc = 0; kc < 4; ++kc)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int lo = 4 * (2 * kc + half), hi = lo + 32;  // accumulator index of columns i and i + 8
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        pa[kc][2 * half + hr] = pack_e4m3x4(sc[lo + 2 * hr], sc[lo + 2 * hr + 1], sc[hi + 2 * hr], sc[hi + 2 * hr + 1]);
    }
}

// The P operand's registers: e4m3 for four k32 steps, or fp16 (pv = fp16) for eight k16 steps.
template <bool kPV16>
using PRegs = uint32_t[kPV16 ? 8 : 4][4];

// P̂ = fp16(P448) (round to nearest even; P448 ≤ 448 needs no saturation), in the A layout of the PV product's
// eight k16 steps, which is the accumulator's own with natural key order (KeyOrder<true>): step kc's registers
// are rows g and g + 8 at keys 16kc + 2t + {0, 1} (accumulator columns i = 2kc) and 16kc + 8 + 2t + {0, 1}
// (i = 2kc + 1), the lower key in the lower half.
__device__ __forceinline__ void pack_weights_f16(const float (&sc)[64], uint32_t (&pa)[8][4]) {
#pragma unroll
  for (int kc = 0; kc < 8; ++kc)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const __half2 h = __floats2half2_rn(sc[8 * kc + 2 * r], sc[8 * kc + 2 * r + 1]);
      pa[kc][r] = *reinterpret_cast<const uint32_t*>(&h);
    }
}

// The softmax of key block k0 for rows from wg_row0 on, P̂ packed for the PV product: the masked path
// only where a key is out of range or causally hidden for some row of the warpgroup — or, kBias, everywhere.
template <bool kThreadK, bool kBias = false, bool kPV16 = false>
__device__ __forceinline__ void softmax_block_at(const Params& p, const uint32_t (&acc)[64], const float* ks_s, int t,
                                                 int k0, int wg_row0, int n_valid, int causal_offset,
                                                 const int (&row)[2],
                                                 const float (&q_scale)[2], float (&m)[2], float (&l)[2],
                                                 float (&alpha)[2], PRegs<kPV16>& pa,
                                                 const ScoreBias* bias = nullptr) {
  using Order = KeyOrder<kPV16>;
  const bool masked = k0 + kBlockN > n_valid || (p.causal && k0 + kBlockN - 1 > wg_row0 + causal_offset);
  float sc[64];
  if constexpr (kBias) {
    softmax_scores<true, kThreadK, true, Order>(acc, ks_s, t, k0, row, q_scale, n_valid, p.causal, causal_offset,
                                                m, l, alpha, sc, bias, p.nk, masked);
  } else if (masked) {
    softmax_scores<true, kThreadK, false, Order>(acc, ks_s, t, k0, row, q_scale, n_valid, p.causal, causal_offset,
                                                 m, l, alpha, sc);
  } else {
    softmax_scores<false, kThreadK, false, Order>(acc, ks_s, t, k0, row, q_scale, n_valid, p.causal, causal_offset,
                                                  m, l, alpha, sc);
  }
  if constexpr (kPV16) {
    pack_weights_f16(sc, pa);
  } else {
    pack_weights(sc, pa);
  }
}

// Two-level accumulation: O = O·α + T, T a block's P̂·V̂ from a fresh accumulator.
template <int N>
__device__ __forceinline__ void fold_block(float (&o)[N], const float (&alpha)[2], float (&pv)[N]) {
  fence_registers(pv);
#pragma unroll
  for (int i = 0; i < N; ++i) o[i] = o[i] * alpha[(i >> 1) & 1] + pv[i];
}

}  // namespace sage_sm90

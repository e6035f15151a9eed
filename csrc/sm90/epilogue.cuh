// Epilogue of the sm90 kernel: each row's normaliser and log-sum-exp, and out = O32 / l · δV (+ μV) stored in the
// output's dtype and strides (pairs of bf16 where pairs_aligned allows, else element by element).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "copy.cuh"
#include "params.h"
#include "softmax.cuh"

namespace sage_sm90 {

// One row's normaliser and log-sum-exp (thread t == 0 writes the lse; `row` counts from the tile's first query).
__device__ __forceinline__ float row_normaliser(const Params& p, float l, float m, int row, int t, const CtaTile& tile,
                                                bool& has_keys) {
  float lsum = l;
  lsum += __shfl_xor_sync(0xffffffff, lsum, 1);
  lsum += __shfl_xor_sync(0xffffffff, lsum, 2);
  has_keys = lsum != 0.f;  // l == 0: no key (out 0, lse −inf); a NaN l (poisoned row, spec.py) gives NaN out and lse
  if (t == 0 && row < tile.nq)
    p.lse[tile.b * p.lse_sb + tile.h * p.lse_sh + tile.q_first + row] =
        has_keys ? (m + (log2f(lsum) - kLog2_448)) * kLn2 : -INFINITY;
  return has_keys ? 1.f / lsum : 0.f;
}

// Epilogue of a thread's two rows: out = O32 / l · δV (+ μV); lse = (m + log2(l / 448)) · ln 2.
// The thread's head-dim elements come in adjacent pairs (d = 8i + 2t + {0, 1}). kPairs (bf16 out and
// pairs_aligned: contiguous, unpadded, aligned): each pair is one δV (and μV) load and one bf16x2 store from
// one row pointer per row. Otherwise (padding, strides, alignment, fp16/fp32 out) one element at a time,
// the output type and the bounds checked per element: ~30 instructions and a dependent load each, ~2000 per
// warp and tile at D=128 — most of the fixed cost per tile outside the key-block loop at short N (ncu: ~2500
// instructions per warp and tile at 2K and 16K keys). Two instantiations, not a run-time branch: with both paths
// in one kernel the D=128 three-CTA per_thread kernel spilled O registers inside its loop.
template <int D, bool kPairs = false>
__device__ __forceinline__ void store_output(const Params& p, const float (&o)[D / 2], const float (&m)[2],
                                             const float (&l)[2], const int (&row)[2], int t, const CtaTile& tile,
                                             int hk) {
  const float* vs_g = p.v_scale + tile.vb * p.vs_sb + hk * p.vs_sh;
  const float* vm_g = p.v_mean ? p.v_mean + tile.vb * p.vm_sb + hk * p.vm_sh : nullptr;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    bool has_keys;
    const float inv = row_normaliser(p, l[hr], m[hr], row[hr], t, tile, has_keys);
    if (row[hr] >= tile.nq) continue;
    const int64_t out_row = tile.b * p.o_sb + tile.h * p.o_sh + (tile.q_first + row[hr]) * p.o_sn;
    if constexpr (kPairs) {  // bf16 out, pairs_aligned(p)
      __nv_bfloat16* out_pairs = static_cast<__nv_bfloat16*>(p.out) + out_row + 2 * t;
      const bool add_mean = vm_g != nullptr && has_keys;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const float2 vs = __ldg(reinterpret_cast<const float2*>(vs_g + 8 * i + 2 * t));
        float v0 = o[4 * i + 2 * hr] * inv * vs.x, v1 = o[4 * i + 2 * hr + 1] * inv * vs.y;
        if (add_mean) {
          const float2 vm = __ldg(reinterpret_cast<const float2*>(vm_g + 8 * i + 2 * t));
          v0 += vm.x;
          v1 += vm.y;
        }
        *reinterpret_cast<__nv_bfloat162*>(out_pairs + 8 * i) = __floats2bfloat162_rn(v0, v1);
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = 8 * i + 2 * t + e;
          if (d >= p.head_dim) continue;
          float val = o[4 * i + 2 * hr + e] * inv * __ldg(vs_g + d);
          if (vm_g != nullptr && has_keys) val += __ldg(vm_g + d);
          const int64_t at = out_row + d * p.o_sd;
          if (p.out_dtype == kOutBF16) {
            static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(val);
          } else if (p.out_dtype == kOutFP16) {
            // saturates at ±65504, NaN stays NaN (spec.saturate)
            static_cast<__half*>(p.out)[at] = __float2half_rn(fabsf(val) > 65504.f ? copysignf(65504.f, val) : val);
          } else {
            static_cast<float*>(p.out)[at] = val;
          }
        }
    }
  }
}

}  // namespace sage_sm90

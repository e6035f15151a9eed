// The sm90 attention kernel: sage.quantized_attention on Hopper (sm_90a) — INT8 wgmma for QKᵀ, FP8 (e4m3) or FP16
// wgmma for PV, fp32 two-level accumulation, online softmax in base 2. Its parts: ptx.cuh (PTX wrappers), wgmma.cuh
// (the products), smem.cuh (layout, swizzle, KeyOrder), copy.cuh (K / Vᵀ / δK copies), softmax.cuh, epilogue.cuh.
//
// The function is sage_compile/numerics/spec.py's quantized_attention_reference with block_n = 128, computed in the order of
// the Triton kernel (sage_compile/kernels/triton.py, FAST path): the same scales, the same rounding to e4m3, the
// same 448 folded into the exponent. One warpgroup per CTA (64 query rows, 128 threads), two to four CTAs per SM
// (sage_compile/kernels/sm90.py's heuristics pick; the resident CTAs overlap each other's softmax and wgmmas).
// Thread 0 issues each block's tensor-map copies (TMA) into a multistage ring on per-stage mbarriers; where the
// strides allow no map, every thread copies its share by cp.async.
// Score biases (ΔS, attn_mask): the kBias instantiations — every key block takes the masked path and adds them after
// δQ·δK (softmax_scores, add_bias).
// FP16 PV (pv = fp16): the kPV16 instantiations. P̂ = fp16(P448) and V̂ fp16, eight k16 steps per block; the fp16 A
// fragment is the accumulator's own layout, so K rows stay in natural order (KeyOrder<true>) and Vᵀ sits in two
// 64-key tiles of 128-byte rows per stage. A stage is 1.5× an e4m3 one: D=128 runs two CTAs per SM (two stages).
//
// The P operand of the PV product comes from registers with no shuffles: the fp32 accumulator of
// QKᵀ holds, per thread, columns {8i + 2t, 8i + 2t + 1} while the e4m3 A fragment of a k32 step wants
// keys {4t..4t+3, 16+4t..16+4t+3}. K rows are therefore written to shared memory in a permuted order:
// key 16G + 4t + 2a + b of a block goes to row 64a + 8G + 2t + b, so accumulator columns i and i + 8
// (i < 8) hold keys 16i + 4t + {0,1} and {2,3}, and the registers of P are already in the A layout; V
// stays in natural key order. The copies express the permutation directly: cp.async places each 16-byte
// row chunk where we ask, and a tensor-map copy (TMA) writes each half a of a block as one 5-D box (key =
// 4·quad + r, r ∈ {2a, 2a+1}: rows 2·quad + r − 2a of the half).
//
// Scores: the int32 dot becomes fp32 without I2F (x + 0x4B400000 reinterpreted is 1.5·2^23 + x exactly,
// |x| < 2^22) and is scaled in the same FMA, u = x·δK[col] (exact fold, see softmax_scores), S = u·δQ[row] (base-2 units), m' = max(m, max_j S),
// P448 = exp2(S − (m' − log2 448)) = 448·P̃, P̂ = e4m3(P448) (round to nearest even, saturating),
// l = l·α + ΣP448, O32 = O32·α + (P̂·V̂ in a fresh accumulator), out = O32/l·δV (+ μV).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "copy.cuh"
#include "epilogue.cuh"
#include "params.h"
#include "ptx.cuh"
#include "smem.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"

namespace sage_sm90 {

// This thread's two rows (g and g + 8 of its warp's 16, from the warpgroup's first row) and their δQ.
__device__ __forceinline__ void thread_rows(const Params& p, const CtaTile& tile, int wg_row0, int warp, int g,
                                            int (&row)[2], float (&q_scale)[2]) {
  row[0] = wg_row0 + warp * 16 + g;
  row[1] = row[0] + 8;
#pragma unroll
  for (int r = 0; r < 2; ++r)
    q_scale[r] = row[r] < tile.nq ? p.q_scale[tile.b * p.qs_sb + tile.h * p.qs_sh + tile.q_first + row[r]] : 0.f;
}

// S = Q·Kᵀ for one key block (D/32 k-steps) and T = P̂·V̂ (four k32 steps, or eight k16), issued, not waited for.
// Each product's k32 steps are one asm statement (wgmma.cuh's _x chains), so no compiler-made register move
// can sit between them — one such move makes ptxas serialize every wgmma of the kernel (C7513).
template <int D>
__device__ __forceinline__ void issue_qk(uint32_t (&acc)[64], uint64_t desc_q, uint64_t desc_k) {
  if constexpr (D == 128) {
    wgmma_s8_m64n128k32_x4(acc, desc_q, desc_k);
  } else {
    wgmma_s8_m64n128k32_x2(acc, desc_q, desc_k);
  }
}
// kPV16: eight k16 steps of fp16 over the stage's two 64-key tiles of Vᵀ (SmemLayout).
template <int D, bool kPV16 = false>
__device__ __forceinline__ void issue_pv(float (&pv)[D / 2], const PRegs<kPV16>& pa, uint64_t desc_v) {
  if constexpr (kPV16 && D == 128) {
    wgmma_f16_rs_m64n128k16_x8(pv, pa, desc_v);
  } else if constexpr (kPV16) {
    wgmma_f16_rs_m64n64k16_x8(pv, pa, desc_v);
  } else if constexpr (D == 128) {
    wgmma_e4m3_rs_m64n128k32_x4(pv, pa, desc_v);
  } else {
    wgmma_e4m3_rs_m64n64k32_x4(pv, pa, desc_v);
  }
}

// One warpgroup per CTA (64 query rows, 128 threads), CtasPerSm CTAs per SM: no producer warps, no ping-pong; the
// resident CTAs overlap each other's softmax and wgmmas. Three CTAs per SM cap registers at 168 (D=64 fits; D=128
// spills a few O registers) and leave room for two stages at D=128. FlashAttention-3's intra-warpgroup overlap
// was tried on this shape and lost.
// kMaps: copies by tensor map (launch() picks this instantiation when p.tma), else by cp.async — separate
// instantiations, so that neither carries the other's state through the loop. kThreadK: one δK per thread
// group (p.k_thread_groups; built with tensor maps only — elsewhere the per-key path reads the same values).
// kPairs: the bf16 pair epilogue (pairs_aligned). kBias: ΔS and/or an attn_mask (every block on the masked path).
// kPV16: P̂ and V̂ in fp16 (pv = fp16): K rows in natural order (KeyOrder<true>), Vᵀ as two 64-key tiles per
// stage, eight k16 steps per block; per_thread δK takes two values per thread and block (softmax_scores).
// launch.cuh's InstanceKey names an instantiation; instantiations.py generates the ones built.
template <int D, int CtasPerSm, bool kMaps, bool kThreadK, bool kPairs, bool kBias, bool kPV16>
__global__ void __launch_bounds__(128, CtasPerSm) attention_kernel(const __grid_constant__ Params p) {
  using L = SmemLayout<D, pipeline_stages<D, CtasPerSm, kPV16>(), kPV16>;
  constexpr int kStages = L::kStages;
  static_assert(kStages >= 2, "no such launch shape (pipeline_stages)");
  constexpr int kVKeyBytes = BlockCopier<D, kPV16>::kVKeyBytes;  // Vᵀ bytes per key
  constexpr int kOut = D / 2;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  const uint32_t sQ = base + L::kQ, sK = base + L::kK, sV = base + L::kV, sKS = base + L::kKScale;
  const float* k_scale_smem = reinterpret_cast<const float*>(smem + L::kKScale);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const CtaTile tile = cta_tile(p, kBlockM);
  if (tile.idle) return;  // a packed grid's spare block (uniform over the CTA)
  const int b = tile.b, hk = tile.hk, q0 = tile.q0, n_valid = tile.n_valid, n_blocks = tile.n_blocks;

  const int8_t* k_g = p.k + b * p.k_sb + hk * p.k_sh;
  const uint8_t* v_g = p.v + kVKeyBytes * b * p.v_sb + kVKeyBytes * hk * p.v_sh;
  const float* ks_g = p.k_scale + b * p.ks_sb + hk * p.ks_sh;
  const int k_row = static_cast<int>(p.k_sn), v_row = static_cast<int>(p.v_sd) * kVKeyBytes;
  load_q<D>(sQ, p, tile, kBlockM, tid, 128);
  const BlockCopier<D, kPV16> copier(tid, k_row, v_row);
  // With tensor maps thread 0 issues every copy of a block — K's two permuted halves, Vᵀ and δK — on the
  // stage's full barrier; each warp's lane 0 arrives on the stage's empty barrier once its products of the
  // block have completed, and thread 0 waits for all four before refilling the stage. No block-wide barrier
  // in the loop. Without maps every thread copies its share by cp.async (commit groups, wait_group, one
  // __syncthreads per block).
  constexpr bool by_map = kMaps;
  const uint32_t sFull = base + L::kFull, sEmpty = base + L::kEmpty;
  if (by_map && tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(sFull + 8 * s, 1);
      mbarrier_init(sEmpty + 8 * s, 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto load_block = [&](int j) {  // block j into stage j % kStages
    const int s = j % kStages, k0 = j * kBlockN;
    const uint32_t dK = sK + s * L::kKBytes, dV = sV + s * L::kVBytes, dKS = sKS + s * kBlockN * 4;
    if constexpr (!by_map) {
      copier.issue(p, k0, dK, dV, dKS, k_g, v_g, ks_g, k_row, v_row);
      return;
    }
    const uint32_t full = sFull + 8 * s;
    if (j >= kStages) mbarrier_wait(sEmpty + 8 * s, (j / kStages - 1) & 1);
    map_copy_block<D, kPV16>(p, tile.key_first + k0, hk, b, dK, dV, dKS, full);
  };
  auto k_desc = [&](int j) { return smem_descriptor(sK + (j % kStages) * L::kKBytes, D); };
  auto v_desc = [&](int j) { return smem_descriptor(sV + (j % kStages) * L::kVBytes, 128); };
  auto k_scales = [&](int j) { return k_scale_smem + (j % kStages) * kBlockN; };
  auto blocks_landed = [&]() {  // after this thread's cp.async wait: everyone's copies visible to wgmma
    fence_proxy_async();
    __syncthreads();
  };
  // cp.async groups: {Q, block 0}, {block 1}, ..., {block kStages − 2}; then one (possibly empty) group per
  // iteration. With maps only Q is a cp.async group, waited for here.
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    if (j < n_blocks && (!by_map || tid == 0)) load_block(j);
    cp_async_commit();
  }
  if (by_map) {
    cp_async_wait<0>();
    blocks_landed();
  }

  int row[2];
  float q_scale[2];
  thread_rows(p, tile, q0, warp, g, row, q_scale);
  const uint64_t desc_q = smem_descriptor(sQ, D);
  ScoreBias bias;
  if constexpr (kBias) bias = score_bias(p, b, tile.h, row);

  float o[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};
  float alpha[2];
  PRegs<kPV16> pa;

  for (int j = 0; j < n_blocks; ++j) {
    if constexpr (by_map) {
      mbarrier_wait(sFull + 8 * (j % kStages), (j / kStages) & 1);
    } else {
      cp_async_wait<kStages - 2>();  // this thread's copies of block j have landed
      blocks_landed();               // everyone's have, and everyone is done with block j − 1's stage
      if (j + kStages - 1 < n_blocks) load_block(j + kStages - 1);
      cp_async_commit();
    }

    uint32_t acc[64];
    wgmma_fence();
    issue_qk<D>(acc, desc_q, k_desc(j));
    wgmma_commit();
    // Thread 0 refills block j − 1's stage while S_j runs: issued here, its copies do not hold back the
    // warpgroup's collective wgmma (at the top of the loop they did: ncu "gmma" stalls, −6% at D=64, two CTAs per SM).
    if (by_map && tid == 0 && j + kStages - 1 < n_blocks) load_block(j + kStages - 1);
    wgmma_wait<0>();
    fence_registers(acc);
    softmax_block_at<kThreadK, kBias, kPV16>(p, acc, k_scales(j), t, j * kBlockN, q0, n_valid, tile.causal_offset,
                                             row, q_scale, m, l, alpha, pa, &bias);
    float pv[kOut];
    wgmma_fence();
    issue_pv<D, kPV16>(pv, pa, v_desc(j));
    wgmma_commit();
    wgmma_wait<0>();
    if (by_map && lane == 0) mbarrier_arrive(sEmpty + 8 * (j % kStages));  // this warp is done with the stage
    fold_block(o, alpha, pv);
  }
  cp_async_wait<0>();
  // Special values (spec.py): l += 0·δQ — NaN for a poisoned q row (δQ NaN), exact otherwise; the epilogue turns a
  // NaN l into NaN out and lse. Two FMULs and two FADDs per thread, outside the key loop.
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] += q_scale[r] * 0.f;
  store_output<D, kPairs>(p, o, m, l, row, t, tile, hk);
}

}  // namespace sage_sm90

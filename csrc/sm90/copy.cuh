// Copies of the sm90 kernel: which tile a CTA works on (CtaTile), Q's rows by cp.async, and each key block's K rows
// (in KeyOrder), Vᵀ and δK into a pipeline stage — by tensor map (one thread, completing on the stage's mbarrier)
// where the host could make the maps, else by cp.async from every thread (BlockCopier).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"
#include "ptx.cuh"
#include "smem.cuh"

namespace sage_sm90 {

// What one CTA works on: (batch, query head, key head), its first query row, and the keys any of its
// `rows` query rows can see (kv_lens, causal), as provably CTA-uniform values (wgmma loops run on them). Rows and
// keys count from the CTA's sequence: in a packed batch (Params::cu_blk) its queries start at packed row q_first and
// its keys at slot key_first, with nq queries, the causal offset of its lengths and δV / μV row vb; batched, those
// are 0, 0, Nq, p.causal_offset and b. An idle CTA (a packed grid's spare blocks) has no work.
struct CtaTile {
  int b, h, hk, q0, n_valid, n_blocks;
  int q_first, key_first, nq, causal_offset, vb;
  bool idle;
};

// The sequence holding query block `block` of a packed batch: the last s with cu_blk[s] <= block (empty sequences
// share their bound with the next one, so the last is the one with blocks).
__device__ __forceinline__ int sequence_of_block(const int32_t* cu_blk, int n_seq, int block) {
  int lo = 0, hi = n_seq;  // cu_blk[lo] <= block < cu_blk[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(cu_blk + mid) <= block) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__device__ __forceinline__ CtaTile cta_tile(const Params& p, int rows) {
  CtaTile tile;
  int q_block = p.causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;  // causal: heavy blocks first
  tile.b = blockIdx.y / p.hq;
  tile.h = blockIdx.y % p.hq;
  tile.hk = tile.h / (p.hq / p.hkv);
  tile.q_first = 0, tile.key_first = 0, tile.nq = p.nq, tile.causal_offset = p.causal_offset, tile.vb = tile.b;
  tile.idle = false;
  int n_valid = p.nk;
  if (p.cu_blk != nullptr) {
    tile.idle = q_block >= __ldg(p.cu_blk + p.n_seq);
    const int s = sequence_of_block(p.cu_blk, p.n_seq, q_block);
    q_block -= __ldg(p.cu_blk + s);
    tile.q_first = __ldg(p.cu_q + s);
    tile.nq = __ldg(p.cu_q + s + 1) - tile.q_first;
    n_valid = __ldg(p.cu_k + s + 1) - __ldg(p.cu_k + s);
    tile.key_first = __ldg(p.key_first + s);
    tile.causal_offset = p.causal == 2 ? n_valid - tile.nq : 0;
    tile.vb = s;
  } else if (p.kv_lens != nullptr) {
    const long long len = p.kv_lens_int64 ? static_cast<const int64_t*>(p.kv_lens)[tile.b]
                                          : static_cast<const int32_t*>(p.kv_lens)[tile.b];
    n_valid = static_cast<int>(len < 0 ? 0 : (len > p.nk ? p.nk : len));
  }
  tile.q0 = q_block * rows;
  int key_end = n_valid;  // keys [0, key_end) may be visible to some row of this CTA
  if (p.causal) key_end = min(key_end, min(tile.q0 + rows, tile.nq) + tile.causal_offset);
  key_end = max(key_end, 0);
  tile.n_valid = __shfl_sync(0xffffffff, n_valid, 0);
  tile.n_blocks = __shfl_sync(0xffffffff, (key_end + kBlockN - 1) / kBlockN, 0);
  return tile;
}

// The CTA's `rows` query rows into shared memory (rows past Nq zero-filled), `threads` threads helping.
template <int D>
__device__ __forceinline__ void load_q(uint32_t sQ, const Params& p, const CtaTile& tile, int rows, int tid,
                                       int threads) {
  constexpr int kChunks = D / 16;
  const int8_t* q_g = p.q + tile.b * p.q_sb + tile.h * p.q_sh + tile.q_first * p.q_sn;
  for (int idx = tid; idx < rows * kChunks; idx += threads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = tile.q0 + r < tile.nq;
    cp_async_16(sQ + swizzled<D>(r, c), ok ? q_g + (tile.q0 + r) * p.q_sn + c * 16 : q_g, ok);
  }
}

// The copies of one key block into a stage, issued by 128 threads: K rows in the key order the P operand needs
// (KeyOrder: permuted for e4m3, natural for fp16), Vᵀ rows, δK. Vᵀ is [D][128 keys] of e4m3 — or, kPV16, two
// tiles [D][64 keys] of fp16, so that every row is 128 bytes either way: the stage's 2D (fp16) or D rows of eight
// chunks, row R holding keys 64·(R div D) .. of head-dim row R mod D. Each thread's chunks sit at fixed offsets
// from the block's base (the row permutation and the swizzle repeat every 16 rows), so the offsets are computed
// once; a block wholly inside Nk needs no bounds checks. (Recomputing them per block cost 17% on the H100: 564
// instead of 678 TOPS.)
template <int D, bool kPV16 = false>
struct BlockCopier {
  using Order = KeyOrder<kPV16>;
  static constexpr int kVKeyBytes = kPV16 ? 2 : 1;          // bytes per key of Vᵀ
  static constexpr int kChunks = D / 16;                    // 16-byte chunks per K row
  static constexpr int kKRowsPerStep = 128 / kChunks;       // K rows (keys) covered by one pass of 128 threads
  static constexpr int kKSmemStep = (kPV16 ? kKRowsPerStep : kKRowsPerStep / 2) * D;  // their smem advance
  static constexpr int kKSteps = kBlockN * kChunks / 128;
  static constexpr int kVRows = kPV16 ? 2 * D : D;          // 128-byte rows of Vᵀ per stage
  static constexpr int kVSteps = kVRows / 16;               // 16 rows of 8 chunks per pass
  uint32_t k_soff, v_soff;  // shared-memory byte offsets of this thread's first K and V chunk in a stage
  int k_n0, k_goff, v_goff, v_c16, lane;

  // k_row: K's row stride (bytes); v_row: Vᵀ's row stride in bytes.
  __device__ __forceinline__ BlockCopier(int t, int k_row, int v_row) : lane(t) {
    k_n0 = t / kChunks;
    const int kc = t % kChunks;
    k_soff = swizzled<D>(Order::k_row_of_key(k_n0), kc);
    k_goff = k_n0 * k_row + kc * 16;
    const int d0 = t >> 3, vc = t & 7;
    v_soff = swizzled<128>(d0, vc);
    v_goff = d0 * v_row + vc * 16;
    v_c16 = vc * 16 / kVKeyBytes;  // first key of the thread's chunk within its row's 128 bytes
  }

  __device__ __forceinline__ void issue(const Params& p, int k0, uint32_t dK, uint32_t dV, uint32_t dKS,
                                        const int8_t* k_g, const uint8_t* v_g, const float* ks_g, int k_row,
                                        int v_row) const {
    issue_k(p, k0, dK, dKS, k_g, ks_g, k_row);
    issue_v(p, k0, dV, v_g, v_row);
  }

  // K rows and δK of the block at key k0.
  __device__ __forceinline__ void issue_k(const Params& p, int k0, uint32_t dK, uint32_t dKS, const int8_t* k_g,
                                          const float* ks_g, int k_row) const {
    const int8_t* k_blk = k_g + k0 * p.k_sn;
    if (k0 + kBlockN <= p.nk) {  // whole block in range
#pragma unroll
      for (int i = 0; i < kKSteps; ++i)
        cp_async_16(dK + k_soff + i * kKSmemStep, k_blk + k_goff + i * kKRowsPerStep * k_row, true);
    } else {
#pragma unroll
      for (int i = 0; i < kKSteps; ++i) {
        const bool ok = k0 + k_n0 + i * kKRowsPerStep < p.nk;
        cp_async_16(dK + k_soff + i * kKSmemStep, ok ? k_blk + k_goff + i * kKRowsPerStep * k_row : k_g, ok);
      }
    }
    issue_k_scales(p, k0, dKS, ks_g);
  }

  __device__ __forceinline__ void issue_k_scales(const Params& p, int k0, uint32_t dKS, const float* ks_g) const {
    if (lane < kBlockN) {
      const bool ok = k0 + lane < p.nk;
      cp_async_4(dKS + lane * 4, ok ? ks_g + k0 + lane : ks_g, ok);
    }
  }

  // Vᵀ rows of the block at key k0: pass i covers stage rows 16i + d0, i.e. head-dim row 16i + d0 − D·tile of
  // tile (16i) div D (keys from 64·tile), with D a multiple of 16 so that the tile is fixed per pass.
  __device__ __forceinline__ void issue_v(const Params& p, int k0, uint32_t dV, const uint8_t* v_g, int v_row) const {
    const uint8_t* v_blk = v_g + k0 * kVKeyBytes;
    if (k0 + kBlockN <= p.nk) {  // whole block in range (then also within Nkp ≥ Nk)
#pragma unroll
      for (int i = 0; i < kVSteps; ++i) {
        const int tile = 16 * i / D;
        cp_async_16(dV + v_soff + i * 16 * 128, v_blk + v_goff + (16 * i - D * tile) * v_row + 128 * tile, true);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kVSteps; ++i) {
        const int tile = 16 * i / D;
        const bool v_ok = k0 + 64 * tile + v_c16 < p.nkp;
        cp_async_16(dV + v_soff + i * 16 * 128, v_ok ? v_blk + v_goff + (16 * i - D * tile) * v_row + 128 * tile : v_g,
                    v_ok);
      }
    }
  }
};

// The tensor-map copies of one key block into a stage (one thread issues them; Params' k_map, v_map, ks_map),
// completing on the stage's `full` mbarrier, which this arrival tells how many bytes to expect: K as two boxes of
// its permuted halves (KeyOrder<false>) — or, kPV16, one box of the block's rows in natural order —, Vᵀ as one box
// of 128 e4m3 keys (kPV16: two boxes of 64 fp16 keys), δK as one box of 128 keys. Keys past Nk land as zeros.
template <int D, bool kPV16 = false>
__device__ __forceinline__ void map_copy_block(const Params& p, int k0, int hk, int b, uint32_t dK, uint32_t dV,
                                               uint32_t dKS, uint32_t full) {
  constexpr int kVBytes = D * kBlockN * BlockCopier<D, kPV16>::kVKeyBytes;
  mbarrier_expect_tx(full, kBlockN * D + kVBytes + kBlockN * 4);
  if constexpr (kPV16) {  // K in natural order: one box of 4 × 32 quads; Vᵀ: two 64-key fp16 boxes
    tma_load_5d(dK, &p.k_map, full, 0, 0, k0 / 4, hk, b);
    tma_load_4d(dV, &p.v_map, full, k0, 0, hk, b);
    tma_load_4d(dV + 128 * D, &p.v_map, full, k0 + 64, 0, hk, b);
  } else {
    tma_load_5d(dK, &p.k_map, full, 0, 0, k0 / 4, hk, b);
    tma_load_5d(dK + 64 * D, &p.k_map, full, 0, 2, k0 / 4, hk, b);
    tma_load_4d(dV, &p.v_map, full, k0, 0, hk, b);
  }
  tma_load_3d(dKS, &p.ks_map, full, k0, hk, b);
}

}  // namespace sage_sm90

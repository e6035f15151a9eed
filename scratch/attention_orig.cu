// sage.quantized_attention on Hopper (sm_90a): INT8 wgmma for QKᵀ, FP8 (e4m3) wgmma for PV, fp32 two-level
// accumulation, online softmax in base 2 — the function of sage_compile/spec.py's
// quantized_attention_reference with block_n = 128, computed in the order of the Triton kernel
// (sage_compile/kernels/triton.py, FAST path): the same scales, the same rounding to e4m3, the same
// 448 folded into the exponent.
//
// Launch shapes of that one function (the `variant` of launch(); the Python side picks 2 at both head dims):
// * v1, v2 (attention_kernel_1wg): one warpgroup per CTA, 64 query rows, two (v1) or three (v2) CTAs per
//   SM — one thread issues each block's tensor-map copies (TMA) into a multistage ring on per-stage
//   mbarriers (cp.async by every thread where the strides do not allow a map); the resident CTAs overlap
//   each other's softmax and wgmmas. The Triton kernel's shape.
// * v0 (attention_kernel): 128 query rows per CTA, 384 threads — a producer warpgroup (setmaxnreg 56)
//   copies K, Vᵀ and δK of each 128-key block into a shared-memory ring (4 stages at D=128, 6 at D=64)
//   with cp.async, completing on per-stage mbarriers (cp.async.mbarrier.arrive.noinc; a second mbarrier
//   per stage says both consumers are done with it); two consumer warpgroups (setmaxnreg 224) of 64 rows
//   share those tiles and take turns, through two named barriers, to issue their wgmmas (FlashAttention-3's
//   ping-pong): iteration j issues T_{j−1} = P̂_{j−1}·V̂_{j−1} and S_j = Q·K_jᵀ back to back, folds T into
//   O while S_j is still running, then runs the softmax of block j while the other warpgroup's products
//   occupy the tensor cores.
// Measured speeds and what was tried: docs/notes.md, docs/results/README.md.
//
// The P operand of the PV product comes from registers with no shuffles: the fp32 accumulator of
// QKᵀ holds, per thread, columns {8i + 2t, 8i + 2t + 1} while the e4m3 A fragment of a k32 step wants
// keys {4t..4t+3, 16+4t..16+4t+3}. K rows are therefore written to shared memory in a permuted order:
// key 16G + 4t + 2a + b of a block goes to row 64a + 8G + 2t + b, so accumulator columns i and i + 8
// (i < 8) hold keys 16i + 4t + {0,1} and {2,3}, and the registers of P are already in the A layout; V
// stays in natural key order. The copies express the permutation directly: cp.async places each 16-byte
// row chunk where we ask, and a tensor-map copy (TMA) writes each half a of a block as one 5-D box (key =
// 4·quad + r, r ∈ {2a, 2a+1}: rows 2·quad + r − 2a of the half). (The earlier permutation within 16-key
// groups was 2-4% faster on the cp.async path, for reasons not found; it cannot be written by a box.)
//
// Scores: the int32 dot becomes fp32 without I2F (x + 0x4B400000 reinterpreted is 1.5·2^23 + x exactly,
// |x| < 2^22) and is scaled in the same FMA, u = x·δK[col] (exact fold, see softmax_scores), S = u·δQ[row] (base-2 units), m' = max(m, max_j S),
// P448 = exp2(S − (m' − log2 448)) = 448·P̃, P̂ = e4m3(P448) (round to nearest even, saturating),
// l = l·α + ΣP448, O32 = O32·α + (P̂·V̂ in a fresh accumulator), out = O32/l·δV (+ μV).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "params.h"
#include "wgmma.cuh"

namespace sage_sm90 {

constexpr int kBlockM = 128;  // query rows per CTA (two warpgroups × 64)
#ifdef SAGE_SASS_HOT_PATH
constexpr bool kHotPathOnly = true;  // only the unmasked, in-range path (tools/sass_loop.py counts it)
#else
constexpr bool kHotPathOnly = false;
#endif
constexpr int kBlockN = 128;  // keys per pipeline stage (the oracle's block_n)
constexpr float kLog2_448 = 8.807354922057604f;
constexpr float kLn2 = 0.6931471805599453f;

template <int D>
struct SmemLayout {
  static constexpr int kStages = D == 128 ? 4 : 6;
  static constexpr int kQBytes = kBlockM * D;
  static constexpr int kKBytes = kBlockN * D;
  static constexpr int kVBytes = D * kBlockN;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kQBytes;
  static constexpr int kV = kK + kStages * kKBytes;
  static constexpr int kKScale = kV + kStages * kVBytes;
  static constexpr int kBarriers = kKScale + kStages * kBlockN * 4;
  static constexpr int kBytes = kBarriers + 2 * kStages * 8;
  static constexpr int kDynamic = kBytes + 1024;  // room to align the base to 1024 (128-byte swizzle)
};

// ---------------------------------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// The mbarrier counts this thread's arrival once all its earlier cp.async copies have landed.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbarrier_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// The same wait for a thread with nothing else to do (the producer): each failed try suspends the warp up to
// ~`ns` nanoseconds instead of spinning, so it takes fewer issue slots from the consumer warps.
__device__ __forceinline__ void mbarrier_wait_sleeping(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity), "r"(2000)
      : "memory");
}

// Tensor-map copies (TMA): one thread issues, the bytes complete on an mbarrier that expects them.
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Shared memory written through the generic proxy (cp.async), read next by wgmma (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { wgmma_wait<0>(); }

// Keeps the compiler from touching accumulator registers across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Four fp32 → four e4m3 bytes (x0 in the lowest byte), round to nearest even, saturating at ±448.
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

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

// Shared-memory row of key n (0..127) of a block: key 16G + 4t + 2a + b goes to row 64a + 8G + 2t + b, so
// S column c = 8i + 2t + e of the accumulator holds key key_of_column(i, t, e).
__device__ __forceinline__ int k_row_of_key(int n) {
  return 64 * ((n >> 1) & 1) + 8 * (n >> 4) + 2 * ((n >> 2) & 3) + (n & 1);
}
__device__ __forceinline__ int key_of_column(int i, int t, int e) { return 16 * (i & 7) + 4 * t + 2 * (i >> 3) + e; }

// ---------------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

constexpr int kConsumerThreads = 256;  // two consumer warpgroups
// The CTA launches with 168 registers per thread (65536 / 384, rounded down to 8): 128·56 + 256·224 =
// 384·168 exactly. setmaxnreg.inc waits until the pool can cover it, so a larger sum deadlocks.
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= 384 * 168, "register pool");
constexpr int kTurnBarrier = 1;  // named barriers 1, 2: the consumer warpgroups' turns to issue wgmma

// Tree reductions over one row's 32 values of this thread (depth 5 instead of a 32-long dependent chain:
// a lone warp per scheduler runs the softmax, so latency, not issue, bounds it).
template <typename Op>
__device__ __forceinline__ float tree_reduce_row(const float (&sc)[64], int hr, Op op) {
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = op(sc[4 * i + 2 * hr], sc[4 * i + 2 * hr + 1]);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = op(v[i], v[i + 8]);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = op(v[i], v[i + 4]);
#pragma unroll
  for (int i = 0; i < 2; ++i) v[i] = op(v[i], v[i + 2]);
  return op(v[0], v[1]);
}
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// One key block's softmax for this thread's two rows: scores from the int32 accumulator, the running
// max/sum, α (for the O update) and the weights P448 = 448·P̃ in `sc` (same index as the accumulator).
// kThreadK: δK is one value per thread group (spec's per_thread: the thread's 32 keys 16G + 4t + j share
// it), so S = x·(δQ·δK) takes one scale per row and block, and the per-score ×δK disappears.
template <bool Masked, bool kThreadK>
__device__ __forceinline__ void softmax_scores(const uint32_t (&acc)[64], const float* ks_s, int t, int k0,
                                               const int (&row)[2], const float (&q_scale_in)[2], int n_valid,
                                               int causal, int causal_offset, float (&m)[2], float (&l)[2],
                                               float (&alpha)[2], float (&sc)[64]) {
  float q_scale[2] = {q_scale_in[0], q_scale_in[1]};  // the factor from u to S (base-2 units)
  if constexpr (kThreadK) {
    const float ks = ks_s[4 * t];  // key 4t is in this thread's group
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) q_scale[hr] *= ks;
#pragma unroll
    for (int idx = 0; idx < 64; ++idx) sc[idx] = __int2float_rn(static_cast<int>(acc[idx]));  // u = x, exact
  } else {
  // u = x·δK[col]. Accumulator index 4i + 2hr + e ↔ row g + 8hr, column 8i + 2t + e ↔ key
  // key_of_column(i, t, e); one float4 of δK serves the 4 keys 16G + 4t..4t+3 (columns i = G and G + 8).
  // The bits x + 0x4B400000 are the fp32 M + x (M = 1.5·2^23, |x| < 2^22), and u = (M + x)·δK − M·δK in
  // one FMA: exact when M·δK is, which spec.prepare guarantees by giving δK at most 22 significant bits
  // (spec.fma_friendly) — then this is the single rounding of x·δK, as if x were converted first.
#pragma unroll
  for (int grp = 0; grp < 8; ++grp) {
    const float4 ks4 = *reinterpret_cast<const float4*>(ks_s + 16 * grp + 4 * t);
    const float ksv[4] = {ks4.x, ks4.y, ks4.z, ks4.w};
    float kbias[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) kbias[c] = -12582912.f * ksv[c];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int idx = 4 * (grp + 8 * a) + 2 * hr + e;
          const float mx = __int_as_float(static_cast<int>(acc[idx]) + 0x4B400000);
          sc[idx] = fmaf(mx, ksv[2 * a + e], kbias[2 * a + e]);
        }
  }
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    if constexpr (Masked) {
#pragma unroll
      for (int i = 0; i < 16; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int idx = 4 * i + 2 * hr + e;
          const int key = k0 + key_of_column(i, t, e);
          const bool ok = key < n_valid && (!causal || key <= row[hr] + causal_offset);
          sc[idx] = ok ? sc[idx] * q_scale[hr] : -INFINITY;
        }
    }
    // Unmasked: every score finite and the scale > 0, so max_j S = scale·max_j u and S − m' is one FMA below.
    // The scale is applied before the quad's max: with kThreadK each of the four threads has its own.
    float mx = tree_reduce_row(sc, hr, MaxOp());
    if constexpr (!Masked) mx *= q_scale[hr];
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
          sc[idx] = exp2_approx(fmaf(sc[idx], q_scale[hr], kLog2_448 - m_safe));
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

// Epilogue of a consumer thread's two rows: out = O32 / l · δV (+ μV); lse = (m + log2(l / 448)) · ln 2.
template <int D>
__device__ __forceinline__ void store_output(const Params& p, const float (&o)[D / 2], const float (&m)[2],
                                             const float (&l)[2], const int (&row)[2], int t, int b, int h,
                                             int hk) {
  const float* vs_g = p.v_scale + b * p.vs_sb + hk * p.vs_sh;
  const float* vm_g = p.v_mean ? p.v_mean + b * p.vm_sb + hk * p.vm_sh : nullptr;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float lsum = l[hr];
    lsum += __shfl_xor_sync(0xffffffff, lsum, 1);
    lsum += __shfl_xor_sync(0xffffffff, lsum, 2);
    if (row[hr] >= p.nq) continue;
    const bool has_keys = lsum > 0.f;
    const float inv = has_keys ? 1.f / lsum : 0.f;
    const int64_t out_row = b * p.o_sb + h * p.o_sh + row[hr] * p.o_sn;
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
          static_cast<__half*>(p.out)[at] = __float2half_rn(val);
        } else {
          static_cast<float*>(p.out)[at] = val;
        }
      }
    if (t == 0) {
      p.lse[b * p.lse_sb + h * p.lse_sh + row[hr]] =
          has_keys ? (m[hr] + (log2f(lsum) - kLog2_448)) * kLn2 : -INFINITY;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Pieces both launch shapes share
// ---------------------------------------------------------------------------------------------------
// What one CTA works on: (batch, query head, key head), its first query row, and the keys any of its
// `rows` query rows can see (kv_lens, causal), as provably CTA-uniform values (wgmma loops run on them).
struct CtaTile {
  int b, h, hk, q0, n_valid, n_blocks;
};

__device__ __forceinline__ CtaTile cta_tile(const Params& p, int rows) {
  CtaTile tile;
  const int q_block = p.causal ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;  // causal: heavy blocks first
  tile.b = blockIdx.y / p.hq;
  tile.h = blockIdx.y % p.hq;
  tile.hk = tile.h / (p.hq / p.hkv);
  tile.q0 = q_block * rows;
  int n_valid = p.nk;
  if (p.kv_lens != nullptr) {
    const long long len = p.kv_lens_int64 ? static_cast<const int64_t*>(p.kv_lens)[tile.b]
                                          : static_cast<const int32_t*>(p.kv_lens)[tile.b];
    n_valid = static_cast<int>(len < 0 ? 0 : (len > p.nk ? p.nk : len));
  }
  int key_end = n_valid;  // keys [0, key_end) may be visible to some row of this CTA
  if (p.causal) key_end = min(key_end, min(tile.q0 + rows, p.nq) + p.causal_offset);
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
  const int8_t* q_g = p.q + tile.b * p.q_sb + tile.h * p.q_sh;
  for (int idx = tid; idx < rows * kChunks; idx += threads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = tile.q0 + r < p.nq;
    cp_async_16(sQ + swizzled<D>(r, c), ok ? q_g + (tile.q0 + r) * p.q_sn + c * 16 : q_g, ok);
  }
}

// This thread's two rows (g and g + 8 of its warp's 16, from the warpgroup's first row) and their δQ.
__device__ __forceinline__ void thread_rows(const Params& p, const CtaTile& tile, int wg_row0, int warp, int g,
                                            int (&row)[2], float (&q_scale)[2]) {
  row[0] = wg_row0 + warp * 16 + g;
  row[1] = row[0] + 8;
#pragma unroll
  for (int r = 0; r < 2; ++r)
    q_scale[r] = row[r] < p.nq ? p.q_scale[tile.b * p.qs_sb + tile.h * p.qs_sh + row[r]] : 0.f;
}

// S = Q·Kᵀ for one key block (D/32 k-steps) and T = P̂·V̂ (four k32 steps), issued, not waited for.
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
template <int D>
__device__ __forceinline__ void issue_pv(float (&pv)[D / 2], const uint32_t (&pa)[4][4], uint64_t desc_v) {
  if constexpr (D == 128) {
    wgmma_e4m3_rs_m64n128k32_x4(pv, pa, desc_v);
  } else {
    wgmma_e4m3_rs_m64n64k32_x4(pv, pa, desc_v);
  }
}

// The softmax of key block k0 for rows from wg_row0 on, P̂ packed for the PV product: the masked path
// only where a key is out of range or causally hidden for some row of the warpgroup.
template <bool kThreadK>
__device__ __forceinline__ void softmax_block_at(const Params& p, const uint32_t (&acc)[64], const float* ks_s, int t,
                                                 int k0, int wg_row0, int n_valid, const int (&row)[2],
                                                 const float (&q_scale)[2], float (&m)[2], float (&l)[2],
                                                 float (&alpha)[2], uint32_t (&pa)[4][4]) {
#ifdef SAGE_SASS_HOT_PATH  // tools/sass_loop.py: compile only the unmasked, in-range path to count its instructions
  constexpr bool masked = false;
#else
  const bool masked = k0 + kBlockN > n_valid || (p.causal && k0 + kBlockN - 1 > wg_row0 + p.causal_offset);
#endif
  float sc[64];
  if (masked) {
    softmax_scores<true, kThreadK>(acc, ks_s, t, k0, row, q_scale, n_valid, p.causal, p.causal_offset, m, l, alpha,
                                   sc);
  } else {
    softmax_scores<false, kThreadK>(acc, ks_s, t, k0, row, q_scale, n_valid, p.causal, p.causal_offset, m, l, alpha,
                                    sc);
  }
  pack_weights(sc, pa);
}

// Two-level accumulation: O = O·α + T, T a block's P̂·V̂ from a fresh accumulator.
template <int N>
__device__ __forceinline__ void fold_block(float (&o)[N], const float (&alpha)[2], float (&pv)[N]) {
  fence_registers(pv);
#pragma unroll
  for (int i = 0; i < N; ++i) o[i] = o[i] * alpha[(i >> 1) & 1] + pv[i];
}

template <int D>
__device__ __forceinline__ void consume(const Params& p, uint8_t* smem, uint32_t base, int tid, int wg,
                                        const CtaTile& tile) {
  using L = SmemLayout<D>;
  constexpr int kStages = L::kStages;
  constexpr int kOut = D / 2;  // fp32 accumulator registers of O (m64nD) per thread
  const uint32_t sQ = base + L::kQ, sK = base + L::kK, sV = base + L::kV;
  const uint32_t sBar = base + L::kBarriers;
  auto full_bar = [&](int s) { return sBar + 8 * s; };
  auto empty_bar = [&](int s) { return sBar + 8 * (kStages + s); };
  setmaxnreg_inc<kConsumerRegs>();
  const int warp = (tid & 127) >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const float* k_scale_smem = reinterpret_cast<const float*>(smem + L::kKScale);

  const int n_valid = tile.n_valid, n_blocks = tile.n_blocks;
  const int wg_row0 = tile.q0 + wg * 64;
  int row[2];
  float q_scale[2];
  thread_rows(p, tile, wg_row0, warp, g, row, q_scale);
  const uint64_t desc_q = smem_descriptor(sQ + wg * 64 * D, D);

  float o[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};  // this thread's share of the row sums (reduced over the quad at the end)
  float alpha[2] = {1.f, 1.f};
  uint32_t pa[4][4];

  // Every warpgroup walks all n_blocks of the CTA (a causal warpgroup whose rows see fewer keys masks
  // them): the wgmmas then sit on no divergent path, and both warpgroups take the same number of turns.
  auto issue_qk_block = [&](uint32_t (&acc)[64], int j) {
    issue_qk<D>(acc, desc_q, smem_descriptor(sK + (j % kStages) * L::kKBytes, D));
  };
  auto issue_pv_block = [&](float (&pv)[kOut], int j) {
    issue_pv<D>(pv, pa, smem_descriptor(sV + (j % kStages) * L::kVBytes, 128));
  };
  auto accumulate = [&](float (&pv)[kOut], int j) {  // fold T into O, then release block j's stage
    fold_block(o, alpha, pv);
    mbarrier_arrive(empty_bar(j % kStages));
  };
  auto softmax = [&](uint32_t (&acc)[64], int j) {
    fence_registers(acc);
    softmax_block_at<false>(p, acc, k_scale_smem + (j % kStages) * kBlockN, t, j * kBlockN, wg_row0, n_valid, row,
                            q_scale, m, l, alpha, pa);
  };
  const int my_turn = kTurnBarrier + wg, other_turn = kTurnBarrier + 1 - wg;

  if (n_blocks > 0) {
    if (wg == 1) named_barrier_arrive(kTurnBarrier + 0, kConsumerThreads);  // warpgroup 0 goes first
    uint32_t acc[64];
    mbarrier_wait(full_bar(0), 0);
    named_barrier_sync(my_turn, kConsumerThreads);
    wgmma_fence();
    issue_qk_block(acc, 0);
    wgmma_commit();
    named_barrier_arrive(other_turn, kConsumerThreads);
    wgmma_wait_all();
    softmax(acc, 0);
  }
  for (int j = 1; j < n_blocks; ++j) {
    uint32_t acc[64];
    float pv[kOut];
    mbarrier_wait(full_bar(j % kStages), (j / kStages) & 1);
    named_barrier_sync(my_turn, kConsumerThreads);  // my turn: T_{j−1} and S_j back to back
    wgmma_fence();
    issue_pv_block(pv, j - 1);
    wgmma_commit();
    issue_qk_block(acc, j);
    wgmma_commit();
    named_barrier_arrive(other_turn, kConsumerThreads);
    wgmma_wait<1>();  // T_{j−1} done: fold it into O while S_j is still in the tensor cores
    accumulate(pv, j - 1);
    wgmma_wait<0>();
    softmax(acc, j);
  }
  if (n_blocks > 0) {
    float pv[kOut];
    named_barrier_sync(my_turn, kConsumerThreads);
    wgmma_fence();
    issue_pv_block(pv, n_blocks - 1);
    wgmma_commit();
    if (wg == 0) named_barrier_arrive(other_turn, kConsumerThreads);  // warpgroup 1 takes the last turn
    wgmma_wait_all();
    accumulate(pv, n_blocks - 1);
  }

  store_output<D>(p, o, m, l, row, t, tile.b, tile.h, tile.hk);
}

// The copies of one key block into a stage, issued by 128 threads: K rows permuted (k_row_of_key), Vᵀ rows
// [D][128 keys], δK. Each thread's chunks sit at fixed offsets from the block's base (the row permutation
// and the swizzle repeat every 16 rows), so the offsets are computed once; a block wholly inside Nk needs
// no bounds checks. (Recomputing them per block held v1 at 564 instead of 678 TOPS on the H100.)
template <int D>
struct BlockCopier {
  static constexpr int kChunks = D / 16;                    // 16-byte chunks per K row
  static constexpr int kKRowsPerStep = 128 / kChunks;       // K rows (keys) covered by one pass of 128 threads
  static constexpr int kKSmemStep = kKRowsPerStep / 2 * D;  // their shared-memory advance (k_row_of_key)
  static constexpr int kKSteps = kBlockN * kChunks / 128;
  static constexpr int kVSteps = D * (kBlockN / 16) / 128;  // 16 Vᵀ rows of 8 chunks per pass
  uint32_t k_soff, v_soff;  // shared-memory byte offsets of this thread's first K and V chunk in a stage
  int k_n0, k_goff, v_goff, v_c16, lane;

  __device__ __forceinline__ BlockCopier(int t, int k_row, int v_row) : lane(t) {
    k_n0 = t / kChunks;
    const int kc = t % kChunks;
    k_soff = swizzled<D>(k_row_of_key(k_n0), kc);
    k_goff = k_n0 * k_row + kc * 16;
    const int d0 = t >> 3, vc = t & 7;
    v_soff = swizzled<128>(d0, vc);
    v_goff = d0 * v_row + vc * 16;
    v_c16 = vc * 16;
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
    if (kHotPathOnly || k0 + kBlockN <= p.nk) {  // whole block in range
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
      const bool ok = kHotPathOnly || k0 + lane < p.nk;
      cp_async_4(dKS + lane * 4, ok ? ks_g + k0 + lane : ks_g, ok);
    }
  }

  // Vᵀ rows [D][128 keys] of the block at key k0.
  __device__ __forceinline__ void issue_v(const Params& p, int k0, uint32_t dV, const uint8_t* v_g, int v_row) const {
    const uint8_t* v_blk = v_g + k0;
    if (kHotPathOnly || k0 + kBlockN <= p.nk) {  // whole block in range (then also within Nkp ≥ Nk)
#pragma unroll
      for (int i = 0; i < kVSteps; ++i) cp_async_16(dV + v_soff + i * 16 * 128, v_blk + v_goff + i * 16 * v_row, true);
    } else {
      const bool v_ok = k0 + v_c16 < p.nkp;
#pragma unroll
      for (int i = 0; i < kVSteps; ++i)
        cp_async_16(dV + v_soff + i * 16 * 128, v_ok ? v_blk + v_goff + i * 16 * v_row : v_g, v_ok);
    }
  }
};

// Warp-specialized: warpgroup 2 produces (cp.async of K, Vᵀ, δK into the stages), warpgroups 0 and 1
// consume, taking turns to issue their wgmmas (named barriers, FlashAttention-3's ping-pong) so that one
// warpgroup's softmax runs while the other's matrix products occupy the tensor cores. Iteration j of a
// consumer issues S_j = Q·K_jᵀ and the previous block's T = P̂_{j−1}·V̂_{j−1} together, then
// O = O·α_{j−1} + T (two-level accumulation) and the softmax of block j.
template <int D>
__global__ void __launch_bounds__(kConsumerThreads + 128, 1) attention_kernel(const __grid_constant__ Params p) {
  using L = SmemLayout<D>;
  constexpr int kStages = L::kStages;
  constexpr int kAllThreads = kConsumerThreads + 128;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  const uint32_t sQ = base + L::kQ, sK = base + L::kK, sV = base + L::kV, sKS = base + L::kKScale;
  const uint32_t sBar = base + L::kBarriers;
  auto full_bar = [&](int s) { return sBar + 8 * s; };
  auto empty_bar = [&](int s) { return sBar + 8 * (kStages + s); };

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffff, tid >> 7, 0);  // provably warp-uniform: wgmma needs convergence
  const CtaTile tile = cta_tile(p, kBlockM);
  const int b = tile.b, hk = tile.hk, n_blocks = tile.n_blocks;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full_bar(s), 128);                // the producer warpgroup's cp.async arrivals
      mbarrier_init(empty_bar(s), kConsumerThreads);  // every consumer thread is done with the stage
    }
  }
  load_q<D>(sQ, p, tile, kBlockM, tid, kAllThreads);  // every thread helps
  cp_async_wait_all();
  fence_proxy_async();
  __syncthreads();

  if (wg == 2) {
    // ---------------- producer: K rows permuted (k_row_of_key), Vᵀ rows [D][128 keys], δK ----------------
    setmaxnreg_dec<kProducerRegs>();
    const int pt = tid - kConsumerThreads;
    const int8_t* k_g = p.k + b * p.k_sb + hk * p.k_sh;
    const uint8_t* v_g = p.v + b * p.v_sb + hk * p.v_sh;
    const float* ks_g = p.k_scale + b * p.ks_sb + hk * p.ks_sh;
    const int k_row = static_cast<int>(p.k_sn), v_row = static_cast<int>(p.v_sd);
    const BlockCopier<D> copier(pt, k_row, v_row);
    for (int j = 0; j < n_blocks; ++j) {
      const int s = j % kStages;
      if (j >= kStages) mbarrier_wait_sleeping(empty_bar(s), ((j / kStages) - 1) & 1);
      const int k0 = j * kBlockN;
      const uint32_t dK = sK + s * L::kKBytes, dV = sV + s * L::kVBytes, dKS = sKS + s * kBlockN * 4;
      copier.issue(p, k0, dK, dV, dKS, k_g, v_g, ks_g, k_row, v_row);  // 32-bit in-block offsets: sm90.py checks
      cp_async_arrive(full_bar(s));
    }
    cp_async_wait_all();
  } else {
    consume<D>(p, smem, base, tid, wg, tile);
  }
}

// ---------------------------------------------------------------------------------------------------
// Variants 1 and 2: one warpgroup per CTA (64 query rows, 128 threads), two or three CTAs per SM — the
// Triton kernel's shape: no producer, no ping-pong; the resident CTAs overlap each other's softmax and
// wgmmas. Thread 0 issues the next block's tensor-map copies (K, Vᵀ, δK) on the stage's mbarrier, with no
// block-wide barrier in the loop; where the maps cannot be made, every thread issues its share of cp.async
// instead (commit groups, wait_group, one barrier per block). Same numerics as the warp-specialized kernel. Three CTAs
// per SM cap registers at 168 (D=64 fits; D=128 spills a few O registers) and leave room for two stages
// at D=128. FlashAttention-3's intra-warpgroup overlap was tried on this shape and lost (notes).
// ---------------------------------------------------------------------------------------------------
constexpr int kBlockM1 = 64;

template <int D, int Stages = 3>
struct SmemLayout1 {
  static constexpr int kStages = Stages;
  static constexpr int kQBytes = kBlockM1 * D;
  static constexpr int kKBytes = kBlockN * D;
  static constexpr int kVBytes = D * kBlockN;
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

// Pipeline stages of the one-warpgroup kernel: as many as fit beside the other resident CTAs (228 KB).
template <int D, int CtasPerSm>
__host__ __device__ constexpr int Stages1() {
  return CtasPerSm == 2 ? 3 : (D == 128 ? 2 : 3);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// kMaps: copies by tensor map (launch() picks this instantiation when p.tma), else by cp.async — separate
// instantiations, so that neither carries the other's state through the loop. kThreadK: one δK per thread
// group (p.k_thread_groups; built with tensor maps only — elsewhere the per-key path reads the same values).
template <int D, int CtasPerSm, bool kMaps, bool kThreadK>
__global__ void __launch_bounds__(128, CtasPerSm) attention_kernel_1wg(const __grid_constant__ Params p) {
  using L = SmemLayout1<D, Stages1<D, CtasPerSm>()>;
  constexpr int kStages = L::kStages;
  constexpr int kOut = D / 2;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  const uint32_t sQ = base + L::kQ, sK = base + L::kK, sV = base + L::kV, sKS = base + L::kKScale;
  const float* k_scale_smem = reinterpret_cast<const float*>(smem + L::kKScale);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const CtaTile tile = cta_tile(p, kBlockM1);
  const int b = tile.b, hk = tile.hk, q0 = tile.q0, n_valid = tile.n_valid, n_blocks = tile.n_blocks;

  const int8_t* k_g = p.k + b * p.k_sb + hk * p.k_sh;
  const uint8_t* v_g = p.v + b * p.v_sb + hk * p.v_sh;
  const float* ks_g = p.k_scale + b * p.ks_sb + hk * p.ks_sh;
  const int k_row = static_cast<int>(p.k_sn), v_row = static_cast<int>(p.v_sd);
  load_q<D>(sQ, p, tile, kBlockM1, tid, 128);
  const BlockCopier<D> copier(tid, k_row, v_row);
  // With tensor maps thread 0 issues every copy of a block — K's two permuted halves, Vᵀ and δK — on the
  // stage's full barrier; each warp's lane 0 arrives on the stage's empty barrier once its products of the
  // block have completed, and thread 0 waits for all four before refilling the stage. No block-wide barrier
  // in the loop. Without maps every thread copies its share by cp.async (commit groups, wait_group, one
  // __syncthreads per block).
  constexpr bool by_map = kHotPathOnly || kMaps;
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
    mbarrier_expect_tx(full, 2 * kBlockN * D + kBlockN * 4);
    tma_load_5d(dK, &p.k_map, full, 0, 0, k0 / 4, hk, b);
    tma_load_5d(dK + 64 * D, &p.k_map, full, 0, 2, k0 / 4, hk, b);
    tma_load_4d(dV, &p.v_map, full, k0, 0, hk, b);
    tma_load_3d(dKS, &p.ks_map, full, k0, hk, b);
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

  float o[kOut];
#pragma unroll
  for (int i = 0; i < kOut; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};
  float alpha[2];
  uint32_t pa[4][4];

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
    // warpgroup's collective wgmma (at the top of the loop they did: ncu "gmma" stalls, v1 D=64 −6%).
    if (by_map && tid == 0 && j + kStages - 1 < n_blocks) load_block(j + kStages - 1);
    wgmma_wait<0>();
    fence_registers(acc);
    softmax_block_at<kThreadK>(p, acc, k_scales(j), t, j * kBlockN, q0, n_valid, row, q_scale, m, l, alpha, pa);
    float pv[kOut];
    wgmma_fence();
    issue_pv<D>(pv, pa, v_desc(j));
    wgmma_commit();
    wgmma_wait<0>();
    if (by_map && lane == 0) mbarrier_arrive(sEmpty + 8 * (j % kStages));  // this warp is done with the stage
    fold_block(o, alpha, pv);
  }
  cp_async_wait<0>();
  store_output<D>(p, o, m, l, row, t, b, tile.h, hk);
}

// ---------------------------------------------------------------------------------------------------
// Host
// ---------------------------------------------------------------------------------------------------
template <typename Kernel>
static cudaError_t allow_smem(Kernel kernel, int bytes, unsigned& configured) {
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

// Tensor maps of K (permuted-row halves, see k_row_of_key), Vᵀ and δK for the one-warpgroup kernel, all or
// none: tma = 1 only when every map encodes. Keys past Nk read as zeros (the copy engine fills them), so
// the tail block needs no special case. Strides the copy engine cannot take (not multiples of 16 bytes),
// Nk not a multiple of 4 (K's rows are addressed as quads) or shorter than one block leave tma = 0.
static void fill_tensor_maps(Params& q) {
  q.tma = 0;
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || !tensor_maps_enabled() || q.nk < kBlockN || q.nk % 4 != 0) return;
  const int d = q.head_dim_padded;
  const cuuint64_t batch = static_cast<cuuint64_t>(q.batch), heads = static_cast<cuuint64_t>(q.hkv);
  cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  // Vᵀ [B, Hkv, Dp, Nkp] bytes: dims (key, d, head, batch), box 128 keys × Dp rows.
  {
    const uint64_t sd = q.v_sd, sh = outer_stride(q.v_sh, q.hkv, sd * d);
    const uint64_t sb = outer_stride(q.v_sb, q.batch, sh * q.hkv);
    cuuint64_t dims[4] = {static_cast<cuuint64_t>(q.nkp), static_cast<cuuint64_t>(d), heads, batch};
    cuuint64_t strides[3] = {sd, sh, sb};
    cuuint32_t box[4] = {kBlockN, static_cast<cuuint32_t>(d), 1, 1};
    if (!aligned16(reinterpret_cast<uint64_t>(q.v)) || !aligned16(sd) || !aligned16(sh) || !aligned16(sb)) return;
    if (encode(&q.v_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<uint8_t*>(q.v), dims, strides, box, unit,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return;
  }
  // K [B, Hkv, Nk, Dp] bytes: dims (d, r, quad, head, batch) with key = 4·quad + r; a box is one half
  // (r ∈ {2a, 2a + 1}) of a block's 32 quads.
  {
    const int quads = q.nk / 4;
    const uint64_t sn = q.k_sn, sh = outer_stride(q.k_sh, q.hkv, sn * q.nk);
    const uint64_t sb = outer_stride(q.k_sb, q.batch, sh * q.hkv);
    cuuint64_t dims[5] = {static_cast<cuuint64_t>(d), 4, static_cast<cuuint64_t>(quads), heads, batch};
    cuuint64_t strides[4] = {sn, 4 * sn, sh, sb};
    cuuint32_t box[5] = {static_cast<cuuint32_t>(d), 2, kBlockN / 4, 1, 1};
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

template <int D, int CtasPerSm, bool kMaps, bool kThreadK>
static cudaError_t launch_1wg_with(const Params& p, cudaStream_t stream) {
  static unsigned configured = 0;
  constexpr int kSmem = SmemLayout1<D, Stages1<D, CtasPerSm>()>::kDynamic;
  cudaError_t err = allow_smem(attention_kernel_1wg<D, CtasPerSm, kMaps, kThreadK>, kSmem, configured);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.nq + kBlockM1 - 1) / kBlockM1, p.batch * p.hq);
  attention_kernel_1wg<D, CtasPerSm, kMaps, kThreadK><<<grid, 128, kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <int D, int CtasPerSm>
static cudaError_t launch_1wg(const Params& p, cudaStream_t stream) {
  Params q = p;
  fill_tensor_maps(q);
  if (!q.tma) return launch_1wg_with<D, CtasPerSm, false, false>(q, stream);
  return q.k_thread_groups ? launch_1wg_with<D, CtasPerSm, true, true>(q, stream)
                           : launch_1wg_with<D, CtasPerSm, true, false>(q, stream);
}

template <int D>
static cudaError_t launch_for(const Params& p, cudaStream_t stream, int variant) {
  if (variant == 1) return launch_1wg<D, 2>(p, stream);
  if (variant == 2) return launch_1wg<D, 3>(p, stream);
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
  if (variant < 0 || variant > 2)
    return "sm90 kernel: variant must be 0 (warp-specialized), 1 or 2 (one warpgroup, two or three CTAs per SM)";
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
static cudaError_t attributes_for(int variant, bool thread_k, cudaFuncAttributes* attr, int* dynamic_smem) {
  if (variant == 0) {
    *dynamic_smem = SmemLayout<D>::kDynamic;
    return cudaFuncGetAttributes(attr, attention_kernel<D>);
  }
  // The tensor-map instantiations (the cp.async one runs only where no map can be made).
  if (variant == 1) {
    *dynamic_smem = SmemLayout1<D, Stages1<D, 2>()>::kDynamic;
    return thread_k ? cudaFuncGetAttributes(attr, attention_kernel_1wg<D, 2, true, true>)
                    : cudaFuncGetAttributes(attr, attention_kernel_1wg<D, 2, true, false>);
  }
  *dynamic_smem = SmemLayout1<D, Stages1<D, 3>()>::kDynamic;
  return thread_k ? cudaFuncGetAttributes(attr, attention_kernel_1wg<D, 3, true, true>)
                  : cudaFuncGetAttributes(attr, attention_kernel_1wg<D, 3, true, false>);
}

bool kernel_info(int head_dim_padded, int variant, bool thread_k, int* regs, int* local_bytes, int* dynamic_smem,
                 int* max_threads) {
  if (variant < 0 || variant > 2) return false;
  cudaFuncAttributes attr{};
  cudaError_t err;
  if (head_dim_padded == 128) {
    err = attributes_for<128>(variant, thread_k, &attr, dynamic_smem);
  } else if (head_dim_padded == 64) {
    err = attributes_for<64>(variant, thread_k, &attr, dynamic_smem);
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

// The sm90 kernel's launch parameters: raw pointers and element strides, checked by the Python caller
// (sage_compile/kernels/sm90.py) against the contract of sage_compile.spec.Prepared.
#pragma once
#include <cuda.h>  // CUtensorMap (a 128-byte value; no driver library is linked)

#include <cstdint>

namespace sage_sm90 {

enum OutDtype : int { kOutBF16 = 0, kOutFP16 = 1, kOutFP32 = 2 };
enum RopeDtype : int { kRopeBF16 = 0, kRopeFP16 = 1, kRopeFP32 = 2 };

struct Params {
  const int8_t* q;         // [B, Hq, Nq, Dp] int8, last dim contiguous, rows 16-byte aligned
  const float* q_scale;    // [B, Hq, Nq] fp32 (includes softmax scale · log2 e)
  const int8_t* k;         // [B, Hkv, Nk, Dp] int8
  const float* k_scale;    // [B, Hkv, Nk] fp32
  const uint8_t* v;        // [B, Hkv, Dp, Nkp] e4m3 (or fp16: pv16) Vᵀ, Nkp a multiple of 16, zero past Nk
  const float* v_scale;    // [B, Hkv, Dp] fp32
  const float* v_mean;     // [B, Hkv, Dp] fp32 or null
  const void* kv_lens;     // [B] int32 / int64 or null
  void* out;               // [B, Hq, Nq, head_dim] bf16 / fp16 / fp32, any strides
  float* lse;              // [B, Hq, Nq] fp32 (natural log, smoothed scores)
  int64_t q_sb, q_sh, q_sn;
  int64_t qs_sb, qs_sh;
  int64_t k_sb, k_sh, k_sn;
  int64_t ks_sb, ks_sh;
  int64_t v_sb, v_sh, v_sd;
  int64_t vs_sb, vs_sh;
  int64_t vm_sb, vm_sh;
  int64_t o_sb, o_sh, o_sn, o_sd;
  int64_t lse_sb, lse_sh;
  int batch, hq, hkv, nq, nk, nkp, head_dim, head_dim_padded;
  int causal;         // 0 none, 1 top-left, 2 bottom-right
  int causal_offset;  // key j visible to query i iff j <= i + causal_offset
  int kv_lens_int64;
  int out_dtype;      // OutDtype
  int k_thread_groups;  // 1: k_scale constant over each per_thread key group (spec.THREAD_GROUP_KEYS)
  int pv16;             // 1: V̂ is fp16 (pv = fp16; strides in elements) and P̂ is rounded to fp16, not e4m3
  // Score biases, added to S = x·δQ·δK in the spec's order: ΔS (smooth_q; fp32 [B, Hq, ceil(Nq/q_group), Nk],
  // base-2 units; query row r reads row r / q_group), then attn_mask ([B|1, Hq|1, Nq|1, Nk]: fp32 added, base-2
  // units, or bool, false → −inf). Element strides (0 where broadcast); null when absent. launch() sets the
  // *_vec flags: rows aligned for one 4-key load (16 B fp32, 4 B bool) and keys contiguous.
  const float* delta_s;
  int64_t ds_sb, ds_sh, ds_sr, ds_sk;
  int q_group;
  const void* mask;
  int64_t mask_sb, mask_sh, mask_sr, mask_sk;
  int mask_bool;
  int ds_vec, mask_vec;
  // Tensor maps for the one-warpgroup kernel, filled by launch() where the strides allow (tma = 1): K (5-D:
  // d, r, quad, head, batch — key = 4·quad + r, so one box per half of a block's permuted rows; pv16: one box of
  // the block's rows in natural order), Vᵀ (4-D: key, d, head, batch; pv16: fp16, a box per 64 keys) and δK
  // (3-D: key, head, batch).
  // Q's rotary and quantization in the one-warpgroup kernel's prologue (xq non-null; launch_1wg_rope_q): instead of
  // q / q_scale the CTA reads raw Q and the four rotary tables (sage_compile/prep.py's rope(x) = cat(x₁·c₁ − x₂·s₁,
  // x₂·c₂ + x₁·s₂), no FMA), quantizes each row per token as prep's rope_quantize does (δ = fma_friendly(max(amax/127,
  // tiny)), x̂ = rint(x·(1/δ)), spec.quantize_symmetric) into its Q tile, and keeps δ·q_out_scale per row in shared memory.
  // Head dim unpadded (D = head_dim_padded); last dims contiguous; rows 16-byte aligned (sm90.py checks).
  const void* xq;          // [B, Hq, Nq, D] bf16 (xq_fp16 = 0) or fp16
  int64_t xq_sb, xq_sh, xq_sn;
  int xq_fp16;
  const void* rope[4];     // c₁, s₁, c₂, s₂, each broadcastable to [B, Hq, Nq, D/2] (element strides, 0 where broadcast)
  int64_t rope_sb[4], rope_sh[4], rope_sn[4];
  int rope_dtype;          // RopeDtype, the same for all four
  int rope_same_halves;    // 1: c₂ is c₁ and s₂ is s₁ (the half-table form: two tables read, not four)
  float q_out_scale;       // softmax scale · log2 e
  int tma;
  CUtensorMap k_map;  // 64-byte aligned by its type, as a kernel parameter must be
  CUtensorMap v_map;
  CUtensorMap ks_map;
};

// Launches on `stream` (a cudaStream_t as an integer). Returns "" or the CUDA error text.
// variant 0: warp-specialized (producer + two ping-pong consumer warpgroups, 128 rows per CTA; no score
// biases); variants 1, 2: one warpgroup per CTA (64 rows, two or three CTAs per SM). Same function (block_n 128).
// pv16 runs on variant 1 at D=128 and on variants 1, 2 at D=64.
const char* launch(const Params& p, int64_t stream, int variant);

// Registers, static shared memory, local (spill) bytes and the dynamic shared memory of the kernel for
// one padded head dim (thread_k: the per_thread δK instantiation; biased: the one that reads ΔS / attn_mask,
// variants 1 and 2 only; pv16: the fp16-PV one; rope_q: the one that rotates Q in its prologue, variants 1-3); false
// when there is no such kernel.
bool kernel_info(int head_dim_padded, int variant, bool thread_k, bool biased, bool pv16, bool rope_q, int* regs,
                 int* local_bytes, int* dynamic_smem, int* max_threads);

}  // namespace sage_sm90

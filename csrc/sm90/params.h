// The sm90 kernel's launch parameters: raw pointers and element strides, checked by the Python caller
// (sage_compile/kernels/sm90.py) against the contract of sage_compile.numerics.spec.Prepared.
#pragma once
#include <cuda.h>  // CUtensorMap (a 128-byte value; no driver library is linked)

#include <cstdint>

namespace sage_sm90 {

enum OutDtype : int { kOutBF16 = 0, kOutFP16 = 1, kOutFP32 = 2 };

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
  // Tensor maps, filled by launch() where the strides allow (tma = 1): K (5-D: d, r, quad, head, batch — key =
  // 4·quad + r, so one box per half of a block's permuted rows; pv16: one box of the block's rows in natural
  // order), Vᵀ (4-D: key, d, head, batch; pv16: fp16, a box per 64 keys) and δK (3-D: key, head, batch).
  int tma;
  // A packed ragged batch (sage_compile.ops.varlen; null cu_blk: a batched launch): batch = 1, Nq = Tq packed query
  // rows, Nk = Nkp = C key slots. Sequence s is queries cu_q[s]..cu_q[s+1] and cu_k[s+1] − cu_k[s] keys from slot
  // key_first[s] (a multiple of 16) — causal per sequence — with δV / μV row s ([S, Hkv, Dp]: vs_sb, vm_sb); its
  // query blocks of kBlockM are cu_blk[s]..cu_blk[s+1] of the grid's first cu_blk[S] (the rest idle). Needs tma.
  const int32_t* cu_q;
  const int32_t* cu_k;
  const int32_t* key_first;
  const int32_t* cu_blk;
  int n_seq;
  CUtensorMap k_map;  // 64-byte aligned by its type, as a kernel parameter must be
  CUtensorMap v_map;
  CUtensorMap ks_map;
};

// Which compiled kernel runs (kernel.cuh's attention_kernel template arguments). launch() derives every field
// but ctas_per_sm from the Params it is given — maps = p.tma (fill_tensor_maps); thread_k = p.k_thread_groups && maps
// (the cp.async instantiation reads every key's δK, the same values); pairs = maps && pairs_aligned(p); bias = ΔS
// or an attn_mask present; pv16 = p.pv16 — and looks the key up among the built instantiations (generated at build
// time by csrc/sm90/instantiations.py: those sage_compile/kernels/sm90.py's heuristics pick).
struct InstanceKey {
  int head_dim;     // padded: 64 or 128
  int ctas_per_sm;  // CTAs resident per SM (__launch_bounds__; sets the pipeline stages)
  bool maps, thread_k, pairs, bias, pv16;
};

// Launches on `stream` (a cudaStream_t as an integer) the instantiation for p with `ctas_per_sm` CTAs per SM.
// Returns "" or the error text (no such instantiation, or the CUDA error).
const char* launch(const Params& p, int64_t stream, int ctas_per_sm);

// Registers, local (spill) bytes, dynamic shared memory and threads of the tensor-map instantiation with the pair
// epilogue for (head_dim_padded, ctas_per_sm, thread_k, biased, pv16); false when it is not built or no device.
bool kernel_info(int head_dim_padded, int ctas_per_sm, bool thread_k, bool biased, bool pv16, int* regs,
                 int* local_bytes, int* dynamic_smem, int* max_threads);

// The built instantiations' keys, in table order.
int instance_count();
InstanceKey instance_key(int index);

}  // namespace sage_sm90

// Arguments of the sm89 kernel (csrc/sm89/attention.cu): the quantized-attention contract of
// sage_compile/kernels/__init__.py with Q̂ and K̂ packed as 4-bit codes. Strides are in elements; every last
// dimension is contiguous (sage_compile/kernels/sm89.py checks it).
#pragma once

#include <cstdint>

namespace sage_sm89 {

struct Params {
  const uint8_t* q;        // [B, Hq, Nq, Dp/2]: two int4 codes per byte, the even channel in the low nibble
  const float* q_scale;    // [B, Hq, Nq]: δQ (s·log2 e folded in)
  const uint8_t* k;        // [B, Hkv, Nk, Dp/2]
  const float* k_scale;    // [B, Hkv, Nk]: δK, one per key (any granularity)
  const uint8_t* v;        // [B, Hkv, Dp, Nkp] e4m3 (or fp16: pv16): V̂ᵀ, Nkp = Nk padded to 16 (zeros)
  const float* v_scale;    // [B, Hkv, Dp]: δV
  const float* v_mean;     // [B, Hkv, Dp] μV, or null
  const float* delta_s;    // [B, Hq, ceil(Nq / q_group), Nk]: ΔS (smooth_q), or null
  const void* kv_lens;     // [B] int32 or int64, or null
  void* out;               // [B, Hq, Nq, head_dim]: bf16, fp16 or fp32
  float* lse;              // [B, Hq, Nq]
  int64_t q_sb, q_sh, q_sn;
  int64_t qs_sb, qs_sh;
  int64_t k_sb, k_sh, k_sn;
  int64_t ks_sb, ks_sh;
  int64_t v_sb, v_sh, v_sd;
  int64_t vs_sb, vs_sh, vm_sb, vm_sh;
  int64_t ds_sb, ds_sh, ds_sg;
  int64_t o_sb, o_sh, o_sn, o_sd;
  int64_t l_sb, l_sh;
  int batch, hq, gqa, nq, nk, nkp, head_dim;
  int q_group;             // a multiple of the CTA's 64 rows: one ΔS row per CTA
  int causal;              // 0 none, 1 top-left, 2 bottom-right
  int causal_offset;       // Nk − Nq for bottom-right, else 0
  bool kv_lens_int64;
};

enum OutDtype { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

// Head dims (padded) with an instantiation.
constexpr int kHeadDims[] = {64, 128};

// Launches on ``stream``; ``pv16``: V̂ᵀ and P̂ in fp16 (else e4m3). Returns the CUDA error of the launch (0: none).
int launch(const Params& p, int head_dim_padded, int out_dtype, bool pv16, void* stream);

}  // namespace sage_sm89

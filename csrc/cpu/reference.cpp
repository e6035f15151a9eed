// Exact CPU kernel for sage.quantized_attention: bit-for-bit the algorithm of
// sage_compile/numerics/spec.py::quantized_attention_reference (its docstring states the rounding rules), only
// without the Python loop and without copying K/V per query head. NVFP4 (qk = pv = "fp4") runs the same
// loop with its operands decoded to double (code × E4M3 block scale: both products exact, see spec.py).
//
// Not linked against libtorch on purpose (no ABI coupling): every tensor arrives from Python as
// (data_ptr, dtype name, element strides: common.h); sizes come separately. Python validates shapes and
// dtypes; this file checks only what it needs to stay memory safe. The module also holds the backward
// (backward.cpp).
#include "common.h"

namespace {

using namespace sage_cpu;

constexpr float kPScale = 448.0f;  // spec.P_SCALE
constexpr float kE4M3Max = 448.0f;
constexpr float kFp4Max = 6.0f;  // spec.FP4_MAX
constexpr float kFp4Range = 2688.0f;  // spec.FP4_RANGE = 448 · 6
constexpr int64_t kFp4Block = 16;  // spec.FP4_BLOCK

// ------------------------------------------------------------------------------------------------
// Narrow floating-point formats, rounded exactly like torch's Tensor.to().
// ------------------------------------------------------------------------------------------------

// Encoding of an output dtype (bf16 or fp16).
struct OutFormat {
  int mant_bits;
  int min_exp;  // exponent of the smallest normal number
  uint32_t max_code;  // what a larger magnitude becomes: fp16 saturates at 65504 (spec.saturate), bf16 gives inf
  uint32_t nan_code;
};

constexpr OutFormat kF16Out{10, -14, 0x7BFF, 0x7E00};
constexpr OutFormat kBF16Out{7, -126, 0x7F80, 0x7FC0};

// v / 2^shift rounded half to even (shift >= 1).
HOT uint32_t shift_round_half_even(uint32_t v, int shift) {
  if (shift > 24) return 0;  // v < 2^24 <= half a quantum
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rest = v & ((half << 1) - 1);
  const uint32_t q = v >> shift;
  return q + (rest > half || (rest == half && (q & 1)));
}

// The significand is rounded at the target's quantum (fixed below min_exp: subnormals); a carry out of
// the mantissa lands in the exponent field, which is exactly the next binade's encoding; a code past
// max_code is max_code.
HOT uint16_t encode(float x, const OutFormat& fmt) {
  const uint32_t bits = float_bits(x);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return static_cast<uint16_t>(fmt.nan_code | sign);
  int exp = static_cast<int>(mag >> 23) - 127;
  uint32_t significand = mag & 0x7FFFFFu;
  if (exp == -127) {
    exp = -126;  // fp32 subnormal: no implicit bit
  } else {
    significand |= 0x800000u;
  }
  const int target_exp = std::max(exp, fmt.min_exp);
  const uint32_t q = shift_round_half_even(significand, 23 - fmt.mant_bits + (target_exp - exp));
  const uint32_t code = (static_cast<uint32_t>(target_exp - fmt.min_exp) << fmt.mant_bits) + q;
  return static_cast<uint16_t>(std::min(code, fmt.max_code) | sign);
}

float e4m3_value(uint32_t code) {
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  const int exp = (code >> 3) & 0xF;
  const int mant = code & 0x7;
  if (exp == 0xF && mant == 0x7) return kNaN;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
}

const std::vector<float>& e4m3_table() {
  static const std::vector<float> table = decode_table<256>(e4m3_value);
  return table;
}

// The PV operand type (V̂ and P̂): e4m3fn or fp16.
struct PvFormat {
  int mant_bits;
  int min_exp;  // exponent of the smallest normal number
  const float* table;
  int64_t bytes;
};

PvFormat pv_format(const std::string& dtype) {
  if (dtype == "float8_e4m3fn") return {3, -6, e4m3_table().data(), 1};
  if (dtype == "float16") return {10, -14, f16_table().data(), 2};
  throw py::type_error("v: dtype " + dtype + " is not float8_e4m3fn or float16");
}

// spec.quantize_pv_operand: clamp (NaN passes through, as in torch.clamp), then round half to even.
// Within ±448 neither format overflows, so rounding is all there is: x + c − c with c = 1.5·2^23·quantum
// rounds x to a multiple of the quantum in fp32 itself (c's ulp is the quantum), branch-free.
HOT float round_pv(float x, const PvFormat& pv) {
  const float clamped = x > kE4M3Max ? kE4M3Max : (x < -kE4M3Max ? -kE4M3Max : x);
  const int exp = std::max(static_cast<int>((float_bits(clamped) >> 23) & 0xFF) - 127, pv.min_exp);
  const float magic = bits_float(static_cast<uint32_t>(exp - pv.mant_bits + 127) << 23) * 12582912.0f;
  return std::copysign((clamped + magic) - magic, clamped);  // copysign: -0 stays -0, as in torch
}

// ------------------------------------------------------------------------------------------------
// NVFP4 (spec.py's quantize_nvfp4): E2M1 codes (bit 3 the sign, bits 0-2 the magnitude's index).
// ------------------------------------------------------------------------------------------------
constexpr std::array<float, 8> kE2M1Values{0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

const PvFormat& e4m3_format() {
  static const PvFormat format{3, -6, e4m3_table().data(), 1};
  return format;
}

// spec.round_e2m1: nearest, ties to the even code (a midpoint goes up where the code above it is even),
// saturating; NaN gives code 0, a negative x the sign bit.
HOT uint32_t round_e2m1(float x) {
  const float mag = std::fabs(x);
  const uint32_t index = (mag > 0.25f) + (mag >= 0.75f) + (mag > 1.25f) + (mag >= 1.75f) + (mag > 2.5f) +
                         (mag >= 3.5f) + (mag > 5.0f);
  return index + (x < 0.0f ? 8u : 0u);
}

HOT double e2m1_value(uint32_t code) {
  const double mag = kE2M1Values[code & 7];
  return (code & 8) ? -mag : mag;
}

// spec.nvfp4_delta: the second-level scale of a group of absolute maximum amax.
HOT float nvfp4_delta(float amax) {
  if (!std::isfinite(amax)) return kNaN;
  return std::max(amax / kFp4Range, std::numeric_limits<float>::min());
}

// V̂ is e4m3 or fp16, so it is addressed as raw codes of pv.bytes bytes.
struct PvTensor {
  const uint8_t* data;
  std::array<int64_t, 4> strides;
  PvFormat pv;

  HOT float operator()(int64_t b, int64_t h, int64_t d, int64_t j) const {
    const int64_t offset = b * strides[0] + h * strides[1] + d * strides[2] + j * strides[3];
    if (pv.bytes == 1) return pv.table[data[offset]];
    uint16_t code;
    std::memcpy(&code, data + 2 * offset, sizeof code);
    return pv.table[code];
  }
};

// An NVFP4 operand: codes two per byte along the reduction (the low nibble first), [a, b, row, reduction/2],
// and one E4M3 scale per 16 of them, [a, b, row, reduction/16]. Element e of a row decodes to code × scale,
// exact in double (spec.fp4_values).
struct Fp4Tensor {
  View<const uint8_t, 4> codes, scales;
  const float* e4m3;

  HOT double operator()(int64_t a, int64_t b, int64_t row, int64_t e) const {
    const uint32_t byte = codes(a, b, row, e / 2);
    return e2m1_value((e & 1) ? byte >> 4 : byte & 15) * e4m3[scales(a, b, row, e / kFp4Block)];
  }
};

std::optional<Fp4Tensor> fp4_tensor(const TensorArg& codes, const std::optional<TensorArg>& scales, const char* name,
                                    const char* scales_name) {
  if (!scales) return std::nullopt;
  return Fp4Tensor{view<const uint8_t, 4>(codes, name, "uint8"),
                   view<const uint8_t, 4>(*scales, scales_name, "float8_e4m3fn"), e4m3_table().data()};
}

// out is bf16, fp16 (encoded with `fmt`) or fp32 (fmt == nullptr).
struct OutTensor {
  uint8_t* data;
  std::array<int64_t, 4> strides;
  const OutFormat* fmt;

  HOT void store(int64_t b, int64_t h, int64_t i, int64_t d, float x) const {
    const int64_t offset = b * strides[0] + h * strides[1] + i * strides[2] + d * strides[3];
    if (fmt == nullptr) {
      std::memcpy(data + 4 * offset, &x, sizeof x);
      return;
    }
    const uint16_t code = encode(x, *fmt);
    std::memcpy(data + 2 * offset, &code, sizeof code);
  }
};

OutTensor out_tensor(const TensorArg& arg) {
  const std::string& dtype = std::get<1>(arg);
  const OutFormat* fmt = nullptr;
  if (dtype == "bfloat16") {
    fmt = &kBF16Out;
  } else if (dtype == "float16") {
    fmt = &kF16Out;
  } else if (dtype != "float32") {
    throw py::type_error("out: dtype " + dtype + " is not bfloat16, float16 or float32");
  }
  return {reinterpret_cast<uint8_t*>(std::get<0>(arg)), checked_strides<4>(arg, "out"), fmt};
}

// ------------------------------------------------------------------------------------------------
// The kernel. A task is a block of query rows of one (batch, head). Per key block it computes the
// dot products of all its rows, then each row's online-softmax step, then P̂·V̂ for all its rows.
// ------------------------------------------------------------------------------------------------
// Register tiles as GCC vector types; each target clone lowers them to zmm, ymm or xmm registers.
// They never cross a call (everything is inlined), so the ABI note GCC gives for them does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float Floats __attribute__((vector_size(64)));
typedef double Doubles __attribute__((vector_size(64)));
typedef float HalfFloats __attribute__((vector_size(32)));  // as many lanes as Doubles
constexpr int64_t kFloatLanes = 16;
constexpr int64_t kDoubleLanes = 8;
constexpr int64_t kTileRows = 4;
// Query rows per task (a multiple of kTileRows): the key block is decoded once for all of them.
constexpr int64_t kRowBlock = 64;
// Integer dot products are exact in fp32 while every partial sum stays below 2^24 (|int8| <= 128).
constexpr int64_t kMaxExactDp = (1 << 24) / (128 * 128);

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

template <class Vec, class T>
HOT Vec load(const T* from) {
  Vec v;
  std::memcpy(&v, from, sizeof v);
  return v;
}

template <class Vec, class T>
HOT void store(T* to, const Vec& v) {
  std::memcpy(to, &v, sizeof v);
}

struct Problem {
  int64_t batch, hq, hkv, n_q, n_k, dp, head_dim, q_group, block_n;
  int causal;
  View<const int8_t, 4> q, k;  // integer QK types
  std::optional<Fp4Tensor> q4, k4, v4;  // NVFP4 (then q, k and v are not read)
  View<const float, 3> q_scale, k_scale, v_scale;
  std::optional<View<const float, 3>> v_mean;
  std::optional<View<const float, 4>> delta_s;
  std::optional<KvLens> kv_lens;
  std::optional<AttnMask> attn_mask;
  PvTensor v;
  OutTensor out;
  View<float, 3> lse;
  bool fp4 = q4.has_value();
  float p_scale = fp4 ? 1.0f : kPScale;  // spec.p_scale
  // Tiles compute whole vectors: up to dp_vec along d (the lanes past dp are computed, never read).
  int64_t dp_vec = round_up(dp, kDoubleLanes);
  // Scratch row strides: one vector more than needed, so that the transposing loads, which write down
  // a column, do not land in one cache set (as power-of-2 strides would).
  int64_t key_stride = round_up(block_n, kFloatLanes) + kFloatLanes;
  int64_t dp_stride = dp_vec + kDoubleLanes;
};

// One thread's scratch, reused across its tasks. Lanes past dp or cols and rows past a task's last row
// hold zeros or stale values: tiles compute on them, nothing reads the results.
struct Workspace {
  std::vector<float> q_rows;    // [kRowBlock][dp]: Q̂ rows as (exact) floats
  std::vector<float> k_t;       // [dp][key_stride]: K̂ᵀ of the key block as (exact) floats
  std::vector<float> k_scale;   // [block_n]
  std::vector<double> v_t;      // [block_n][dp_stride]: V̂ᵀ of the key block, so P̂·V̂ runs along d
  std::vector<float> s;         // [kRowBlock][key_stride]: dot products, then scores
  std::vector<double> p_hat;    // [kRowBlock][block_n]
  std::vector<float> o32;       // [kRowBlock][dp_vec]
  std::vector<float> m, l, alpha;  // [kRowBlock]
  std::vector<float> p_delta;   // [kRowBlock]: δP of the key block (fp4), else 1
  std::vector<double> q_rows4;  // fp4: [kRowBlock][dp] decoded Q̂ rows
  std::vector<double> k_t4;     // fp4: [dp][key_stride] decoded K̂ᵀ of the key block

  explicit Workspace(const Problem& pb)
      : q_rows(pb.fp4 ? 0 : kRowBlock * pb.dp), k_t(pb.fp4 ? 0 : pb.dp * pb.key_stride), k_scale(pb.block_n),
        v_t(pb.block_n * pb.dp_stride), s(kRowBlock * pb.key_stride), p_hat(kRowBlock * pb.block_n),
        o32(kRowBlock * pb.dp_vec), m(kRowBlock), l(kRowBlock), alpha(kRowBlock), p_delta(kRowBlock, 1.0f),
        q_rows4(pb.fp4 ? kRowBlock * pb.dp : 0), k_t4(pb.fp4 ? pb.dp * pb.key_stride : 0) {}
};

HOT bool key_allowed(const Problem& pb, int64_t b, int64_t i, int64_t j) {
  return sage_cpu::key_allowed(pb.kv_lens, pb.causal, pb.n_q, pb.n_k, b, i, j);
}

HOT void load_query_rows(const Problem& pb, Workspace& ws, int64_t b, int64_t h, int64_t r0, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < pb.dp; ++d) {
      if (pb.fp4) {
        ws.q_rows4[r * pb.dp + d] = (*pb.q4)(b, h, r0 + r, d);
      } else {
        ws.q_rows[r * pb.dp + d] = pb.q(b, h, r0 + r, d);
      }
    }
  }
}

HOT void load_key_block(const Problem& pb, Workspace& ws, int64_t b, int64_t hk, int64_t start, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    ws.k_scale[j] = pb.k_scale(b, hk, start + j);
    for (int64_t d = 0; d < pb.dp; ++d) {
      if (pb.fp4) {
        ws.k_t4[d * pb.key_stride + j] = (*pb.k4)(b, hk, start + j, d);
      } else {
        ws.k_t[d * pb.key_stride + j] = pb.k(b, hk, start + j, d);
      }
    }
  }
  for (int64_t d = 0; d < pb.dp; ++d) {
    for (int64_t j = 0; j < cols; ++j) {
      ws.v_t[j * pb.dp_stride + d] = pb.fp4 ? (*pb.v4)(b, hk, d, start + j) : pb.v(b, hk, d, start + j);
    }
  }
}

// Dot products of kTileRows query rows with the key block (whole vectors of keys: the lanes past cols
// are computed, never read). Every partial sum is an integer below 2^24 (kMaxExactDp), so fp32
// reproduces the spec's int32 matmul exactly, in any order.
HOT void qk_tile(const Problem& pb, Workspace& ws, int64_t r0, int64_t cols) {
  for (int64_t j0 = 0; j0 < cols; j0 += kFloatLanes) {
    Floats acc[kTileRows] = {};
    for (int64_t d = 0; d < pb.dp; ++d) {
      const Floats k = load<Floats>(&ws.k_t[d * pb.key_stride + j0]);
      for (int64_t r = 0; r < kTileRows; ++r) acc[r] += ws.q_rows[(r0 + r) * pb.dp + d] * k;
    }
    for (int64_t r = 0; r < kTileRows; ++r) store(&ws.s[(r0 + r) * pb.key_stride + j0], acc[r]);
  }
}

// NVFP4's dot products: decoded operands in double, where every product and partial sum is exact (spec.py,
// step 4'), so any order gives the spec's float64 matmul; rounded once to fp32.
HOT void qk_tile_fp4(const Problem& pb, Workspace& ws, int64_t r0, int64_t cols) {
  for (int64_t j0 = 0; j0 < cols; j0 += kDoubleLanes) {
    Doubles acc[kTileRows] = {};
    for (int64_t d = 0; d < pb.dp; ++d) {
      const Doubles k = load<Doubles>(&ws.k_t4[d * pb.key_stride + j0]);
      for (int64_t r = 0; r < kTileRows; ++r) acc[r] += ws.q_rows4[(r0 + r) * pb.dp + d] * k;
    }
    for (int64_t r = 0; r < kTileRows; ++r) {
      store(&ws.s[(r0 + r) * pb.key_stride + j0], __builtin_convertvector(acc[r], HalfFloats));
    }
  }
}

// P̂·V̂ of kTileRows rows, then o32 = o32·α + P̂·V̂·δP (δP = 1, exact, but for fp4). The product runs in
// double with j in order for every element (vectors run along d): that is the spec's float64 matmul exactly,
// since for e4m3 and fp4 every partial sum is exact (see spec.py), and so is each fp16 product, leaving only
// the order of an inexact fp16 sum, which the spec does not fix either.
HOT void pv_tile(const Problem& pb, Workspace& ws, int64_t r0, int64_t cols) {
  for (int64_t d0 = 0; d0 < pb.dp_vec; d0 += kDoubleLanes) {
    Doubles acc[kTileRows] = {};
    for (int64_t j = 0; j < cols; ++j) {
      const Doubles v = load<Doubles>(&ws.v_t[j * pb.dp_stride + d0]);
      for (int64_t r = 0; r < kTileRows; ++r) acc[r] += ws.p_hat[(r0 + r) * pb.block_n + j] * v;
    }
    for (int64_t r = 0; r < kTileRows; ++r) {
      float* o32 = &ws.o32[(r0 + r) * pb.dp_vec + d0];
      store(o32, load<HalfFloats>(o32) * ws.alpha[r0 + r] +
                     __builtin_convertvector(acc[r], HalfFloats) * ws.p_delta[r0 + r]);
    }
  }
}

// Turns row r's dot products into base-2 scores, masked to -inf; same op order as the spec:
// (dot·q_scale)·k_scale, + ΔS, attn_mask (bool: -inf where False; fp32: + mask), then causal/kv_lens.
HOT void row_scores(const Problem& pb, Workspace& ws, int64_t b, int64_t h, int64_t i, int64_t r,
                       int64_t start, int64_t cols) {
  const float qs = pb.q_scale(b, h, i);
  float* s = &ws.s[r * pb.key_stride];
  for (int64_t j = 0; j < cols; ++j) {
    float score = s[j] * qs * ws.k_scale[j];
    if (pb.delta_s) score = score + (*pb.delta_s)(b, h, i / pb.q_group, start + j);
    s[j] = score;
  }
  if (pb.attn_mask) {
    const AttnMask& mask = *pb.attn_mask;
    // Added, as SDPA adds it (a bool False is -inf): a masked key's weight is 0, its NaN score stays NaN.
    if (mask.is_bool) {
      for (int64_t j = 0; j < cols; ++j) s[j] += mask.allowed(b, h, i, start + j) ? 0.0f : -kInf;
    } else {
      for (int64_t j = 0; j < cols; ++j) s[j] += mask.bias(b, h, i, start + j);
    }
  }
  for (int64_t j = 0; j < cols; ++j) s[j] = key_allowed(pb, b, i, start + j) ? s[j] : -kInf;
}

// spec.quantize_p_fp4 on row r's P̃ (in ws.s): δP from the row's max, then 16-key blocks from the key block's
// start — s = e4m3(amax(x')/6), codes e2m1(x'·(1/s)) — decoded into p_hat.
HOT void quantize_p_fp4(const Problem& pb, Workspace& ws, int64_t r, int64_t cols) {
  const float* p = &ws.s[r * pb.key_stride];
  float row_max = p[0];
  for (int64_t j = 1; j < cols; ++j) row_max = nan_max(row_max, p[j]);
  const float delta = nvfp4_delta(row_max);
  const float inv = 1.0f / delta;
  double* p_hat = &ws.p_hat[r * pb.block_n];
  for (int64_t b0 = 0; b0 < cols; b0 += kFp4Block) {
    const int64_t end = std::min(b0 + kFp4Block, cols);
    float scaled[kFp4Block];
    float amax = 0.0f;
    for (int64_t j = b0; j < end; ++j) {
      const float x = p[j] * inv;
      scaled[j - b0] = std::isfinite(x) ? x : 0.0f;  // a NaN row (δP NaN) quantizes to 0, as in the spec
      amax = std::max(amax, std::fabs(scaled[j - b0]));
    }
    const float block_scale = round_pv(amax / kFp4Max, e4m3_format());
    const float inv_scale = block_scale > 0.0f ? 1.0f / block_scale : 0.0f;
    for (int64_t j = b0; j < end; ++j) {
      p_hat[j] = e2m1_value(round_e2m1(scaled[j - b0] * inv_scale)) * static_cast<double>(block_scale);
    }
  }
  ws.p_delta[r] = delta;
}

// The spec's online-softmax step for query row i (row r of the task), up to the P̂·V̂ product.
HOT void softmax_step(const Problem& pb, Workspace& ws, int64_t b, int64_t h, int64_t i, int64_t r,
                         int64_t start, int64_t cols) {
  row_scores(pb, ws, b, h, i, r, start, cols);
  float* s = &ws.s[r * pb.key_stride];
  float block_max = -kInf;
  for (int64_t j = 0; j < cols; ++j) block_max = nan_max(block_max, s[j]);
  const float m_new = nan_max(ws.m[r], block_max);
  const float m_safe = m_new == -kInf ? 0.0f : m_new;
  ws.alpha[r] = exp2_fp32(ws.m[r] - m_safe);
  double p_sum = 0.0;
  for (int64_t j = 0; j < cols; ++j) {
    s[j] = exp2_fp32(s[j] - m_safe);  // now P̃
    p_sum += static_cast<double>(s[j]);
  }
  if (pb.fp4) {
    quantize_p_fp4(pb, ws, r, cols);
  } else {
    double* p_hat = &ws.p_hat[r * pb.block_n];
    for (int64_t j = 0; j < cols; ++j) p_hat[j] = round_pv(s[j] * kPScale, pb.v.pv);  // apart: vectorizes
  }
  ws.l[r] = ws.l[r] * ws.alpha[r] + static_cast<float>(p_sum);
  ws.m[r] = m_new;
}

// Special values (spec.py): l += 0·δQ (NaN for a poisoned q row, else exact). A row without any valid key
// (l == 0) gets out 0, lse -inf and no v_mean; a NaN l (a poisoned q row, or a poisoned key that reaches the
// row) gives NaN out and lse. A NaN δV (a poisoned v channel) reaches that channel of every row through the product, o32·0·NaN included.
HOT void finish_row(const Problem& pb, const Workspace& ws, int64_t b, int64_t h, int64_t hk, int64_t i,
                       int64_t r) {
  const float l = ws.l[r] + pb.q_scale(b, h, i) * 0.0f;
  const bool has_keys = l != 0.0f;
  const float inv = has_keys ? 1.0f / (l * pb.p_scale) : 0.0f;
  const float* o32 = &ws.o32[r * pb.dp_vec];
  for (int64_t d = 0; d < pb.head_dim; ++d) {
    float o = o32[d] * inv * pb.v_scale(b, hk, d);
    if (pb.v_mean) o = o + (has_keys ? (*pb.v_mean)(b, hk, d) : 0.0f);
    pb.out.store(b, h, i, d, o);
  }
  const float log2_l = static_cast<float>(std::log2(static_cast<double>(l)));
  pb.lse(b, h, i) = has_keys ? (ws.m[r] + log2_l) / static_cast<float>(kLog2e) : -kInf;
}

// Clones for AVX-512 and AVX2 give the same bits as the default one: -ffp-contract=off forbids FMA,
// and the vectors only ever run across independent elements, never reassociating a sum.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void attend_rows(const Problem& pb, Workspace& ws, int64_t b, int64_t h, int64_t r0, int64_t rows) {
  const int64_t hk = h / (pb.hq / pb.hkv);
  const int64_t tile_rows = round_up(rows, kTileRows);  // rows past `rows` hold stale data, never read
  load_query_rows(pb, ws, b, h, r0, rows);
  std::fill(ws.m.begin(), ws.m.end(), -kInf);
  std::fill(ws.l.begin(), ws.l.end(), 0.0f);
  std::fill(ws.o32.begin(), ws.o32.end(), 0.0f);
  for (int64_t start = 0; start < pb.n_k; start += pb.block_n) {
    const int64_t cols = std::min(pb.block_n, pb.n_k - start);
    load_key_block(pb, ws, b, hk, start, cols);
    for (int64_t t = 0; t < tile_rows; t += kTileRows) {
      if (pb.fp4) {
        qk_tile_fp4(pb, ws, t, cols);
      } else {
        qk_tile(pb, ws, t, cols);
      }
    }
    for (int64_t r = 0; r < rows; ++r) softmax_step(pb, ws, b, h, r0 + r, r, start, cols);
    for (int64_t t = 0; t < tile_rows; t += kTileRows) pv_tile(pb, ws, t, cols);
  }
  for (int64_t r = 0; r < rows; ++r) finish_row(pb, ws, b, h, hk, r0 + r, r);
}

void run(const Problem& pb, int num_threads) {
  const int64_t row_blocks = (pb.n_q + kRowBlock - 1) / kRowBlock;
  const int64_t tasks = pb.batch * pb.hq * row_blocks;
#pragma omp parallel num_threads(num_threads)
  {
    Workspace ws(pb);
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t bh = t / row_blocks;
      const int64_t r0 = (t % row_blocks) * kRowBlock;
      attend_rows(pb, ws, bh / pb.hq, bh % pb.hq, r0, std::min(kRowBlock, pb.n_q - r0));
    }
  }
}

void check(bool ok, const std::string& what) {
  if (!ok) throw py::value_error("sage_compile._C.quantized_attention: " + what);
}

void quantized_attention(const TensorArg& q, const TensorArg& q_scale, const TensorArg& k,
                         const TensorArg& k_scale, const TensorArg& v, const TensorArg& v_scale,
                         const std::optional<TensorArg>& v_mean, const std::optional<TensorArg>& delta_s,
                         const std::optional<TensorArg>& kv_lens, const std::optional<TensorArg>& attn_mask,
                         const TensorArg& out, const TensorArg& lse,
                         const std::array<int64_t, 6>& sizes, int64_t head_dim, int64_t q_group, int64_t causal,
                         int64_t block_n, int num_threads, const std::optional<TensorArg>& q_block_scale,
                         const std::optional<TensorArg>& k_block_scale, const std::optional<TensorArg>& v_block_scale) {
  const auto [batch, hq, hkv, n_q, n_k, dp] = sizes;
  // Only what keeps this function from dividing by zero or indexing past what Python sized.
  check(batch >= 0 && n_q >= 0 && n_k >= 0 && dp >= 0, "negative size");
  check(hkv > 0 && hq % hkv == 0, "Hq must be a positive multiple of Hkv");
  check(head_dim >= 0 && head_dim <= dp, "head_dim must be in [0, Dp]");
  check(q_group > 0 && block_n > 0, "q_group and block_n must be positive");
  check(dp <= kMaxExactDp, "Dp > 1024: fp32 dot products would no longer be exact");
  check(causal >= 0 && causal <= 2, "causal must be 0, 1 or 2");
  check(num_threads > 0, "num_threads must be positive");
  const bool fp4 = q_block_scale.has_value();
  check(fp4 == k_block_scale.has_value() && fp4 == v_block_scale.has_value(),
        "q_block_scale, k_block_scale and v_block_scale come together (NVFP4) or not at all");
  check(!fp4 || (dp % kFp4Block == 0 && block_n % kFp4Block == 0),
        "NVFP4 needs Dp and block_n multiples of 16");
  const Problem pb{
      batch, hq, hkv, n_q, n_k, dp, head_dim, q_group, block_n, static_cast<int>(causal),
      fp4 ? View<const int8_t, 4>{} : view<const int8_t, 4>(q, "q", "int8"),
      fp4 ? View<const int8_t, 4>{} : view<const int8_t, 4>(k, "k", "int8"),
      fp4_tensor(q, q_block_scale, "q", "q_block_scale"), fp4_tensor(k, k_block_scale, "k", "k_block_scale"),
      fp4_tensor(v, v_block_scale, "v", "v_block_scale"),
      view<const float, 3>(q_scale, "q_scale", "float32"), view<const float, 3>(k_scale, "k_scale", "float32"),
      view<const float, 3>(v_scale, "v_scale", "float32"),
      optional_view<const float, 3>(v_mean, "v_mean", "float32"),
      optional_view<const float, 4>(delta_s, "delta_s", "float32"), kv_lens_view(kv_lens),
      attn_mask_view(attn_mask),
      fp4 ? PvTensor{nullptr, {}, e4m3_format()}
          : PvTensor{reinterpret_cast<const uint8_t*>(std::get<0>(v)), checked_strides<4>(v, "v"),
                     pv_format(std::get<1>(v))},
      out_tensor(out), view<float, 3>(lse, "lse", "float32")};
  py::gil_scoped_release no_gil;
  run(pb, num_threads);
}

// Test hooks: the kernel's own conversions on n contiguous elements, to compare with torch's casts.
// round_pv: float32 → float32 as spec.quantize_pv_operand rounds to `pv_dtype`.
void round_pv_hook(uintptr_t src, uintptr_t dst, int64_t n, const std::string& pv_dtype) {
  const PvFormat pv = pv_format(pv_dtype);
  const auto* from = reinterpret_cast<const float*>(src);
  auto* to = reinterpret_cast<float*>(dst);
  for (int64_t e = 0; e < n; ++e) to[e] = round_pv(from[e], pv);
}

// round_e2m1: float32 → uint8 E2M1 codes, as spec.round_e2m1.
void round_e2m1_hook(uintptr_t src, uintptr_t dst, int64_t n) {
  const auto* from = reinterpret_cast<const float*>(src);
  auto* to = reinterpret_cast<uint8_t*>(dst);
  for (int64_t e = 0; e < n; ++e) to[e] = static_cast<uint8_t>(round_e2m1(from[e]));
}

// cast: float32 → bfloat16 / float16 codes (outputs), or float8_e4m3fn / float16 codes → float32 (V̂).
void cast_hook(uintptr_t src, const std::string& src_dtype, uintptr_t dst, const std::string& dst_dtype,
               int64_t n) {
  if (src_dtype == "float32" && (dst_dtype == "bfloat16" || dst_dtype == "float16")) {
    const OutFormat& fmt = dst_dtype == "bfloat16" ? kBF16Out : kF16Out;
    const auto* from = reinterpret_cast<const float*>(src);
    auto* to = reinterpret_cast<uint16_t*>(dst);
    for (int64_t e = 0; e < n; ++e) to[e] = encode(from[e], fmt);
    return;
  }
  if (dst_dtype == "float32") {
    const PvFormat pv = pv_format(src_dtype);
    const auto* from = reinterpret_cast<const uint8_t*>(src);
    auto* to = reinterpret_cast<float*>(dst);
    for (int64_t e = 0; e < n; ++e) {
      uint16_t code = 0;
      std::memcpy(&code, from + pv.bytes * e, pv.bytes);  // little endian: the low bytes
      to[e] = pv.table[code];
    }
    return;
  }
  throw py::type_error("_cast: unsupported conversion " + src_dtype + " -> " + dst_dtype);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Exact C++ CPU reference kernels of sage.quantized_attention and sage.attention_backward (see "
            "sage_compile/numerics/spec.py).";
  m.def("quantized_attention", &quantized_attention,
        "Writes out [B,Hq,Nq,head_dim] and lse [B,Hq,Nq] through their strides. Each tensor is "
        "(data_ptr, dtype name, element strides); sizes = (B, Hq, Hkv, Nq, Nk, Dp). attn_mask (bool or "
        "fp32) is indexed [b, h, i, j]: broadcast dimensions must come with stride 0. With the three E4M3 "
        "block scales q, k and v are NVFP4 (uint8, two E2M1 codes per byte). Runs on num_threads "
        "OpenMP threads without the GIL.",
        py::kw_only(), py::arg("q"), py::arg("q_scale"), py::arg("k"), py::arg("k_scale"), py::arg("v"),
        py::arg("v_scale"), py::arg("v_mean"), py::arg("delta_s"), py::arg("kv_lens"), py::arg("attn_mask"),
        py::arg("out"), py::arg("lse"), py::arg("sizes"), py::arg("head_dim"), py::arg("q_group"),
        py::arg("causal"), py::arg("block_n"), py::arg("num_threads"), py::arg("q_block_scale") = py::none(),
        py::arg("k_block_scale") = py::none(), py::arg("v_block_scale") = py::none());
  m.def("_round_e2m1", &round_e2m1_hook, "Test hook: E2M1 rounding (spec.round_e2m1), fp32 → uint8 codes.",
        py::arg("src"), py::arg("dst"), py::arg("n"));
  m.def("_round_pv", &round_pv_hook, "Test hook: P̂ rounding (clamp to ±448, round to pv_dtype), fp32 → fp32.",
        py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("pv_dtype"));
  m.def("_cast", &cast_hook, "Test hook: fp32 → bf16/fp16 codes (outputs), e4m3fn/fp16 codes → fp32 (V̂).",
        py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"));
  sage_cpu::def_backward(m);
}

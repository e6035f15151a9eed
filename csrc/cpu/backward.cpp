// Exact CPU kernel for sage.attention_backward: spec.py::attention_backward_reference (the 8-bit backward) tile by
// tile, in O(N·D) memory where the spec holds every N×N score at once. Same fp32 operations in the same order for
// S, P, dP, dS and the three INT8 quantizations, so every code and scale is the spec's; the products' integer sums
// are exact, and each scaled partial is rounded once in double, as the spec's double matmuls round it. What may
// differ is the order of the double sums over row tiles and GQA heads (dK, dV): a last-bit difference after the
// rounding to fp32, at most.
//
// Clones for AVX-512 and AVX2 give the same bits as the default one: -ffp-contract=off forbids FMA, and the vectors
// run across independent scores and channels, never reassociating a sum.
//
// Two passes, each recomputing its tiles' S, P, dP and dS (as FlashAttention's backward recomputes them):
// dK and dV per (batch, kv head, key tile), over every query head of its group and every row tile; dQ per
// (batch, query head, row tile), over every key tile in order.
#include "common.h"

namespace sage_cpu {
namespace {

constexpr int64_t kBlock = 64;  // spec.BWD_BLOCK: the tile edge, the INT8 scale groups
constexpr float kGradLevels = 127.0f;  // spec.GRAD_LEVELS

// 16-bit (bf16 or fp16) operands: grad_out and v, [b, h, n, d] through their strides.
struct Half16Tensor {
  const uint16_t* data;
  std::array<int64_t, 4> strides;
  const float* f16;  // fp16 decode table, or nullptr for bf16

  HOT float operator()(int64_t b, int64_t h, int64_t n, int64_t d) const {
    const uint16_t code = data[b * strides[0] + h * strides[1] + n * strides[2] + d * strides[3]];
    return f16 ? f16[code] : bits_float(static_cast<uint32_t>(code) << 16);
  }
};

Half16Tensor half16_tensor(const TensorArg& arg, const char* name) {
  const std::string& dtype = std::get<1>(arg);
  if (dtype != "bfloat16" && dtype != "float16") {
    throw py::type_error(std::string(name) + ": dtype " + dtype + " is not bfloat16 or float16");
  }
  return {reinterpret_cast<const uint16_t*>(std::get<0>(arg)), checked_strides<4>(arg, name),
          dtype == "float16" ? f16_table().data() : nullptr};
}

struct BackwardProblem {
  int64_t batch, hq, hkv, n_q, n_k, dp, head_dim;
  int causal;
  double scale;
  Half16Tensor grad_out, v;
  View<const int8_t, 4> do8, q, k, kc;
  View<const float, 4> do_scale, kc_scale;  // [B, H, tile, Dp]
  View<const float, 3> delta, q_scale, k_scale, lse;
  std::optional<KvLens> kv_lens;
  std::optional<AttnMask> attn_mask;
  View<float, 4> dq, dk, dv;
  int64_t group = hq / hkv;
};

// One thread's tile: rows i0.. of one query head against keys j0.. (P and dS are 0 past the tile's rows and keys).
// K̂ and V are held transposed (zero past the tile's keys), so that the dot products run along the keys: each
// score's own sum keeps its order (over the channels), and the vector lanes run across independent scores.
struct Tile {
  std::vector<int32_t> q, k_t;  // [kBlock][dp] Q̂ rows; [dp][kBlock] K̂ᵀ
  std::vector<double> go, v_t;  // [kBlock][head_dim] dO rows; [head_dim][kBlock] Vᵀ (16-bit values, exact)
  std::vector<float> p, ds;     // [kBlock rows][kBlock keys]
  std::vector<int32_t> b8;      // [kBlock][dp] the B operand of a product: dÔ or K̂ᶜ rows
  std::vector<int32_t> sum, sum2;  // [dp] one output row's integer sums (|sum| ≤ 64·127² < 2³¹)

  explicit Tile(const BackwardProblem& pb)
      : q(kBlock * pb.dp), k_t(pb.dp * kBlock), go(kBlock * pb.head_dim), v_t(pb.head_dim * kBlock),
        p(kBlock * kBlock), ds(kBlock * kBlock), b8(kBlock * pb.dp), sum(pb.dp), sum2(pb.dp) {}
};

// Rows n0 .. n0 + rows of x[b, h] (int8, any strides) into `to` [rows][dp] as int32.
HOT void load_int8_rows(const View<const int8_t, 4>& x, int64_t b, int64_t h, int64_t n0, int64_t rows, int64_t dp,
                        int32_t* to) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < dp; ++d) to[r * dp + d] = x(b, h, n0 + r, d);
  }
}

// spec.symmetric_delta(amax, 127): fma_friendly(max(amax/127, tiny)), NaN where amax is not finite.
HOT float grad_delta(float amax) {
  if (!std::isfinite(amax)) return kNaN;
  const float delta = std::max(amax / kGradLevels, std::numeric_limits<float>::min());
  return bits_float((float_bits(delta) + 3) & ~3u);
}

// spec.quantize_symmetric's code of x for a group of step delta: round half to even of x·(1/δ), clamped; 0 where
// δ is NaN (a group holding a NaN or an infinity).
HOT int32_t grad_code(float x, float delta) {
  if (!std::isfinite(delta)) return 0;
  const float y = std::nearbyint(x * (1.0f / delta));
  return static_cast<int32_t>(std::min(std::max(y, -kGradLevels), kGradLevels));
}

// Q̂ and dO rows i0 .. i0 + rows of head h into the tile.
HOT void load_rows(const BackwardProblem& pb, Tile& t, int64_t b, int64_t h, int64_t i0, int64_t rows) {
  load_int8_rows(pb.q, b, h, i0, rows, pb.dp, t.q.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < pb.head_dim; ++d) t.go[r * pb.head_dim + d] = pb.grad_out(b, h, i0 + r, d);
  }
}

// K̂ᵀ and Vᵀ of keys j0 .. j0 + cols of kv head hk into the tile, zero past them.
HOT void load_keys(const BackwardProblem& pb, Tile& t, int64_t b, int64_t hk, int64_t j0, int64_t cols) {
  std::fill(t.k_t.begin(), t.k_t.end(), 0);
  std::fill(t.v_t.begin(), t.v_t.end(), 0.0);
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t d = 0; d < pb.dp; ++d) t.k_t[d * kBlock + c] = pb.k(b, hk, j0 + c, d);
    for (int64_t d = 0; d < pb.head_dim; ++d) t.v_t[d * kBlock + c] = pb.v(b, hk, j0 + c, d);
  }
}

// S, P, dP and dS of the tile (rows i0 + r < i0 + rows of head h, keys j0 + c < j0 + cols), as the spec computes
// them: S = (Q̂K̂ᵀ·δQ)·δK, the mask added, causal / kv_lens keys −∞; P = exp2(S − lse·log2 e), 0 for a row with no
// key; dP = dO·Vᵀ summed in double, rounded to fp32; dS = P∘(dP − D). The rows (load_rows) and keys (load_keys)
// are in the tile already: each pass loads its fixed side once.
HOT void compute_tile(const BackwardProblem& pb, Tile& t, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                      int64_t cols) {
  const int64_t hk = h / pb.group;
  std::fill(t.p.begin(), t.p.end(), 0.0f);
  std::fill(t.ds.begin(), t.ds.end(), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    int32_t dot[kBlock] = {};  // |dot| ≤ 127²·Dp < 2²⁴: exact in fp32 too
    double dp_sum[kBlock] = {};
    for (int64_t d = 0; d < pb.dp; ++d) {
      const int32_t x = t.q[r * pb.dp + d];
      for (int64_t c = 0; c < kBlock; ++c) dot[c] += x * t.k_t[d * kBlock + c];
    }
    for (int64_t d = 0; d < pb.head_dim; ++d) {
      const double g = t.go[r * pb.head_dim + d];
      for (int64_t c = 0; c < kBlock; ++c) dp_sum[c] += g * t.v_t[d * kBlock + c];
    }
    const float qs = pb.q_scale(b, h, i);
    const float l2 = pb.lse(b, h, i) * static_cast<float>(kLog2e);
    const float delta = pb.delta(b, h, i);
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t j = j0 + c;
      float s = static_cast<float>(dot[c]) * qs * pb.k_scale(b, hk, j);
      if (pb.attn_mask) {
        const AttnMask& mask = *pb.attn_mask;
        s += mask.is_bool ? (mask.allowed(b, h, i, j) ? 0.0f : -kInf) : mask.bias(b, h, i, j);
      }
      if (!key_allowed(pb.kv_lens, pb.causal, pb.n_q, pb.n_k, b, i, j)) s = -kInf;
      const float p = l2 == -kInf ? 0.0f : exp2_fp32(s - l2);
      t.p[r * kBlock + c] = p;
      t.ds[r * kBlock + c] = p * (static_cast<float>(dp_sum[c]) - delta);
    }
  }
}

// dV and dK of one key tile of one kv head: Σ over its group's heads and every row tile of
// δP_j·δdO·(P̂ᵀ dÔ) and δH_j·(Ĥᵀ Q̂), H = dS·δQ, P̂ and Ĥ INT8 per key over the tile's rows; dK / log2 e per head.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void key_tile(const BackwardProblem& pb, Tile& t, std::vector<double>& dk, std::vector<double>& dv,
              std::vector<double>& dk_head, std::vector<double>& dv_head, int64_t b, int64_t hk, int64_t j0) {
  const int64_t cols = std::min(kBlock, pb.n_k - j0);
  const int64_t dp = pb.dp;
  std::fill(dk.begin(), dk.end(), 0.0);
  std::fill(dv.begin(), dv.end(), 0.0);
  load_keys(pb, t, b, hk, j0, cols);
  for (int64_t h = hk * pb.group; h < (hk + 1) * pb.group; ++h) {
    std::fill(dk_head.begin(), dk_head.end(), 0.0);
    std::fill(dv_head.begin(), dv_head.end(), 0.0);
    for (int64_t i0 = 0; i0 < pb.n_q; i0 += kBlock) {
      const int64_t rows = std::min(kBlock, pb.n_q - i0);
      load_rows(pb, t, b, h, i0, rows);
      compute_tile(pb, t, b, h, i0, rows, j0, cols);
      const int64_t tile = i0 / kBlock;
      load_int8_rows(pb.do8, b, h, i0, rows, dp, t.b8.data());
      for (int64_t c = 0; c < cols; ++c) {
        float p_amax = 0.0f, h_amax = 0.0f;  // the spec's padded rows are 0: they count in the amax
        float hv[kBlock];
        for (int64_t r = 0; r < rows; ++r) {
          hv[r] = t.ds[r * kBlock + c] * pb.q_scale(b, h, i0 + r);
          p_amax = nan_max(p_amax, t.p[r * kBlock + c]);
          h_amax = nan_max(h_amax, std::fabs(hv[r]));
        }
        const float p_delta = grad_delta(p_amax), h_delta = grad_delta(h_amax);
        std::fill(t.sum.begin(), t.sum.end(), 0);
        std::fill(t.sum2.begin(), t.sum2.end(), 0);
        for (int64_t r = 0; r < rows; ++r) {
          const int32_t p8 = grad_code(t.p[r * kBlock + c], p_delta), h8 = grad_code(hv[r], h_delta);
          for (int64_t d = 0; d < dp; ++d) {
            t.sum[d] += p8 * t.b8[r * dp + d];
            t.sum2[d] += h8 * t.q[r * dp + d];
          }
        }
        for (int64_t d = 0; d < dp; ++d) {
          // Each partial exact (integer × δdO), then rounded once by its scale, as the spec's double matmul.
          dv_head[c * dp + d] += static_cast<double>(t.sum[d]) * pb.do_scale(b, h, tile, d) * p_delta;
          dk_head[c * dp + d] += static_cast<double>(t.sum2[d]) * h_delta;
        }
      }
    }
    for (int64_t e = 0; e < cols * dp; ++e) {
      dk[e] += dk_head[e] / kLog2e;
      dv[e] += dv_head[e];
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t d = 0; d < pb.head_dim; ++d) {
      pb.dk(b, hk, j0 + c, d) = static_cast<float>(dk[c * dp + d]);
      pb.dv(b, hk, j0 + c, d) = static_cast<float>(dv[c * dp + d]);
    }
  }
}

// dQ of one row tile of one query head: Σ over the key tiles, in order, of δdS_i·(dŜ K̂ᶜ_j)·δKᶜ_j, dŜ INT8 per row
// over the tile's keys; then ·scale.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void row_tile(const BackwardProblem& pb, Tile& t, std::vector<double>& dq, int64_t b, int64_t h, int64_t i0) {
  const int64_t rows = std::min(kBlock, pb.n_q - i0);
  const int64_t hk = h / pb.group, dp = pb.dp;
  std::fill(dq.begin(), dq.end(), 0.0);
  load_rows(pb, t, b, h, i0, rows);
  for (int64_t j0 = 0; j0 < pb.n_k; j0 += kBlock) {
    const int64_t cols = std::min(kBlock, pb.n_k - j0);
    load_keys(pb, t, b, hk, j0, cols);
    compute_tile(pb, t, b, h, i0, rows, j0, cols);
    const int64_t tile = j0 / kBlock;
    load_int8_rows(pb.kc, b, hk, j0, cols, dp, t.b8.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float* ds = &t.ds[r * kBlock];
      float amax = std::fabs(ds[0]);
      for (int64_t c = 1; c < cols; ++c) amax = nan_max(amax, std::fabs(ds[c]));
      const float g_delta = grad_delta(amax);
      std::fill(t.sum.begin(), t.sum.end(), 0);
      for (int64_t c = 0; c < cols; ++c) {
        const int32_t g8 = grad_code(ds[c], g_delta);
        for (int64_t d = 0; d < dp; ++d) t.sum[d] += g8 * t.b8[c * dp + d];
      }
      for (int64_t d = 0; d < dp; ++d) {
        dq[r * dp + d] += static_cast<double>(t.sum[d]) * g_delta * pb.kc_scale(b, hk, tile, d);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < pb.head_dim; ++d) pb.dq(b, h, i0 + r, d) = static_cast<float>(dq[r * dp + d] * pb.scale);
  }
}

void run_backward(const BackwardProblem& pb, int num_threads) {
  const int64_t key_tiles = (pb.n_k + kBlock - 1) / kBlock, row_tiles = (pb.n_q + kBlock - 1) / kBlock;
  const int64_t kv_tasks = pb.batch * pb.hkv * key_tiles, q_tasks = pb.batch * pb.hq * row_tiles;
#pragma omp parallel num_threads(num_threads)
  {
    Tile t(pb);
    std::vector<double> acc(kBlock * pb.dp), acc2(kBlock * pb.dp), head(kBlock * pb.dp), head2(kBlock * pb.dp);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < kv_tasks; ++task) {
      const int64_t bh = task / key_tiles;
      key_tile(pb, t, acc, acc2, head, head2, bh / pb.hkv, bh % pb.hkv, (task % key_tiles) * kBlock);
    }
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < q_tasks; ++task) {
      const int64_t bh = task / row_tiles;
      row_tile(pb, t, acc, bh / pb.hq, bh % pb.hq, (task % row_tiles) * kBlock);
    }
  }
}

void check(bool ok, const std::string& what) {
  if (!ok) throw py::value_error("sage_compile._C.attention_backward: " + what);
}

void attention_backward(const TensorArg& grad_out, const TensorArg& do8, const TensorArg& do_scale,
                        const TensorArg& delta, const TensorArg& q, const TensorArg& q_scale, const TensorArg& k,
                        const TensorArg& k_scale, const TensorArg& kc, const TensorArg& kc_scale, const TensorArg& v,
                        const TensorArg& lse, const std::optional<TensorArg>& kv_lens,
                        const std::optional<TensorArg>& attn_mask, const TensorArg& dq, const TensorArg& dk,
                        const TensorArg& dv, const std::array<int64_t, 6>& sizes, int64_t head_dim, int64_t causal,
                        double scale, int num_threads) {
  const auto [batch, hq, hkv, n_q, n_k, dp] = sizes;
  // Only what keeps this function from dividing by zero or indexing past what Python sized.
  check(batch >= 0 && n_q >= 0 && n_k >= 0 && dp >= 0, "negative size");
  check(hkv > 0 && hq % hkv == 0, "Hq must be a positive multiple of Hkv");
  check(head_dim >= 0 && head_dim <= dp, "head_dim must be in [0, Dp]");
  check(dp <= (1 << 24) / (128 * 128), "Dp > 1024: the fp32 dot products would no longer be exact");
  check(causal >= 0 && causal <= 2, "causal must be 0, 1 or 2");
  check(num_threads > 0, "num_threads must be positive");
  const BackwardProblem pb{
      batch, hq, hkv, n_q, n_k, dp, head_dim, static_cast<int>(causal), scale,
      half16_tensor(grad_out, "grad_out"), half16_tensor(v, "v"),
      view<const int8_t, 4>(do8, "do8", "int8"), view<const int8_t, 4>(q, "q", "int8"),
      view<const int8_t, 4>(k, "k", "int8"), view<const int8_t, 4>(kc, "kc", "int8"),
      view<const float, 4>(do_scale, "do_scale", "float32"), view<const float, 4>(kc_scale, "kc_scale", "float32"),
      view<const float, 3>(delta, "delta", "float32"), view<const float, 3>(q_scale, "q_scale", "float32"),
      view<const float, 3>(k_scale, "k_scale", "float32"), view<const float, 3>(lse, "lse", "float32"),
      kv_lens_view(kv_lens), attn_mask_view(attn_mask),
      view<float, 4>(dq, "dq", "float32"), view<float, 4>(dk, "dk", "float32"), view<float, 4>(dv, "dv", "float32")};
  py::gil_scoped_release no_gil;
  run_backward(pb, num_threads);
}

}  // namespace

void def_backward(py::module_& m) {
  m.def("attention_backward", &attention_backward,
        "Writes dq [B,Hq,Nq,head_dim], dk and dv [B,Hkv,Nk,head_dim] (fp32) through their strides: "
        "spec.attention_backward_reference. Each tensor is (data_ptr, dtype name, element strides); sizes = "
        "(B, Hq, Hkv, Nq, Nk, Dp). attn_mask (bool or fp32, kernel form) is indexed [b, h, i, j]: broadcast "
        "dimensions must come with stride 0. Runs on num_threads OpenMP threads without the GIL.",
        py::kw_only(), py::arg("grad_out"), py::arg("do8"), py::arg("do_scale"), py::arg("delta"), py::arg("q"),
        py::arg("q_scale"), py::arg("k"), py::arg("k_scale"), py::arg("kc"), py::arg("kc_scale"), py::arg("v"),
        py::arg("lse"), py::arg("kv_lens"), py::arg("attn_mask"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("sizes"), py::arg("head_dim"), py::arg("causal"), py::arg("scale"), py::arg("num_threads"));
}

}  // namespace sage_cpu

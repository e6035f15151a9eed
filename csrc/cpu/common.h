// What the C++ CPU kernels share (reference.cpp: the forward, backward.cpp: the backward): tensors as raw pointers
// with element strides, the masks and key rules, and the few floating-point helpers whose rounding the spec fixes.
// Not linked against libtorch (no ABI coupling): every tensor arrives from Python as (data_ptr, dtype name,
// element strides); sizes come separately.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace sage_cpu {

namespace py = pybind11;

// For everything a kernel calls per element: inlined into its target-cloned loops, each clone compiles it for its
// own instruction set (an outlined copy would be the baseline x86-64 one).
#define HOT [[gnu::always_inline]] inline

constexpr double kLog2e = 1.4426950408889634;  // spec.LOG2E, as the Python float
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// fp32 ↔ its bits.
HOT uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

HOT float bits_float(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// fp16 codes decoded through a table (the forward's V̂ with fp16 PV; the backward's v and dO in fp16).
inline float f16_value(uint32_t code) {
  const float sign = (code & 0x8000) ? -1.0f : 1.0f;
  const int exp = (code >> 10) & 0x1F;
  const int mant = code & 0x3FF;
  if (exp == 0x1F) return mant ? kNaN : sign * kInf;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -24);
  return sign * std::ldexp(static_cast<float>(1024 + mant), exp - 25);
}

// Decoding V is per element of every key block, hence tables (fp16's is 256 KiB, built once).
template <int N>
std::vector<float> decode_table(float (*value)(uint32_t)) {
  std::vector<float> table(N);
  for (uint32_t code = 0; code < N; ++code) table[code] = value(code);
  return table;
}

inline const std::vector<float>& f16_table() {
  static const std::vector<float> table = decode_table<65536>(f16_value);
  return table;
}

// ------------------------------------------------------------------------------------------------
// Tensor views over raw pointers.
// ------------------------------------------------------------------------------------------------
using TensorArg = std::tuple<uintptr_t, std::string, std::vector<int64_t>>;

template <class T, size_t N>
struct View {
  T* data = nullptr;
  std::array<int64_t, N> strides{};

  template <class... I>
  HOT T& operator()(I... idx) const {
    static_assert(sizeof...(I) == N, "one index per dimension");
    const std::array<int64_t, N> at{static_cast<int64_t>(idx)...};
    int64_t offset = 0;
    for (size_t d = 0; d < N; ++d) offset += at[d] * strides[d];
    return data[offset];
  }
};

template <size_t N>
std::array<int64_t, N> checked_strides(const TensorArg& arg, const char* name) {
  const auto& strides = std::get<2>(arg);
  if (strides.size() != N) {
    throw py::value_error(std::string(name) + ": expected " + std::to_string(N) + " strides, got " +
                          std::to_string(strides.size()));
  }
  std::array<int64_t, N> out{};
  std::copy(strides.begin(), strides.end(), out.begin());
  return out;
}

template <class T, size_t N>
View<T, N> view(const TensorArg& arg, const char* name, const char* dtype) {
  if (std::get<1>(arg) != dtype) {
    throw py::type_error(std::string(name) + ": dtype " + std::get<1>(arg) + ", expected " + dtype);
  }
  return {reinterpret_cast<T*>(std::get<0>(arg)), checked_strides<N>(arg, name)};
}

template <class T, size_t N>
std::optional<View<T, N>> optional_view(const std::optional<TensorArg>& arg, const char* name,
                                        const char* dtype) {
  if (!arg) return std::nullopt;
  return view<T, N>(*arg, name, dtype);
}

struct KvLens {
  const uint8_t* data;
  int64_t stride;
  bool is_int64;

  HOT int64_t operator()(int64_t b) const {
    if (is_int64) {
      int64_t n;
      std::memcpy(&n, data + 8 * b * stride, sizeof n);
      return n;
    }
    int32_t n;
    std::memcpy(&n, data + 4 * b * stride, sizeof n);
    return n;
  }
};

inline std::optional<KvLens> kv_lens_view(const std::optional<TensorArg>& arg) {
  if (!arg) return std::nullopt;
  const std::string& dtype = std::get<1>(*arg);
  if (dtype != "int32" && dtype != "int64") {
    throw py::type_error("kv_lens: dtype " + dtype + " is not int32 or int64");
  }
  return KvLens{reinterpret_cast<const uint8_t*>(std::get<0>(*arg)), checked_strides<1>(*arg, "kv_lens")[0],
                dtype == "int64"};
}

// attn_mask [B|1, Hq|1, Nq|1, Nk]: bool (nonzero byte = attend) or fp32 added to S. Python passes stride 0
// for its broadcast (size-1) dimensions, so it is indexed with the score's own (b, h, i, j).
struct AttnMask {
  const uint8_t* data;
  std::array<int64_t, 4> strides;
  bool is_bool;

  HOT int64_t offset(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return b * strides[0] + h * strides[1] + i * strides[2] + j * strides[3];
  }
  HOT bool allowed(int64_t b, int64_t h, int64_t i, int64_t j) const { return data[offset(b, h, i, j)] != 0; }
  HOT float bias(int64_t b, int64_t h, int64_t i, int64_t j) const {
    float x;
    std::memcpy(&x, data + 4 * offset(b, h, i, j), sizeof x);
    return x;
  }
};

inline std::optional<AttnMask> attn_mask_view(const std::optional<TensorArg>& arg) {
  if (!arg) return std::nullopt;
  const std::string& dtype = std::get<1>(*arg);
  if (dtype != "bool" && dtype != "float32") {
    throw py::type_error("attn_mask: dtype " + dtype + " is not bool or float32");
  }
  return AttnMask{reinterpret_cast<const uint8_t*>(std::get<0>(*arg)), checked_strides<4>(*arg, "attn_mask"),
                  dtype == "bool"};
}

// torch.maximum and amax propagate NaN; std::max would drop it depending on argument order.
HOT float nan_max(float a, float b) { return (std::isnan(a) || std::isnan(b)) ? kNaN : std::max(a, b); }

// spec.exp2_fp32: exp2 in double, one rounding to float. exp2(-inf) = 0 needs no call (masked keys).
HOT float exp2_fp32(float x) {
  return x == -kInf ? 0.0f : static_cast<float>(std::exp2(static_cast<double>(x)));
}

// Whether key j is visible to query row i of batch b: kv_lens, then causal (1: top-left, 2: bottom-right aligned).
HOT bool key_allowed(const std::optional<KvLens>& kv_lens, int causal, int64_t n_q, int64_t n_k, int64_t b,
                     int64_t i, int64_t j) {
  if (kv_lens && j >= (*kv_lens)(b)) return false;
  if (causal == 0) return true;
  const int64_t offset = causal == 1 ? 0 : n_k - n_q;
  return j <= i + offset;
}

// Defines backward.cpp's functions on the module (reference.cpp's PYBIND11_MODULE calls it).
void def_backward(py::module_& m);

}  // namespace sage_cpu

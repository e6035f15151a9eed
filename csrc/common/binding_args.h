// What the kernels' pybind11 bindings read from Python: raw pointers as integers (None: null) and element strides
// by tensor name (absent or None: zeros). Shared by csrc/sm90 and csrc/sm89.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace sage_binding {

template <typename T>
T* pointer(const pybind11::object& value) {
  if (value.is_none()) return nullptr;
  return reinterpret_cast<T*>(value.cast<uintptr_t>());
}

// st[name]: that tensor's element strides, at least ``count`` of them.
inline std::vector<int64_t> strides(const pybind11::dict& st, const char* name, size_t count) {
  if (!st.contains(name) || pybind11::object(st[name]).is_none()) return std::vector<int64_t>(count, 0);
  auto s = pybind11::object(st[name]).cast<std::vector<int64_t>>();
  if (s.size() < count) throw std::invalid_argument(std::string("stride tuple too short: ") + name);
  return s;
}

}  // namespace sage_binding

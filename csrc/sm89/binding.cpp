// Python binding of the sm89 kernel: raw pointers, element strides and the stream as integers (no libtorch). The
// Python side (sage_compile/kernels/sm89.py) checks dtypes, shapes, devices, strides and alignment before calling.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding_args.h"
#include "params.h"

namespace py = pybind11;
using sage_sm89::Params;

namespace {

using sage_binding::pointer;
using sage_binding::strides;

void attention(const py::dict& ptr, const py::dict& st, const py::dict& size, int head_dim_padded, int out_dtype,
               bool pv16, int64_t stream) {
  Params p{};
  p.q = pointer<const uint8_t>(ptr["q"]);
  p.q_scale = pointer<const float>(ptr["q_scale"]);
  p.k = pointer<const uint8_t>(ptr["k"]);
  p.k_scale = pointer<const float>(ptr["k_scale"]);
  p.v = pointer<const uint8_t>(ptr["v"]);
  p.v_scale = pointer<const float>(ptr["v_scale"]);
  p.v_mean = pointer<const float>(ptr["v_mean"]);
  p.delta_s = pointer<const float>(ptr["delta_s"]);
  p.kv_lens = pointer<const void>(ptr["kv_lens"]);
  p.out = pointer<void>(ptr["out"]);
  p.lse = pointer<float>(ptr["lse"]);
  auto sq = strides(st, "q", 3), sqs = strides(st, "q_scale", 2), sk = strides(st, "k", 3);
  auto sks = strides(st, "k_scale", 2), sv = strides(st, "v", 3), svs = strides(st, "v_scale", 2);
  auto svm = strides(st, "v_mean", 2), sds = strides(st, "delta_s", 3), so = strides(st, "out", 4);
  auto sl = strides(st, "lse", 2);
  p.q_sb = sq[0], p.q_sh = sq[1], p.q_sn = sq[2];
  p.qs_sb = sqs[0], p.qs_sh = sqs[1];
  p.k_sb = sk[0], p.k_sh = sk[1], p.k_sn = sk[2];
  p.ks_sb = sks[0], p.ks_sh = sks[1];
  p.v_sb = sv[0], p.v_sh = sv[1], p.v_sd = sv[2];
  p.vs_sb = svs[0], p.vs_sh = svs[1];
  p.vm_sb = svm[0], p.vm_sh = svm[1];
  p.ds_sb = sds[0], p.ds_sh = sds[1], p.ds_sg = sds[2];
  p.o_sb = so[0], p.o_sh = so[1], p.o_sn = so[2], p.o_sd = so[3];
  p.l_sb = sl[0], p.l_sh = sl[1];
  auto get = [&](const char* name) { return size[name].cast<int>(); };
  p.batch = get("batch"), p.hq = get("hq"), p.gqa = get("gqa"), p.nq = get("nq"), p.nk = get("nk");
  p.nkp = get("nkp"), p.head_dim = get("head_dim"), p.q_group = get("q_group");
  p.causal = get("causal"), p.causal_offset = get("causal_offset");
  p.kv_lens_int64 = size["kv_lens_int64"].cast<bool>();
  const int err = sage_sm89::launch(p, head_dim_padded, out_dtype, pv16, reinterpret_cast<void*>(stream));
  if (err != 0) throw std::runtime_error("sm89 kernel launch failed: CUDA error " + std::to_string(err));
}

}  // namespace

PYBIND11_MODULE(_sm89, m) {
  m.doc() = "INT4 QK attention on mma.sync, e4m3 or fp16 PV (sm80/86/89; runs emulated on sm90)";
  m.attr("BLOCK_M") = 64;
  m.attr("BLOCK_N") = 64;
  m.attr("HEAD_DIMS") = std::vector<int>(std::begin(sage_sm89::kHeadDims), std::end(sage_sm89::kHeadDims));
  m.def("attention", &attention, py::arg("ptr"), py::arg("strides"), py::arg("sizes"), py::arg("head_dim_padded"),
        py::arg("out_dtype"), py::arg("pv16"), py::arg("stream"));
}

// Python binding of the sm90 kernel: raw pointers, element strides and the stream as integers (no
// libtorch: the module builds in seconds and links only the CUDA runtime). The Python side
// (sage_compile/kernels/sm90.py) checks dtypes, shapes, devices and alignment before calling.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "binding_args.h"
#include "params.h"

namespace py = pybind11;
using sage_sm90::Params;

namespace {

using sage_binding::pointer;

void attention(py::int_ q, py::object q_scale, py::int_ k, py::object k_scale, py::int_ v, py::object v_scale,
               py::object v_mean, py::object kv_lens, py::int_ out, py::int_ lse, py::dict st,
               std::tuple<int, int, int, int, int, int, int, int> sizes, int causal, int causal_offset,
               bool kv_lens_int64, int out_dtype, int64_t stream, int ctas_per_sm, bool k_thread_groups,
               py::object delta_s, int q_group, py::object mask, bool mask_bool, bool pv16, py::object cu_q,
               py::object cu_k, py::object key_first, py::object cu_blk, int n_seq) {
  Params p{};
  p.q = pointer<const int8_t>(q);
  p.q_scale = pointer<const float>(q_scale);
  p.k = pointer<const int8_t>(k);
  p.k_scale = pointer<const float>(k_scale);
  p.v = pointer<const uint8_t>(v);
  p.v_scale = pointer<const float>(v_scale);
  p.v_mean = pointer<const float>(v_mean);
  p.kv_lens = pointer<const void>(kv_lens);
  p.out = pointer<void>(out);
  p.lse = pointer<float>(lse);
  auto get = [&](const char* name, size_t count) { return sage_binding::strides(st, name, count); };
  auto sq = get("q", 3), sqs = get("q_scale", 2), sk = get("k", 3), sks = get("k_scale", 2), sv = get("v", 3);
  auto svs = get("v_scale", 2), svm = get("v_mean", 2), so = get("out", 4), sl = get("lse", 2);
  auto sds = get("delta_s", 4), smk = get("mask", 4);
  p.q_sb = sq[0], p.q_sh = sq[1], p.q_sn = sq[2];
  p.qs_sb = sqs[0], p.qs_sh = sqs[1];
  p.k_sb = sk[0], p.k_sh = sk[1], p.k_sn = sk[2];
  p.ks_sb = sks[0], p.ks_sh = sks[1];
  p.v_sb = sv[0], p.v_sh = sv[1], p.v_sd = sv[2];
  p.vs_sb = svs[0], p.vs_sh = svs[1];
  p.vm_sb = svm[0], p.vm_sh = svm[1];
  p.o_sb = so[0], p.o_sh = so[1], p.o_sn = so[2], p.o_sd = so[3];
  p.lse_sb = sl[0], p.lse_sh = sl[1];
  std::tie(p.batch, p.hq, p.hkv, p.nq, p.nk, p.nkp, p.head_dim, p.head_dim_padded) = sizes;
  p.causal = causal;
  p.causal_offset = causal_offset;
  p.kv_lens_int64 = kv_lens_int64 ? 1 : 0;
  p.out_dtype = out_dtype;
  p.k_thread_groups = k_thread_groups ? 1 : 0;
  p.pv16 = pv16 ? 1 : 0;
  p.delta_s = pointer<const float>(delta_s);
  p.ds_sb = sds[0], p.ds_sh = sds[1], p.ds_sr = sds[2], p.ds_sk = sds[3];
  p.q_group = q_group;
  if (p.delta_s != nullptr && q_group < 1) throw std::invalid_argument("sm90: q_group must be ≥ 1 with delta_s");
  p.mask = pointer<const void>(mask);
  p.mask_sb = smk[0], p.mask_sh = smk[1], p.mask_sr = smk[2], p.mask_sk = smk[3];
  p.mask_bool = mask_bool ? 1 : 0;
  p.cu_q = pointer<const int32_t>(cu_q);
  p.cu_k = pointer<const int32_t>(cu_k);
  p.key_first = pointer<const int32_t>(key_first);
  p.cu_blk = pointer<const int32_t>(cu_blk);
  p.n_seq = n_seq;
  if (p.cu_blk != nullptr && (p.cu_q == nullptr || p.cu_k == nullptr || p.key_first == nullptr || n_seq < 1))
    throw std::invalid_argument("sm90: a packed batch needs cu_q, cu_k, key_first, cu_blk and n_seq >= 1");
  const char* err = sage_sm90::launch(p, stream, ctas_per_sm);
  if (err[0] != '\0') throw std::runtime_error(std::string("sage sm90 kernel launch failed: ") + err);
}

py::dict kernel_info(int head_dim_padded, int ctas_per_sm, bool k_thread_groups, bool biased, bool pv16) {
  int regs = 0, local = 0, smem = 0, threads = 0;
  if (!sage_sm90::kernel_info(head_dim_padded, ctas_per_sm, k_thread_groups, biased, pv16, &regs, &local, &smem,
                              &threads))
    throw std::invalid_argument("sm90: no such instantiation built (or no CUDA device)");
  py::dict d;
  d["registers"] = regs;
  d["local_bytes"] = local;
  d["dynamic_smem_bytes"] = smem;
  d["threads"] = threads;
  return d;
}

}  // namespace

PYBIND11_MODULE(_sm90, m) {
  m.doc() = "sage.quantized_attention for sm_90a (wgmma INT8 QK, FP8 or FP16 PV); see csrc/sm90/kernel.cuh";
  m.def("attention", &attention, py::arg("q"), py::arg("q_scale"), py::arg("k"), py::arg("k_scale"), py::arg("v"),
        py::arg("v_scale"), py::arg("v_mean"), py::arg("kv_lens"), py::arg("out"), py::arg("lse"),
        py::arg("strides"), py::arg("sizes"), py::arg("causal"), py::arg("causal_offset"),
        py::arg("kv_lens_int64"), py::arg("out_dtype"), py::arg("stream"), py::arg("ctas_per_sm"),
        py::arg("k_thread_groups") = false, py::arg("delta_s") = py::none(), py::arg("q_group") = 1,
        py::arg("mask") = py::none(), py::arg("mask_bool") = false, py::arg("pv16") = false,
        py::arg("cu_q") = py::none(), py::arg("cu_k") = py::none(), py::arg("key_first") = py::none(),
        py::arg("cu_blk") = py::none(), py::arg("n_seq") = 0);
  m.def("kernel_info", &kernel_info, py::arg("head_dim_padded"), py::arg("ctas_per_sm"),
        py::arg("k_thread_groups") = false, py::arg("biased") = false, py::arg("pv16") = false);
  // The built instantiations (params.h's InstanceKey): (head_dim, ctas_per_sm, maps, thread_k, pairs, bias, pv16).
  py::list keys;
  for (int i = 0; i < sage_sm90::instance_count(); ++i) {
    const sage_sm90::InstanceKey k = sage_sm90::instance_key(i);
    keys.append(py::make_tuple(k.head_dim, k.ctas_per_sm, k.maps, k.thread_k, k.pairs, k.bias, k.pv16));
  }
  m.attr("INSTANTIATIONS") = py::tuple(keys);
  m.attr("HEAD_DIMS") = py::make_tuple(64, 128);
  m.attr("BLOCK_N") = 128;
  m.attr("BLOCK_M") = 64;
}

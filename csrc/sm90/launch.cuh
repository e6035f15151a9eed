// Host-side pieces of launching the sm90 kernel: one instantiation's launch and attributes functions, and the table
// of built instantiations (InstanceKey → those functions) that csrc/sm90/instantiations.py generates at build time,
// one translation unit per group so that nvcc compiles the groups in parallel.
#pragma once

#include "kernel.cuh"

namespace sage_sm90 {

template <typename Kernel>
static inline cudaError_t allow_smem(Kernel kernel, int bytes, unsigned& configured) {
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

template <int D, int CtasPerSm, bool kPV16>
constexpr int kDynamicSmem = SmemLayout<D, pipeline_stages<D, CtasPerSm, kPV16>(), kPV16>::kDynamic;

// Launches one instantiation (its key: params.h's InstanceKey) on `stream`: grid (query blocks of 64 rows — a packed
// batch: of every sequence, bounded by Nq/64 + S without reading cu_blk —, batch·heads), 128 threads.
template <int D, int CtasPerSm, bool kMaps, bool kThreadK, bool kPairs, bool kBias, bool kPV16>
static cudaError_t launch_instance(const Params& p, cudaStream_t stream) {
  static unsigned configured = 0;
  constexpr int kSmem = kDynamicSmem<D, CtasPerSm, kPV16>;
  auto kernel = attention_kernel<D, CtasPerSm, kMaps, kThreadK, kPairs, kBias, kPV16>;
  cudaError_t err = allow_smem(kernel, kSmem, configured);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.nq + kBlockM - 1) / kBlockM + (p.cu_blk != nullptr ? p.n_seq : 0), p.batch * p.hq);
  kernel<<<grid, 128, kSmem, stream>>>(p);
  return cudaGetLastError();
}

// One instantiation's compiled resources (kernel_info).
template <int D, int CtasPerSm, bool kMaps, bool kThreadK, bool kPairs, bool kBias, bool kPV16>
static cudaError_t instance_attributes(cudaFuncAttributes* attr, int* dynamic_smem) {
  *dynamic_smem = kDynamicSmem<D, CtasPerSm, kPV16>;
  return cudaFuncGetAttributes(attr, attention_kernel<D, CtasPerSm, kMaps, kThreadK, kPairs, kBias, kPV16>);
}

// A row of the instantiation table: the key and the two functions of that instantiation.
struct Instance {
  InstanceKey key;
  cudaError_t (*launch)(const Params&, cudaStream_t);
  cudaError_t (*attributes)(cudaFuncAttributes*, int*);
};

// The generated table: kInstanceGroupCount groups, each an array of Instance rows defined in its own generated
// translation unit (instantiations.py).
struct InstanceGroup {
  const Instance* rows;
  int count;
};
extern const InstanceGroup kInstanceGroups[];
extern const int kInstanceGroupCount;

}  // namespace sage_sm90

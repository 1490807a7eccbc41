// What the CUDA step-and-zero ops share: weight access (master weights or the
// param itself) and the per-launch scalars read on the device.
#pragma once

#include "accumkernels/dispatch.h"
#include "accumkernels/formulas.h"
#include "multi_tensor.cuh"

namespace accumkernels::cuda {

// Weights live in `master` (fp32) when kMaster, else in `param`; updated
// weights are written to both. kStochastic: bf16 params rounded stochastically
// with the random bits of element `first + i` of tensor `tensor`.
template <Dtype P, bool kMaster, bool kStochastic = false>
struct WeightsAt {
  using T = typename Storage<P>::type;
  T* param;
  float* master;
  uint32_t seed;
  uint32_t tensor;
  int64_t first;

  __device__ __forceinline__ bool aligned_for_packs() const {
    return aligned<T>(param) && (!kMaster || aligned<float>(master));
  }
  __device__ __forceinline__ T round(int64_t i, float w) const {
    if constexpr (kStochastic) {
      return float_to_bf16_stochastic(w, sr_random(seed, tensor, static_cast<uint64_t>(first + i)));
    } else {
      return Storage<P>::store(w);
    }
  }
  __device__ __forceinline__ float load(int64_t i) const {
    return kMaster ? master[i] : Storage<P>::load(param[i]);
  }
  __device__ __forceinline__ void store(int64_t i, float w) const {
    if (kMaster) master[i] = w;
    param[i] = round(i, w);
  }
  __device__ __forceinline__ void load_pack(float (&w)[kILP], int64_t i) const {
    if (kMaster) {
      cuda::load_pack(w, master, i);
    } else {
      T p[kILP];
      cuda::load_pack(p, param, i);
#pragma unroll
      for (int k = 0; k < kILP; ++k) w[k] = Storage<P>::load(p[k]);
    }
  }
  __device__ __forceinline__ void store_pack(int64_t i, const float (&w)[kILP]) const {
    if (kMaster) cuda::store_pack(master, i, w);
    T p[kILP];
#pragma unroll
    for (int k = 0; k < kILP; ++k) p[k] = round(i + k, w[k]);
    cuda::store_pack(param, i, p);
  }
};

// grad_scale * grad_scale_tensor, negated for maximize; read on the device.
struct DeviceScalars {
  float grad_scale;
  const float* grad_scale_tensor;  // nullptr if absent
  const float* found_inf;          // nullptr if absent
  bool maximize;
  bool zero_buffers;

  __device__ __forceinline__ bool skip() const { return found_inf != nullptr && *found_inf != 0.0f; }
  __device__ __forceinline__ float scale() const {
    const float s = grad_scale_tensor != nullptr ? grad_scale * *grad_scale_tensor : grad_scale;
    return maximize ? -s : s;
  }
};

// A skipped window still clears its buffers.
__device__ __forceinline__ void zero_chunk(float* buffer, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) buffer[i] = 0.0f;
}

inline void* ptr_or_null(at::TensorList list, size_t i) {
  return list.empty() ? nullptr : list[i].data_ptr();
}

}  // namespace accumkernels::cuda

// What the CUDA step-and-zero ops share: their chunk's pointers, 16-byte pack
// access to the weights of formulas.h's Weights, and the skipped window that
// only clears buffers.
#pragma once

#include "../op_args.h"
#include "../tensor_lists.h"
#include "accumkernels/dispatch.h"
#include "accumkernels/formulas.h"
#include "multi_tensor.cuh"

namespace accumkernels::cuda {

// Every step kernel's lists start 0 param, 1 master (fp32), 2 buffer (fp32);
// the optimizer's fp32 state follows. Tensor t's chunk from element `start`:
template <int L>
__device__ __forceinline__ float* chunk_floats(const Meta<L>& meta, int list, int t,
                                               int64_t start) {
  return static_cast<float*>(meta.addresses[list][t]) + start;
}

template <Dtype P, bool kMaster, bool kStochastic, int L>
__device__ __forceinline__ Weights<P, kMaster, kStochastic> chunk_weights(
    const Meta<L>& meta, int t, int64_t start, uint32_t seed) {
  using T = typename Storage<P>::type;
  return {static_cast<T*>(meta.addresses[0][t]) + start,
          kMaster ? chunk_floats(meta, 1, t, start) : nullptr, seed, meta.stream[t], start};
}

template <int N, Dtype P, bool kMaster, bool kStochastic>
__device__ __forceinline__ bool aligned_for_packs(const Weights<P, kMaster, kStochastic>& w) {
  using T = typename Storage<P>::type;
  return aligned<T, N>(w.param) && (!kMaster || aligned<float, N>(w.master));
}

template <int N, Dtype P, bool kMaster, bool kStochastic>
__device__ __forceinline__ void load_weights(const Weights<P, kMaster, kStochastic>& w,
                                             float (&out)[N], int64_t i) {
  using T = typename Storage<P>::type;
  if constexpr (kMaster) {
    load_pack<N>(out, w.master, i);
  } else {
    T p[N];
    load_pack<N>(p, w.param, i);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = Storage<P>::load(p[k]);
  }
}

template <int N, Dtype P, bool kMaster, bool kStochastic>
__device__ __forceinline__ void store_weights(const Weights<P, kMaster, kStochastic>& w,
                                              int64_t i, const float (&in)[N]) {
  using T = typename Storage<P>::type;
  if constexpr (kMaster) store_pack<N>(w.master, i, in);
  T p[N];
#pragma unroll
  for (int k = 0; k < N; ++k) p[k] = w.round(i + k, in[k]);
  store_pack<N>(w.param, i, p);
}

// A skipped window still clears its buffers.
__device__ __forceinline__ void zero_chunk(float* buffer, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) buffer[i] = 0.0f;
}

// The stream ids of a dtype group's tensors, in group order.
inline std::vector<uint32_t> group_streams(const DtypeGroup& g, const Stochastic& sr) {
  std::vector<uint32_t> out;
  out.reserve(g.indices.size());
  for (size_t i : g.indices) out.push_back(sr.streams[i]);
  return out;
}

// Calls f(std::integral_constant P, master, stochastic) for a step call over
// group `g`: the template parameters every step kernel is compiled for.
template <typename F>
void with_weights_kind(const DtypeGroup& g, bool master, bool stochastic, F&& f) {
  with_dtype(g.dtype, [&](auto p) {
    with_bool(master, [&](auto m) {
      with_stochastic<decltype(p)::value, decltype(m)::value>(stochastic, [&](auto sr) {
        f(p, m, sr);
      });
    });
  });
}

}  // namespace accumkernels::cuda

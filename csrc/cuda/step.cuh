// What the CUDA step-and-zero ops share: their chunk's pointers, 16-byte pack
// access to the weights (formulas.h's Weights) and the state (State), and the
// skipped window that only clears buffers.
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

template <Dtype P, WeightsKind K, int L>
__device__ __forceinline__ Weights<P, K> chunk_weights(const Meta<L>& meta, int t, int64_t start) {
  using T = typename Storage<P>::type;
  void* master = nullptr;
  if constexpr (K == WeightsKind::kMaster) master = chunk_floats(meta, 1, t, start);
  if constexpr (K == WeightsKind::kRemainder) {
    master = static_cast<uint16_t*>(meta.addresses[1][t]) + start;
  }
  return {static_cast<T*>(meta.addresses[0][t]) + start, master};
}

// The buffer (list 2) of tensor t from element `start`, of storage dtype G:
// fp32 sums, or gradients of the param's dtype (read as they are).
template <Dtype G, int L>
__device__ __forceinline__ typename Storage<G>::type* chunk_grads(const Meta<L>& meta, int t, int64_t start) {
  return static_cast<typename Storage<G>::type*>(meta.addresses[2][t]) + start;
}

template <int N, Dtype G>
__device__ __forceinline__ void load_grads(float (&out)[N], const typename Storage<G>::type* grads, int64_t i) {
  typename Storage<G>::type x[N];
  load_pack<N>(x, grads, i);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = Storage<G>::load(x[k]);
}

template <int N, typename T>
__device__ __forceinline__ void zero_pack(T* buffer, int64_t i) {
  const T zeros[N] = {};
  store_pack<N>(buffer, i, zeros);
}

// State list `list` of tensor t from element `start`, rounded with slot kSlot's bits.
template <Dtype S, uint32_t kSlot, int L>
__device__ __forceinline__ State<S, kSlot> chunk_state(const Meta<L>& meta, int list, int t,
                                                       int64_t start) {
  using T = typename Storage<S>::type;
  void* base = meta.addresses[list][t];
  return {base == nullptr ? nullptr : static_cast<T*>(base) + start};
}

// The chunk's stochastic-rounding draws: a chunk starts at a multiple of
// kChunk, so its element indices share their high 32 bits.
template <int L>
__device__ __forceinline__ SrChunk chunk_draws(const Meta<L>& meta, int t, int64_t start, uint32_t seed) {
  return sr_chunk(seed, meta.stream[t], start);
}

// Elements per pack of a step kernel: 16 bytes of its narrowest stored type.
template <Dtype P, Dtype S>
constexpr int kStepVec = kVec<typename Storage<P>::type> > kVec<typename Storage<S>::type>
                             ? kVec<typename Storage<P>::type>
                             : kVec<typename Storage<S>::type>;

template <int N, Dtype P, WeightsKind K>
__device__ __forceinline__ bool aligned_for_packs(const Weights<P, K>& w) {
  using T = typename Storage<P>::type;
  if constexpr (K == WeightsKind::kMaster) return aligned<T, N>(w.param) && aligned<float, N>(w.master);
  if constexpr (K == WeightsKind::kRemainder) {
    return aligned<T, N>(w.param) && aligned<uint16_t, N>(w.master);
  }
  return aligned<T, N>(w.param);
}

template <int N, Dtype S, uint32_t kSlot>
__device__ __forceinline__ bool aligned_for_packs(const State<S, kSlot>& st) {
  return st.data == nullptr || aligned<typename Storage<S>::type, N>(st.data);
}

template <int N, Dtype P, WeightsKind K>
__device__ __forceinline__ void load_weights(const Weights<P, K>& w, float (&out)[N], int64_t i) {
  using T = typename Storage<P>::type;
  T p[N];
  load_pack<N>(p, w.param, i);
  if constexpr (K == WeightsKind::kMaster) {
    load_pack<N>(out, w.masters(), i);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = master_or_param<P>(out[k], p[k]);
  } else if constexpr (K == WeightsKind::kRemainder) {
    uint16_t r[N];
    load_pack<N>(r, w.remainders(), i);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = join_remainder(p[k], r[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = Storage<P>::load(p[k]);
  }
}

template <int N, Dtype P, WeightsKind K>
__device__ __forceinline__ void store_weights(const Weights<P, K>& w, int64_t i, const float (&in)[N],
                                              const SrChunk& sr) {
  using T = typename Storage<P>::type;
  T p[N];
  if constexpr (K == WeightsKind::kMaster) {
    store_pack<N>(w.masters(), i, in);
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = Storage<P>::store(in[k]);
  } else if constexpr (K == WeightsKind::kRemainder) {
    uint16_t r[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      p[k] = remainder_param(in[k]);
      r[k] = remainder_bits(in[k]);
    }
    store_pack<N>(w.remainders(), i, r);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = w.round(i + k, in[k], sr);
  }
  store_pack<N>(w.param, i, p);
}

template <int N, Dtype S, uint32_t kSlot>
__device__ __forceinline__ void load_state(const State<S, kSlot>& st, float (&out)[N], int64_t i) {
  using T = typename Storage<S>::type;
  T x[N];
  load_pack<N>(x, st.data, i);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = Storage<S>::load(x[k]);
}

template <int N, Dtype S, uint32_t kSlot>
__device__ __forceinline__ void store_state(const State<S, kSlot>& st, int64_t i, const float (&in)[N],
                                            const SrChunk& sr) {
  using T = typename Storage<S>::type;
  T x[N];
#pragma unroll
  for (int k = 0; k < N; ++k) x[k] = st.round(i + k, in[k], sr);
  store_pack<N>(st.data, i, x);
}

// ---- 8-bit state: a warp per block of kState8Block ----------------------------
// The 8-bit step functors (adam.cuh's Adam8Functor, sgd.cu's Sgd8Functor) give
// each warp one block at a time and each lane kPerLane adjacent elements of it
// (Lane): where the chunk's pointers allow, a lane moves them as packs, its
// codes in one 8-byte access and its params and buffer sums in 16-byte ones,
// all loads issued before the arithmetic; a lane of a chunk's last, partial
// block or of an unaligned chunk moves them one by one. (A lane striding the
// block by the warp moved one byte of each code array an access, and its loads
// waited on the stores before them: 0.34 of the copy's GB/s on an H200.) A
// chunk starts at a multiple of kChunk, so at a block boundary.
constexpr int kWarp = 32;
constexpr int kPerLane = static_cast<int>(kState8Block) / kWarp;
static_assert(kChunk % kState8Block == 0, "a chunk starts at a block boundary");

// Lane `lane`'s elements of block b of a chunk of n elements: from `first`,
// the `count` (0 to kPerLane) that lie in the chunk; `packs` where all
// kPerLane do and the chunk is aligned for pack access (vector_ok).
struct Lane {
  int64_t first;
  int count;
  bool packs;

  __device__ __forceinline__ Lane(int64_t b, int lane, int64_t n, bool vector_ok)
      : first(b * kState8Block + static_cast<int64_t>(lane) * kPerLane),
        count(static_cast<int>(first >= n ? 0 : (n - first < kPerLane ? n - first : kPerLane))),
        packs(vector_ok && count == kPerLane) {}
};

// Whether a chunk's weights, buffer and code arrays allow the lanes' packs.
template <Dtype P, WeightsKind K, Dtype G, typename... Codes>
__device__ __forceinline__ bool aligned_for_lanes(const Weights<P, K>& w, const typename Storage<G>::type* buffer,
                                                  const Codes*... codes) {
  return aligned_for_packs<kPerLane>(w) && aligned<typename Storage<G>::type, kPerLane>(buffer) &&
         (aligned<uint8_t, kPerLane>(codes) && ...);
}

// A lane's weights and gradients (the buffer's values) as floats; its codes.
template <Dtype P, WeightsKind K, Dtype G>
__device__ __forceinline__ void lane_load_update_inputs(const Lane& l, const Weights<P, K>& w,
                                                        const typename Storage<G>::type* buffer,
                                                        float (&p)[kPerLane], float (&g)[kPerLane]) {
  if (l.packs) {
    load_weights<kPerLane>(w, p, l.first);
    load_grads<kPerLane, G>(g, buffer, l.first);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    p[k] = k < l.count ? w.load(l.first + k) : 0.0f;
    g[k] = k < l.count ? Storage<G>::load(buffer[l.first + k]) : 0.0f;
  }
}

__device__ __forceinline__ void lane_load_codes(const Lane& l, const uint8_t* codes, uint8_t (&c)[kPerLane]) {
  if (l.packs) {
    load_pack<kPerLane>(c, codes, l.first);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) c[k] = k < l.count ? codes[l.first + k] : uint8_t{0};
}

// Stores a lane's new weights and clears its buffer elements (zero_buffers).
template <Dtype P, WeightsKind K, typename T>
__device__ __forceinline__ void lane_store_weights(const Lane& l, const Weights<P, K>& w, const float (&p)[kPerLane],
                                                   const SrChunk& sr, T* buffer, bool zero_buffers) {
  if (l.packs) {
    store_weights<kPerLane>(w, l.first, p, sr);
    if (zero_buffers) zero_pack<kPerLane>(buffer, l.first);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    if (k < l.count) {
      w.store(l.first + k, p[k], sr);
      if (zero_buffers) buffer[l.first + k] = T{};
    }
  }
}

__device__ __forceinline__ void lane_store_codes(const Lane& l, uint8_t* codes, const uint8_t (&c)[kPerLane]) {
  if (l.packs) {
    store_pack<kPerLane>(codes, l.first, c);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    if (k < l.count) codes[l.first + k] = c[k];
  }
}

// The block's new scale (formulas.h's state8_block_scale) from each lane's
// maximum and NaN flag: the warp's maximum, NaN if any lane saw a NaN.
__device__ __forceinline__ float warp_block_scale(float lane_max, bool lane_nan) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, lane_max, offset);
    lane_max = lane_max > other ? lane_max : other;
  }
  return state8_block_scale(lane_max, __any_sync(0xFFFFFFFFu, lane_nan) ? 1u : 0u);
}

// A skipped window still clears its buffers.
template <typename T>
__device__ __forceinline__ void zero_chunk(T* buffer, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) buffer[i] = T{};
}

// The stream ids of a dtype group's tensors, in group order.
inline std::vector<uint32_t> group_streams(const DtypeGroup& g, const Stochastic& sr) {
  std::vector<uint32_t> out;
  out.reserve(g.indices.size());
  for (size_t i : g.indices) out.push_back(sr.streams[i]);
  return out;
}

// Calls f(std::integral_constant P, weights kind, state dtype, grad dtype) for
// a step call over group `g`: the template parameters every step kernel is
// compiled for (the weights kind as step_weights_kind() picks it; the grad
// dtype that of the group's buffers in `buffers`: fp32 sums or P).
template <typename F>
void with_step_kind(const DtypeGroup& g, at::TensorList buffers, WeightsKind kind, Dtype state_dtype, F&& f) {
  const Dtype grad_dtype = group_dtype(buffers, g);
  with_dtype(g.dtype, [&](auto p) {
    constexpr Dtype P = decltype(p)::value;
    with_weights_kind<P>(kind, [&](auto k) {
      with_state_dtype(state_dtype, [&](auto s) {
        with_grad_dtype<P>(grad_dtype, [&](auto gd) { f(p, k, s, gd); });
      });
    });
  });
}

}  // namespace accumkernels::cuda

// What the CPU step-and-zero ops share: the per-call scalars, the skipped
// window that only clears the buffers, and the walk over a dtype group's
// chunks.
#pragma once

#include <ATen/core/Tensor.h>

#include "../op_args.h"
#include "../tensor_lists.h"
#include "kernels.h"
#include "parallel.h"

namespace accumkernels::cpu {

// A float* into pointer list `ptrs` at element `offset`, or nullptr for an
// absent optional list.
inline float* f32_at(const std::vector<void*>& ptrs, size_t t, int64_t offset) {
  return ptrs[t] == nullptr ? nullptr : static_cast<float*>(ptrs[t]) + offset;
}

// The scalars of a step call over dtype group `g`.
inline StepCall step_call(const DtypeGroup& g, bool master, const Stochastic& sr, float grad_scale,
                          bool zero_buffers) {
  return {g.dtype, master, sr.enabled && g.dtype == Dtype::kBFloat16 && !master, sr.seed,
          grad_scale, zero_buffers};
}

// The weights of tensor t of group `g` from element `offset` on; list 0 holds
// the params, list 1 the master weights.
inline WeightsChunk weights_at(const DtypeGroup& g, const Stochastic& sr, size_t t, int64_t offset) {
  const int64_t element = g.dtype == Dtype::kFloat32 ? 4 : 2;
  return {static_cast<char*>(g.pointers[0][t]) + offset * element, f32_at(g.pointers[1], t, offset),
          sr.streams[g.indices[t]], offset};
}

// Runs f(tensor in group, offset, length) over every chunk of the group, in parallel.
template <typename F>
void for_each_chunk(const DtypeGroup& g, F&& f) {
  const FlatIndex index(g.numels);
  index.parallel_for_chunks([&](int64_t, int64_t begin, int64_t end) {
    index.for_each_segment(begin, end, f);
  });
}

// A skipped window still clears its buffers.
inline void zero_all(at::TensorList buffers) {
  const KernelTable& k = kernels();
  for (const DtypeGroup& g : group_by_dtype(buffers, {buffers})) {
    for_each_chunk(g, [&](size_t t, int64_t offset, int64_t length) {
      k.zero(static_cast<float*>(g.pointers[0][t]) + offset, length);
    });
  }
}

}  // namespace accumkernels::cpu

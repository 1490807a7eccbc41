// What the CPU step-and-zero ops share: the per-call scalars, the skipped
// window that only clears the buffers, and the walk over a dtype group's
// chunks.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>
#include <vector>

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
// `buffers`: the call's buffer list (fp32 sums, or gradients of the params'
// dtypes: checks.h's check_step_tensors).
inline StepCall step_call(const DtypeGroup& g, at::TensorList buffers, const Masters& masters,
                          const Stochastic& sr, Dtype state_dtype, bool state8, float grad_scale,
                          bool zero_buffers) {
  return {g.dtype,   step_weights_kind(g.dtype, masters, sr),
          group_dtype(buffers, g),
          state_dtype, state8, sr.seed, grad_scale, zero_buffers};
}

// A buffer pointer into list `ptrs` at element `offset`, of the call's grad dtype.
inline void* buffer_at(const std::vector<void*>& ptrs, size_t t, int64_t offset, const StepCall& call) {
  return static_cast<char*>(ptrs[t]) + offset * (call.grad_dtype == Dtype::kFloat32 ? 4 : 2);
}

// The weights of tensor t of group `g` from element `offset` on; list 0 holds
// the params, list 1 the master weights or remainders.
inline WeightsChunk weights_at(const DtypeGroup& g, const Masters& masters, const Stochastic& sr, size_t t,
                               int64_t offset) {
  const int64_t element = g.dtype == Dtype::kFloat32 ? 4 : 2;
  void* master = g.pointers[1][t] == nullptr
                     ? nullptr
                     : static_cast<char*>(g.pointers[1][t]) + offset * masters.element_size;
  return {static_cast<char*>(g.pointers[0][t]) + offset * element, master, sr.streams[g.indices[t]], offset};
}

// A state pointer into list `ptrs` at element `offset` of the call's state
// (fp32, bf16 or 8-bit codes), or nullptr for an absent list.
inline void* state_at(const std::vector<void*>& ptrs, size_t t, int64_t offset, const StepCall& call) {
  const int64_t element = call.state8 ? 1 : (call.state_dtype == Dtype::kFloat32 ? 4 : 2);
  return ptrs[t] == nullptr ? nullptr : static_cast<char*>(ptrs[t]) + offset * element;
}

// Runs f(tensor in group, offset, length) over pieces of at most kChunk
// elements of the group, in parallel (FlatIndex::parallel_for_elements). A
// piece never crosses a multiple of 2^32 elements of its tensor, so that its
// element indices share their high 32 bits (formulas.h's SrChunk). With
// `align` (a divisor of FlatIndex::kSplit) every piece starts at a multiple of
// it in its tensor: the flat index counts each tensor rounded up to a multiple
// of `align`, so the pieces' boundaries fall on multiples of it in every tensor.
template <typename F>
void for_each_chunk(const DtypeGroup& g, F&& f, int64_t align = 1) {
  std::vector<int64_t> padded(g.numels);
  for (int64_t& n : padded) n = (n + align - 1) / align * align;
  const FlatIndex index(padded);
  index.parallel_for_elements(kStepGrain, [&](int64_t begin, int64_t end) {
    index.for_each_segment(begin, end, [&](size_t t, int64_t offset, int64_t padded_length) {
      const int64_t length = std::min(padded_length, g.numels[t] - offset);  // not into the padding
      if (length <= 0) return;
      const int64_t boundary = ((offset >> 32) + 1) << 32;  // the next multiple of 2^32
      if (offset + length > boundary) {
        f(t, offset, boundary - offset);
        f(t, boundary, offset + length - boundary);
      } else {
        f(t, offset, length);
      }
    });
  });
}

// A skipped window still clears its buffers (16-bit gradients: 0 is all bits
// zero, so their bytes are cleared as half as many floats, and an odd last one).
inline void zero_all(at::TensorList buffers) {
  const KernelTable& k = kernels();
  for (const DtypeGroup& g : group_by_dtype(buffers, {buffers})) {
    if (g.dtype == Dtype::kFloat32) {
      for_each_chunk(g, [&](size_t t, int64_t offset, int64_t length) {
        k.zero(static_cast<float*>(g.pointers[0][t]) + offset, length);
      });
      continue;
    }
    for (size_t t = 0; t < g.indices.size(); ++t) {
      std::memset(g.pointers[0][t], 0, static_cast<size_t>(g.numels[t]) * 2);
    }
  }
}

}  // namespace accumkernels::cpu

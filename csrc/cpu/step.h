// What the CPU step-and-zero ops share: reading the device scalars and the
// skipped-window path that only clears the buffers.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels.h"
#include "parallel.h"

namespace accumkernels::cpu {

struct StepScalars {
  bool skip;         // found_inf is nonzero: leave params and state untouched
  float grad_scale;  // grad_scale * grad_scale_tensor, negated for maximize
};

inline StepScalars read_step_scalars(double grad_scale,
                                     const std::optional<at::Tensor>& grad_scale_tensor,
                                     const std::optional<at::Tensor>& found_inf, bool maximize) {
  float s = static_cast<float>(grad_scale);
  if (grad_scale_tensor.has_value()) s *= *grad_scale_tensor->const_data_ptr<float>();
  const bool skip = found_inf.has_value() && *found_inf->const_data_ptr<float>() != 0.0f;
  return {skip, maximize ? -s : s};
}

inline void zero_all(at::TensorList buffers) {
  const FlatIndex index(buffers);
  const auto ptrs = base_pointers(buffers);
  const KernelTable& k = kernels();
  index.parallel_for_chunks([&](int64_t, int64_t begin, int64_t end) {
    index.for_each_segment(begin, end, [&](size_t t, int64_t offset, int64_t length) {
      k.zero(reinterpret_cast<float*>(ptrs[t]) + offset, length);
    });
  });
}

// A float* into tensor list `ptrs` at element `offset`, or nullptr for an
// absent optional list.
inline float* f32_at(const std::vector<char*>& ptrs, size_t t, int64_t offset) {
  return ptrs.empty() ? nullptr : reinterpret_cast<float*>(ptrs[t]) + offset;
}

}  // namespace accumkernels::cpu

// accumulate_ on the CPU: buffer = (0 if overwrite else buffer) + scale * float32(grad)
// for every pair, in one parallel pass over the whole list.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>

#include "../checks.h"
#include "kernels.h"
#include "parallel.h"

namespace accumkernels::cpu {
namespace {

constexpr const char* kOp = "accumkernels::accumulate_";

void accumulate_cpu(at::TensorList buffers, at::TensorList grads, double scale,
                    const std::optional<at::Tensor>& scale_tensor, bool overwrite,
                    const std::optional<at::Tensor>& found_inf) {
  check_length(kOp, grads, "grads", buffers.size(), "one grad per buffer");
  for (size_t i = 0; i < buffers.size(); ++i) {
    check_tensor(kOp, buffers[i], "buffers", i, at::kCPU, {at::kFloat});
    check_like(kOp, grads[i], "grads", i, buffers[i], "buffers",
               {at::kFloat, at::kBFloat16, at::kHalf});
  }
  check_scalar_tensor(kOp, scale_tensor, "scale_tensor", at::kCPU);
  check_scalar_tensor(kOp, found_inf, "found_inf", at::kCPU);

  const float s = static_cast<float>(scale) *
                  (scale_tensor.has_value() ? *scale_tensor->const_data_ptr<float>() : 1.0f);
  const FlatIndex index(buffers);
  const auto buffer_ptrs = base_pointers(buffers);
  const auto grad_ptrs = base_pointers(grads);
  const KernelTable& k = kernels();
  std::atomic<bool> nonfinite{false};
  index.parallel_for_chunks([&](int64_t, int64_t begin, int64_t end) {
    bool chunk_nonfinite = false;
    index.for_each_segment(begin, end, [&](size_t t, int64_t offset, int64_t length) {
      const at::Tensor& g = grads[t];
      chunk_nonfinite |= k.accumulate({reinterpret_cast<float*>(buffer_ptrs[t]) + offset,
                                       grad_ptrs[t] + offset * g.element_size(),
                                       storage_dtype(g.scalar_type()), length, s, overwrite});
    });
    if (chunk_nonfinite) nonfinite.store(true, std::memory_order_relaxed);
  });
  if (found_inf.has_value() && nonfinite.load()) *found_inf->data_ptr<float>() = 1.0f;
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CPU, m) { m.impl("accumulate_", &accumulate_cpu); }

}  // namespace accumkernels::cpu

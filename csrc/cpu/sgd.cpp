// sgd_step_and_zero_ on the CPU: torch.optim.SGD's update with
// g = grad_scale * buffer, then buffer = 0, in one parallel pass.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../checks.h"
#include "kernels.h"
#include "parallel.h"
#include "step.h"

namespace accumkernels::cpu {
namespace {

constexpr const char* kOp = "accumkernels::sgd_step_and_zero_";

void sgd_step_and_zero_cpu(at::TensorList params, at::TensorList buffers,
                           at::TensorList momentum_buffers, at::TensorList master_params,
                           double lr, double momentum, double dampening, double weight_decay,
                           bool nesterov, bool maximize, bool is_first_step, double grad_scale,
                           const std::optional<at::Tensor>& grad_scale_tensor,
                           const std::optional<at::Tensor>& found_inf, bool zero_buffers,
                           bool stochastic_rounding, int64_t seed) {
  check_sgd_arguments(kOp, params, buffers, momentum_buffers, master_params, momentum,
                      stochastic_rounding, grad_scale_tensor, found_inf);
  if (params.empty()) return;

  const StepScalars s = read_step_scalars(grad_scale, grad_scale_tensor, found_inf, maximize);
  if (s.skip) {
    if (zero_buffers) zero_all(buffers);
    return;
  }
  const SgdHyper h = make_sgd_hyper(lr, momentum, dampening, weight_decay);
  const SgdFlags flags{momentum == 0.0
                           ? Momentum::kNone
                           : (is_first_step ? Momentum::kFirstStep : Momentum::kRunning),
                       nesterov, weight_decay != 0.0};
  const FlatIndex index(params);
  const auto param_ptrs = base_pointers(params);
  const auto buffer_ptrs = base_pointers(buffers);
  const auto momentum_ptrs = base_pointers(momentum_buffers);
  const auto master_ptrs = base_pointers(master_params);
  const KernelTable& k = kernels();
  index.parallel_for_chunks([&](int64_t, int64_t begin, int64_t end) {
    index.for_each_segment(begin, end, [&](size_t t, int64_t offset, int64_t length) {
      const at::Tensor& p = params[t];
      k.sgd({param_ptrs[t] + offset * p.element_size(), storage_dtype(p.scalar_type()),
             f32_at(master_ptrs, t, offset), f32_at(buffer_ptrs, t, offset),
             f32_at(momentum_ptrs, t, offset), length, s.grad_scale, zero_buffers,
             {stochastic_rounding, static_cast<uint32_t>(seed), static_cast<uint32_t>(t), offset}},
            h, flags);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CPU, m) {
  m.impl("sgd_step_and_zero_", &sgd_step_and_zero_cpu);
}

}  // namespace accumkernels::cpu

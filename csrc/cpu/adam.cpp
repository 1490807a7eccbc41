// adam_step_and_zero_ and adamw_step_and_zero_ on the CPU: torch.optim.Adam's
// and AdamW's update with g = grad_scale * buffer, then buffer = 0, in one
// parallel pass. The two differ only in how weight decay is applied.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "../checks.h"
#include "kernels.h"
#include "parallel.h"
#include "step.h"

namespace accumkernels::cpu {
namespace {

// One implementation, registered twice: Adam and AdamW differ only in how weight
// decay is applied (kAdamW), a compile-time choice.
template <bool kAdamW>
void adam_cpu(at::TensorList params, at::TensorList buffers,
              at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
              at::TensorList state_steps, at::TensorList master_params, double lr, double beta1,
              double beta2, double eps, double weight_decay, bool amsgrad, bool maximize,
              double grad_scale, const std::optional<at::Tensor>& grad_scale_tensor,
              const std::optional<at::Tensor>& found_inf, bool zero_buffers,
              bool stochastic_rounding, int64_t seed) {
  constexpr const char* op =
      kAdamW ? "accumkernels::adamw_step_and_zero_" : "accumkernels::adam_step_and_zero_";
  check_adam_arguments(op, params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                       master_params, amsgrad, stochastic_rounding, grad_scale_tensor, found_inf);
  if (params.empty()) return;

  const StepScalars s = read_step_scalars(grad_scale, grad_scale_tensor, found_inf, maximize);
  if (s.skip) {
    if (zero_buffers) zero_all(buffers);
    return;
  }
  const AdamHyper h = make_adam_hyper(lr, beta1, beta2, eps, weight_decay);
  const AdamFlags flags{kAdamW, amsgrad, weight_decay != 0.0};
  std::vector<AdamStepScalars> per_tensor(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    float* step = state_steps[i].data_ptr<float>();
    *step += 1.0f;
    per_tensor[i] = adam_bias_corrections(h, *step);
  }
  const FlatIndex index(params);
  const auto param_ptrs = base_pointers(params);
  const auto buffer_ptrs = base_pointers(buffers);
  const auto exp_avg_ptrs = base_pointers(exp_avgs);
  const auto exp_avg_sq_ptrs = base_pointers(exp_avg_sqs);
  const auto max_ptrs = base_pointers(max_exp_avg_sqs);
  const auto master_ptrs = base_pointers(master_params);
  const KernelTable& k = kernels();
  index.parallel_for_chunks([&](int64_t, int64_t begin, int64_t end) {
    index.for_each_segment(begin, end, [&](size_t t, int64_t offset, int64_t length) {
      const at::Tensor& p = params[t];
      k.adam({param_ptrs[t] + offset * p.element_size(), storage_dtype(p.scalar_type()),
              f32_at(master_ptrs, t, offset), f32_at(buffer_ptrs, t, offset),
              f32_at(exp_avg_ptrs, t, offset), f32_at(exp_avg_sq_ptrs, t, offset),
              f32_at(max_ptrs, t, offset), length, s.grad_scale, per_tensor[t], zero_buffers,
              {stochastic_rounding, static_cast<uint32_t>(seed), static_cast<uint32_t>(t), offset}},
             h, flags);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CPU, m) {
  m.impl("adam_step_and_zero_", &adam_cpu<false>);
  m.impl("adamw_step_and_zero_", &adam_cpu<true>);
}

}  // namespace accumkernels::cpu

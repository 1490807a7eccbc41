// The argument structs of the op families, shared by the CPU and CUDA entry
// points. The schema's arguments (csrc/ops.cpp) are spelled out once, in the
// entry templates below: each checks them (checks.h) before anything is
// touched, packs them into the family's struct and calls the backend's Run.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "accumkernels/formulas.h"
#include "checks.h"

namespace accumkernels {

inline const float* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<float>() : nullptr;
}

// Stochastic rounding of bf16 params: the seed and each param's stream id
// (`positions`, or its place in the list when none are given).
struct Stochastic {
  bool enabled;
  uint32_t seed;
  std::vector<uint32_t> streams;
};

inline Stochastic make_stochastic(bool enabled, int64_t seed, c10::ArrayRef<int64_t> positions,
                                  size_t count) {
  Stochastic sr{enabled, static_cast<uint32_t>(seed), std::vector<uint32_t>(count)};
  for (size_t i = 0; i < count; ++i) {
    sr.streams[i] = static_cast<uint32_t>(positions.empty() ? static_cast<int64_t>(i) : positions[i]);
  }
  return sr;
}

// What the master_params list holds: nothing (kParam), fp32 master weights
// (kMaster) or int16 remainders of bf16 params (kRemainder).
struct Masters {
  WeightsKind kind;
  int64_t element_size;
};

inline Masters masters_of(at::TensorList master_params) {
  if (master_params.empty()) return {WeightsKind::kParam, 0};
  return master_params[0].scalar_type() == at::kShort ? Masters{WeightsKind::kRemainder, 2}
                                                      : Masters{WeightsKind::kMaster, 4};
}

inline Dtype state_storage(at::ScalarType t) {
  return t == at::kBFloat16 ? Dtype::kBFloat16 : Dtype::kFloat32;
}

// The weights kind of a step over params of `param_dtype`: the call's master
// weights or remainders, else stochastic rounding for bf16 params where asked,
// else round to nearest.
inline WeightsKind step_weights_kind(Dtype param_dtype, const Masters& masters, const Stochastic& sr) {
  if (masters.kind != WeightsKind::kParam) return masters.kind;
  return sr.enabled && param_dtype == Dtype::kBFloat16 ? WeightsKind::kStochastic : WeightsKind::kParam;
}

struct AccumulateArgs {
  at::TensorList buffers;
  at::TensorList grads;
  float scale;                      // scale * scale_tensor[0], read where the kernel runs
  const float* scale_tensor;        // nullptr: none
  bool overwrite;
  float* found_inf;                 // nullptr: none
};

struct SgdArgs {
  at::TensorList params, buffers, momentum_buffers, master_params, momentum_buffer_scales;
  Masters masters;
  Dtype state_dtype;  // fp32 when state8
  bool state8;        // uint8 codes with block scales (formulas.h's 8-bit state)
  SgdHyper hyper;
  Momentum momentum;
  StepScale scale;
  bool zero_buffers;
  Stochastic sr;
};

struct AdamArgs {
  at::TensorList params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
      master_params, exp_avg_scales, exp_avg_sq_scales;
  Masters masters;
  Dtype state_dtype;  // fp32 when state8
  bool state8;        // uint8 codes with block scales (formulas.h's 8-bit state)
  AdamHyper hyper;
  StepScale scale;
  bool zero_buffers;
  Stochastic sr;
};

// ---- the registered entry points, one template per family ----------------

template <void (*Run)(const AccumulateArgs&)>
void accumulate_entry(at::TensorList buffers, at::TensorList grads, double scale,
                      const std::optional<at::Tensor>& scale_tensor, bool overwrite,
                      const std::optional<at::Tensor>& found_inf) {
  check_accumulate_arguments("accumkernels::accumulate_", buffers, grads, scale_tensor, found_inf);
  if (buffers.empty()) return;
  Run({buffers, grads, static_cast<float>(scale), data_or_null(scale_tensor), overwrite,
       found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr});
}

template <void (*Run)(const SgdArgs&)>
void sgd_entry(at::TensorList params, at::TensorList buffers, at::TensorList momentum_buffers,
               at::TensorList master_params, at::TensorList momentum_buffer_scales, double lr,
               double momentum, double dampening,
               double weight_decay, bool nesterov, bool is_first_step, double grad_scale,
               const std::optional<at::Tensor>& grad_scale_tensor,
               const std::optional<at::Tensor>& found_inf, bool zero_buffers,
               bool stochastic_rounding, int64_t seed, c10::ArrayRef<int64_t> positions) {
  check_sgd_arguments("accumkernels::sgd_step_and_zero_", params, buffers, momentum_buffers,
                      master_params, momentum_buffer_scales, momentum, stochastic_rounding, positions,
                      grad_scale_tensor, found_inf);
  if (params.empty()) return;
  const Momentum mode = momentum == 0.0 ? Momentum::kNone
                                        : (is_first_step ? Momentum::kFirstStep : Momentum::kRunning);
  Run({params, buffers, momentum_buffers, master_params, momentum_buffer_scales, masters_of(master_params),
       state_storage(state_dtype_of(momentum_buffers)),
       momentum != 0.0 && state_dtype_of(momentum_buffers) == at::kByte,
       make_sgd_hyper(lr, momentum, dampening, weight_decay, nesterov), mode,
       StepScale{static_cast<float>(grad_scale), data_or_null(grad_scale_tensor),
                 data_or_null(found_inf)},
       zero_buffers, make_stochastic(stochastic_rounding, seed, positions, params.size())});
}

template <bool kAdamW, void (*Run)(const AdamArgs&)>
void adam_entry(at::TensorList params, at::TensorList buffers, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                at::TensorList state_steps, at::TensorList master_params,
                at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales, double lr,
                double beta1, double beta2, double eps, double weight_decay, bool amsgrad,
                double grad_scale, const std::optional<at::Tensor>& grad_scale_tensor,
                const std::optional<at::Tensor>& found_inf, bool zero_buffers,
                bool stochastic_rounding, int64_t seed, c10::ArrayRef<int64_t> positions) {
  const char* op = kAdamW ? "accumkernels::adamw_step_and_zero_" : "accumkernels::adam_step_and_zero_";
  check_adam_arguments(op, params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                       master_params, exp_avg_scales, exp_avg_sq_scales, amsgrad, stochastic_rounding,
                       positions, grad_scale_tensor, found_inf);
  if (params.empty()) return;
  Run({params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params,
       exp_avg_scales, exp_avg_sq_scales, masters_of(master_params),
       state_storage(state_dtype_of(exp_avgs)), state_dtype_of(exp_avgs) == at::kByte,
       make_adam_hyper(lr, beta1, beta2, eps, weight_decay, kAdamW, amsgrad),
       StepScale{static_cast<float>(grad_scale), data_or_null(grad_scale_tensor),
                 data_or_null(found_inf)},
       zero_buffers, make_stochastic(stochastic_rounding, seed, positions, params.size())});
}

}  // namespace accumkernels

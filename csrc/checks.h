// Argument checks shared by the CPU and CUDA entry points. They guard memory
// safety for direct torch.ops.accumkernels.* calls and name the argument and
// list index; the Python API (accumkernels/_validation.py) runs the full set of
// checks, aliasing included, before it reaches these.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <optional>

#include "accumkernels/formulas.h"

#include <c10/util/ArrayRef.h>

namespace accumkernels {

inline void check_length(const char* op, at::TensorList list, const char* name, size_t expected,
                         const char* reason) {
  TORCH_CHECK_VALUE(list.size() == expected, op, ": ", name, " has ", list.size(),
                    " tensors; expected ", expected, " (", reason, ")");
}

inline bool dtype_in(at::ScalarType t, std::initializer_list<at::ScalarType> allowed) {
  for (auto a : allowed) {
    if (a == t) return true;
  }
  return false;
}

// A dense strided tensor on `device` with one of `dtypes`.
inline void check_tensor(const char* op, const at::Tensor& t, const char* name, size_t i,
                         const at::Device& device, std::initializer_list<at::ScalarType> dtypes) {
  TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, op, ": ", name, "[", i, "] has layout ",
                   t.layout(), "; expected a strided (dense) tensor");
  TORCH_CHECK(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(),
              "; expected ", device);
  TORCH_CHECK_TYPE(dtype_in(t.scalar_type(), dtypes), op, ": ", name, "[", i, "] has dtype ",
                   t.scalar_type(), "; expected one of ", c10::ArrayRef<at::ScalarType>(dtypes));
  TORCH_CHECK(t.is_non_overlapping_and_dense(), op, ": ", name, "[", i,
              "] must be non-overlapping and dense (contiguous in some dimension order)");
}

// Like check_tensor, and element for element in the same memory order as
// `ref`: both contiguous with the same numel, or the same sizes and strides.
inline void check_like(const char* op, const at::Tensor& t, const char* name, size_t i,
                       const at::Tensor& ref, const char* ref_name,
                       std::initializer_list<at::ScalarType> dtypes) {
  check_tensor(op, t, name, i, ref.device(), dtypes);
  TORCH_CHECK_VALUE(t.numel() == ref.numel(), op, ": ", name, "[", i, "] has ", t.numel(),
                    " elements; ", ref_name, "[", i, "] has ", ref.numel());
  const bool both_contiguous = t.is_contiguous() && ref.is_contiguous();
  TORCH_CHECK_VALUE(both_contiguous || (t.sizes() == ref.sizes() && t.strides() == ref.strides()),
                    op, ": ", name, "[", i, "] (sizes ", t.sizes(), ", strides ", t.strides(),
                    ") is not laid out like ", ref_name, "[", i, "] (sizes ", ref.sizes(),
                    ", strides ", ref.strides(), ")");
}

// An optional 1-element fp32 tensor on `device`.
inline void check_scalar_tensor(const char* op, const std::optional<at::Tensor>& t,
                                const char* name, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK_TYPE(t->layout() == at::kStrided && t->scalar_type() == at::kFloat, op, ": ", name,
                   " must be a strided float32 tensor; got ", t->scalar_type(), " ", t->layout());
  TORCH_CHECK_VALUE(t->numel() == 1, op, ": ", name, " must have 1 element; got ", t->numel());
  TORCH_CHECK(t->device() == device, op, ": ", name, " is on ", t->device(), "; expected ",
              device);
}

// The tensors every step-and-zero op takes: params (any supported dtype,
// the device of params[0]), buffers laid out like them (all fp32 sums, or
// all gradients of their param's dtype, read as they are) and optional
// master weights, which only make sense for low-precision params: fp32 copies
// (bf16 or fp16 params) or int16 remainders (bf16 params), one dtype per call.
inline void check_step_tensors(const char* op, at::TensorList params, at::TensorList buffers,
                               at::TensorList master_params) {
  check_length(op, buffers, "buffers", params.size(), "one buffer per param");
  if (!master_params.empty()) {
    check_length(op, master_params, "master_params", params.size(),
                 "one master weight per param, or none");
  }
  bool narrow = false;  // some buffer is a 16-bit gradient
  for (const at::Tensor& b : buffers) narrow |= b.defined() && b.scalar_type() != at::kFloat;
  for (size_t i = 0; i < params.size(); ++i) {
    check_tensor(op, params[i], "params", i, params[0].device(),
                 {at::kFloat, at::kBFloat16, at::kHalf});
    check_like(op, buffers[i], "buffers", i, params[i], "params",
               {at::kFloat, params[i].scalar_type()});
    // One kind per call: fp32 sums, or (where any buffer is narrower) gradients of the params' dtypes.
    TORCH_CHECK_TYPE(buffers[i].scalar_type() == (narrow ? params[i].scalar_type() : at::kFloat), op,
                     ": buffers[", i, "] has dtype ", buffers[i].scalar_type(), " and params[", i, "] ",
                     params[i].scalar_type(), "; expected every buffer float32, or every buffer of its "
                     "param's dtype");
    if (!master_params.empty()) {
      TORCH_CHECK_TYPE(params[i].scalar_type() != at::kFloat, op, ": params[", i,
                       "] is float32 but master_params were given; master weights are for "
                       "bfloat16 or float16 params");
      check_like(op, master_params[i], "master_params", i, params[i], "params",
                 {at::kFloat, at::kShort});
      TORCH_CHECK_TYPE(master_params[i].scalar_type() == master_params[0].scalar_type(), op,
                       ": master_params[", i, "] has dtype ", master_params[i].scalar_type(),
                       " but master_params[0] has ", master_params[0].scalar_type(),
                       "; one kind of master weights per call");
      TORCH_CHECK_TYPE(master_params[i].scalar_type() != at::kShort ||
                           params[i].scalar_type() == at::kBFloat16,
                       op, ": master_params[", i, "] are int16 remainders but params[", i,
                       "] is ", params[i].scalar_type(), "; remainders are for bfloat16 params");
    }
  }
}

// Stochastic rounding rounds the bf16 params themselves: with master weights
// the params are round-to-nearest copies of them instead.
inline void check_stochastic_rounding(const char* op, bool stochastic_rounding,
                                      at::TensorList master_params) {
  TORCH_CHECK_VALUE(!stochastic_rounding || master_params.empty(), op,
                    ": stochastic_rounding and master_params exclude each other (with master "
                    "weights the params are rounded copies of them)");
}

// Stream ids of stochastic rounding: none, or one per param in [0, 2^32).
inline void check_positions(const char* op, c10::ArrayRef<int64_t> positions, size_t count) {
  TORCH_CHECK_VALUE(positions.empty() || positions.size() == count, op, ": positions has ",
                    positions.size(), " entries; expected none or one per param (", count, ")");
  for (size_t i = 0; i < positions.size(); ++i) {
    TORCH_CHECK_VALUE(positions[i] >= 0 && positions[i] < (int64_t{1} << 32), op, ": positions[",
                      i, "] = ", positions[i], "; expected an int in [0, 2**32)");
  }
}

// Everything accumulate_ checks before it touches memory.
inline void check_accumulate_arguments(const char* op, at::TensorList buffers,
                                       at::TensorList grads,
                                       const std::optional<at::Tensor>& scale_tensor,
                                       const std::optional<at::Tensor>& found_inf) {
  check_length(op, grads, "grads", buffers.size(), "one grad per buffer");
  if (buffers.empty()) return;
  const at::Device device = buffers[0].device();
  for (size_t i = 0; i < buffers.size(); ++i) {
    check_tensor(op, buffers[i], "buffers", i, device, {at::kFloat});
    check_like(op, grads[i], "grads", i, buffers[i], "buffers",
               {at::kFloat, at::kBFloat16, at::kHalf});
  }
  check_scalar_tensor(op, scale_tensor, "scale_tensor", device);
  check_scalar_tensor(op, found_inf, "found_inf", device);
}

// The dtype of a call's optimizer state: that of its first state tensor
// (`first_state`: momentum_buffers or exp_avgs), float32 for a call without state.
inline at::ScalarType state_dtype_of(at::TensorList first_state) {
  return first_state.empty() ? at::kFloat : first_state[0].scalar_type();
}

// Optimizer state: one tensor per param, laid out like it, all of one dtype
// (float32, bfloat16, or uint8 codes of 8-bit state: Adam's only) across the call.
inline void check_state(const char* op, at::TensorList state, const char* name,
                        at::TensorList params, at::ScalarType state_dtype) {
  check_length(op, state, name, params.size(), "one per param");
  for (size_t i = 0; i < params.size(); ++i) {
    check_like(op, state[i], name, i, params[i], "params", {at::kFloat, at::kBFloat16, at::kByte});
    TORCH_CHECK_TYPE(state[i].scalar_type() == state_dtype, op, ": ", name, "[", i,
                     "] has dtype ", state[i].scalar_type(), " but the call's state is ",
                     state_dtype, "; every state tensor of a call has one dtype");
  }
}

// 8-bit state: one fp32 tensor of block scales per param, a scale per block of 256.
inline void check_state8_scales(const char* op, at::TensorList scales, const char* name,
                                at::TensorList params) {
  check_length(op, scales, name, params.size(), "8-bit state: one scale tensor per param");
  for (size_t i = 0; i < params.size(); ++i) {
    check_tensor(op, scales[i], name, i, params[0].device(), {at::kFloat});
    const int64_t blocks = (params[i].numel() + kState8Block - 1) / kState8Block;
    TORCH_CHECK_VALUE(scales[i].numel() == blocks, op, ": ", name, "[", i, "] has ", scales[i].numel(),
                      " elements; expected ", blocks, " (one per block of 256 of params[", i, "])");
  }
}

// Everything an SGD step checks before it touches memory.
inline void check_sgd_arguments(const char* op, at::TensorList params, at::TensorList buffers,
                                at::TensorList momentum_buffers, at::TensorList master_params,
                                at::TensorList momentum_buffer_scales, double momentum,
                                bool stochastic_rounding,
                                c10::ArrayRef<int64_t> positions,
                                const std::optional<at::Tensor>& grad_scale_tensor,
                                const std::optional<at::Tensor>& found_inf) {
  check_step_tensors(op, params, buffers, master_params);
  check_stochastic_rounding(op, stochastic_rounding, master_params);
  check_positions(op, positions, params.size());
  if (momentum != 0.0) {
    check_state(op, momentum_buffers, "momentum_buffers", params, state_dtype_of(momentum_buffers));
  } else {
    check_length(op, momentum_buffers, "momentum_buffers", 0, "momentum is 0");
  }
  if (momentum != 0.0 && state_dtype_of(momentum_buffers) == at::kByte) {
    check_state8_scales(op, momentum_buffer_scales, "momentum_buffer_scales", params);
  } else {
    check_length(op, momentum_buffer_scales, "momentum_buffer_scales", 0, "the momentum buffers are not 8-bit");
  }
  if (params.empty()) return;
  check_scalar_tensor(op, grad_scale_tensor, "grad_scale_tensor", params[0].device());
  check_scalar_tensor(op, found_inf, "found_inf", params[0].device());
}

// Everything an Adam or AdamW step checks before it touches memory.
inline void check_adam_arguments(const char* op, at::TensorList params, at::TensorList buffers,
                                 at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                 at::TensorList max_exp_avg_sqs, at::TensorList state_steps,
                                 at::TensorList master_params, at::TensorList exp_avg_scales,
                                 at::TensorList exp_avg_sq_scales, bool amsgrad,
                                 bool stochastic_rounding, c10::ArrayRef<int64_t> positions,
                                 const std::optional<at::Tensor>& grad_scale_tensor,
                                 const std::optional<at::Tensor>& found_inf) {
  check_step_tensors(op, params, buffers, master_params);
  check_stochastic_rounding(op, stochastic_rounding, master_params);
  check_positions(op, positions, params.size());
  const at::ScalarType state_dtype = state_dtype_of(exp_avgs);
  check_state(op, exp_avgs, "exp_avgs", params, state_dtype);
  check_state(op, exp_avg_sqs, "exp_avg_sqs", params, state_dtype);
  if (state_dtype == at::kByte) {  // 8-bit state: codes and one fp32 scale per block of 256
    TORCH_CHECK_VALUE(!amsgrad, op, ": amsgrad with 8-bit state (uint8 exp_avgs) is not supported");
    check_state8_scales(op, exp_avg_scales, "exp_avg_scales", params);
    check_state8_scales(op, exp_avg_sq_scales, "exp_avg_sq_scales", params);
  } else {
    check_length(op, exp_avg_scales, "exp_avg_scales", 0, "the state is not 8-bit");
    check_length(op, exp_avg_sq_scales, "exp_avg_sq_scales", 0, "the state is not 8-bit");
  }
  if (amsgrad) {
    check_state(op, max_exp_avg_sqs, "max_exp_avg_sqs", params, state_dtype);
  } else {
    check_length(op, max_exp_avg_sqs, "max_exp_avg_sqs", 0, "amsgrad is False");
  }
  check_length(op, state_steps, "state_steps", params.size(), "one step count per param");
  if (params.empty()) return;
  const at::Device device = params[0].device();
  for (size_t i = 0; i < state_steps.size(); ++i) {
    check_tensor(op, state_steps[i], "state_steps", i, device, {at::kFloat});
    TORCH_CHECK_VALUE(state_steps[i].numel() == 1, op, ": state_steps[", i,
                      "] must have 1 element; got ", state_steps[i].numel());
  }
  check_scalar_tensor(op, grad_scale_tensor, "grad_scale_tensor", device);
  check_scalar_tensor(op, found_inf, "found_inf", device);
}

}  // namespace accumkernels

// The schema of every accumkernels op, declared once. Implementations are
// registered per backend: csrc/cpu/*.cpp (CPU), csrc/cuda/*.cu (CUDA), through
// the entry templates of csrc/op_args.h. The formulas are documented in
// accumkernels/ops.py and csrc/include/accumkernels/formulas.h. maximize is
// not an argument: accumkernels.ops folds it into the sign of grad_scale.
#include <torch/library.h>

// Adam and AdamW take the same arguments.
#define ADAM_ARGUMENTS                                                                     \
  "(Tensor(a!)[] params, Tensor(b!)[] buffers, Tensor(c!)[] exp_avgs, "                    \
  "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] state_steps, "      \
  "Tensor(g!)[] master_params, Tensor(h!)[] exp_avg_scales, Tensor(i!)[] exp_avg_sq_scales, " \
  "float lr, float beta1, float beta2, float eps, "                                         \
  "float weight_decay, bool amsgrad, float grad_scale, Tensor? grad_scale_tensor, "         \
  "Tensor? found_inf, bool zero_buffers, bool stochastic_rounding, int seed, "              \
  "int[] positions) -> ()"

TORCH_LIBRARY(accumkernels, m) {
  m.def(
      "accumulate_(Tensor(a!)[] buffers, Tensor[] grads, float scale, Tensor? scale_tensor, "
      "bool overwrite, Tensor(b!)? found_inf) -> ()");
  m.def(
      "sgd_step_and_zero_(Tensor(a!)[] params, Tensor(b!)[] buffers, "
      "Tensor(c!)[] momentum_buffers, Tensor(d!)[] master_params, "
      "Tensor(e!)[] momentum_buffer_scales, float lr, float momentum, "
      "float dampening, float weight_decay, bool nesterov, bool is_first_step, "
      "float grad_scale, Tensor? grad_scale_tensor, Tensor? found_inf, bool zero_buffers, "
      "bool stochastic_rounding, int seed, int[] positions) -> ()");
  m.def("adam_step_and_zero_" ADAM_ARGUMENTS);
  m.def("adamw_step_and_zero_" ADAM_ARGUMENTS);
  m.def("grad_norm(Tensor[] buffers) -> Tensor");
}

// adam_step_and_zero_ and adamw_step_and_zero_ on the CPU: torch.optim.Adam's
// and AdamW's update with g = grad_scale * buffer, then buffer = 0, one
// parallel pass per param dtype. The two differ only in hyper.adamw.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "../op_args.h"
#include "kernels.h"
#include "step.h"

namespace accumkernels::cpu {
namespace {

void run_adam(const AdamArgs& a) {
  if (a.scale.skip()) {
    if (a.zero_buffers) zero_all(a.buffers);
    return;
  }
  std::vector<AdamStepScalars> per_tensor(a.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    float* step = a.state_steps[i].data_ptr<float>();
    *step += 1.0f;
    per_tensor[i] = adam_bias_corrections(a.hyper, *step);
  }
  const KernelTable& k = kernels();
  // 8-bit state: chunks start at a block boundary, so a block is one chunk's.
  const int64_t align = a.state8 ? kState8Block : 1;
  for (const DtypeGroup& g :
       group_by_dtype(a.params, {a.params, a.master_params, a.buffers, a.exp_avgs, a.exp_avg_sqs,
                                 a.max_exp_avg_sqs, a.exp_avg_scales, a.exp_avg_sq_scales})) {
    const StepCall call =
        step_call(g, a.buffers, a.masters, a.sr, a.state_dtype, a.state8, a.scale.scale(), a.zero_buffers);
    for_each_chunk(
        g,
        [&](size_t t, int64_t offset, int64_t length) {
          k.adam(call, a.hyper,
                 {weights_at(g, a.masters, a.sr, t, offset), buffer_at(g.pointers[2], t, offset, call),
                  state_at(g.pointers[3], t, offset, call), state_at(g.pointers[4], t, offset, call),
                  state_at(g.pointers[5], t, offset, call), f32_at(g.pointers[6], t, offset / kState8Block),
                  f32_at(g.pointers[7], t, offset / kState8Block), length, per_tensor[g.indices[t]]});
        },
        align);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CPU, m) {
  m.impl("adam_step_and_zero_", &adam_entry<false, run_adam>);
  m.impl("adamw_step_and_zero_", &adam_entry<true, run_adam>);
}

}  // namespace accumkernels::cpu

// sgd_step_and_zero_ on the CPU: torch.optim.SGD's update with
// g = grad_scale * buffer, then buffer = 0, one parallel pass per param dtype.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../op_args.h"
#include "kernels.h"
#include "step.h"

namespace accumkernels::cpu {
namespace {

void run_sgd(const SgdArgs& a) {
  if (a.scale.skip()) {
    if (a.zero_buffers) zero_all(a.buffers);
    return;
  }
  const KernelTable& k = kernels();
  // 8-bit state: chunks start at a block boundary, so a block is one chunk's.
  const int64_t align = a.state8 ? kState8Block : 1;
  for (const DtypeGroup& g : group_by_dtype(
           a.params, {a.params, a.master_params, a.buffers, a.momentum_buffers, a.momentum_buffer_scales})) {
    const StepCall call =
        step_call(g, a.buffers, a.masters, a.sr, a.state_dtype, a.state8, a.scale.scale(), a.zero_buffers);
    for_each_chunk(
        g,
        [&](size_t t, int64_t offset, int64_t length) {
          k.sgd(call, a.hyper, a.momentum,
                {weights_at(g, a.masters, a.sr, t, offset), buffer_at(g.pointers[2], t, offset, call),
                 state_at(g.pointers[3], t, offset, call), f32_at(g.pointers[4], t, offset / kState8Block),
                 length});
        },
        align);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CPU, m) { m.impl("sgd_step_and_zero_", &sgd_entry<run_sgd>); }

}  // namespace accumkernels::cpu

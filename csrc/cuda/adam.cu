// adam_step_and_zero_ and adamw_step_and_zero_ on CUDA: torch.optim.Adam's and
// AdamW's update with g = grad_scale * buffer, then buffer = 0, one
// multi-tensor launch per param dtype. Step counts live on the device: a first
// launch increments them (unless found_inf), the update reads them.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../op_args.h"
#include "accumkernels/formulas.h"
#include "adam.cuh"
#include "multi_tensor.cuh"
#include "step.cuh"

namespace accumkernels::cuda {
namespace {

struct IncrementStep {
  __device__ void operator()(const Meta<1>& meta, int t, int64_t, int64_t, int,
                             const float* found_inf) {
    if (threadIdx.x == 0 && (found_inf == nullptr || *found_inf == 0.0f)) {
      *static_cast<float*>(meta.addresses[0][t]) += 1.0f;
    }
  }
};

void run_adam(const AdamArgs& a) {
  const c10::cuda::CUDAGuard guard(a.params[0].device());
  {
    std::vector<std::vector<void*>> steps(1);
    for (const auto& s : a.state_steps) steps[0].push_back(s.data_ptr());
    multi_tensor_apply<1>(steps, std::vector<int64_t>(a.state_steps.size(), 1), {},
                          IncrementStep{}, a.scale.found_inf);
  }
  if (a.state8) {
    for (const DtypeGroup& g :
         group_by_dtype(a.params, {a.params, a.master_params, a.buffers, a.exp_avgs, a.exp_avg_sqs,
                                   a.max_exp_avg_sqs, a.state_steps, a.exp_avg_scales, a.exp_avg_sq_scales})) {
      with_step_kind(g, a.buffers, step_weights_kind(g.dtype, a.masters, a.sr), Dtype::kFloat32,
                     [&](auto p, auto k, auto, auto gd) {
        multi_tensor_apply<kAdam8Lists>(g.pointers, g.numels, group_streams(g, a.sr),
                                    Adam8Functor<decltype(p)::value, decltype(k)::value, decltype(gd)::value>{},
                                    a.hyper, a.scale, a.zero_buffers, a.sr.seed);
      });
    }
    return;
  }
  for (const DtypeGroup& g : group_by_dtype(a.params, {a.params, a.master_params, a.buffers,
                                                      a.exp_avgs, a.exp_avg_sqs, a.max_exp_avg_sqs,
                                                      a.state_steps})) {
    with_step_kind(g, a.buffers, step_weights_kind(g.dtype, a.masters, a.sr), a.state_dtype,
                   [&](auto p, auto k, auto s, auto gd) {
      multi_tensor_apply<kAdamLists>(
          g.pointers, g.numels, group_streams(g, a.sr),
          AdamFunctor<decltype(p)::value, decltype(k)::value, decltype(s)::value, decltype(gd)::value>{}, a.hyper,
          a.scale, a.zero_buffers, a.sr.seed);
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CUDA, m) {
  m.impl("adam_step_and_zero_", &adam_entry<false, run_adam>);
  m.impl("adamw_step_and_zero_", &adam_entry<true, run_adam>);
}

}  // namespace accumkernels::cuda

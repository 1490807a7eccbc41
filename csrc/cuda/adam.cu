// adam_step_and_zero_ and adamw_step_and_zero_ on CUDA: torch.optim.Adam's and
// AdamW's update with g = grad_scale * buffer, then buffer = 0, one
// multi-tensor launch per param dtype. Step counts live on the device: a first
// launch increments them (unless found_inf), the update reads them.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "accumkernels/formulas.h"
#include "multi_tensor.cuh"
#include "step.cuh"

namespace accumkernels::cuda {
namespace {

// Lists: 0 param, 1 master, 2 buffer, 3 exp_avg, 4 exp_avg_sq, 5 max_exp_avg_sq, 6 step.
constexpr int kLists = 7;

struct IncrementStep {
  __device__ void operator()(const Meta<1>& meta, int t, int64_t, int64_t, int,
                             const float* found_inf) {
    if (threadIdx.x == 0 && (found_inf == nullptr || *found_inf == 0.0f)) {
      *static_cast<float*>(meta.addresses[0][t]) += 1.0f;
    }
  }
};

template <Dtype P, bool kMaster, bool kStochastic, bool kAdamW, bool kAmsgrad, bool kWeightDecay>
struct AdamFunctor {
  __device__ void operator()(const Meta<kLists>& meta, int t, int64_t start, int64_t n, int,
                             AdamHyper h, DeviceScalars ds, uint32_t seed) {
    using T = typename Storage<P>::type;
    float* buffer = static_cast<float*>(meta.addresses[2][t]) + start;
    if (ds.skip()) {
      if (ds.zero_buffers) zero_chunk(buffer, n);
      return;
    }
    const WeightsAt<P, kMaster, kStochastic> w{
        static_cast<T*>(meta.addresses[0][t]) + start,
        kMaster ? static_cast<float*>(meta.addresses[1][t]) + start : nullptr, seed,
        static_cast<uint32_t>(meta.index[t]), start};
    float* exp_avg = static_cast<float*>(meta.addresses[3][t]) + start;
    float* exp_avg_sq = static_cast<float*>(meta.addresses[4][t]) + start;
    float* max_sq = kAmsgrad ? static_cast<float*>(meta.addresses[5][t]) + start : nullptr;
    const float step = *static_cast<const float*>(meta.addresses[6][t]);
    const AdamStepScalars s = adam_bias_corrections(h, step);
    const float gs = ds.scale();
    const bool vector_ok = w.aligned_for_packs() && aligned<float>(buffer) &&
                           aligned<float>(exp_avg) && aligned<float>(exp_avg_sq) &&
                           (!kAmsgrad || aligned<float>(max_sq));
    for_chunk(
        n, vector_ok,
        [&](int64_t i) {
          float g[kILP], m[kILP], v[kILP], vm[kILP], p[kILP];
          load_pack(g, buffer, i);
          load_pack(m, exp_avg, i);
          load_pack(v, exp_avg_sq, i);
          if (kAmsgrad) load_pack(vm, max_sq, i);
          w.load_pack(p, i);
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            p[k] = adam_update<kAdamW, kAmsgrad, kWeightDecay>(p[k], gs * g[k], m[k], v[k],
                                                               vm[k], h, s);
          }
          w.store_pack(i, p);
          store_pack(exp_avg, i, m);
          store_pack(exp_avg_sq, i, v);
          if (kAmsgrad) store_pack(max_sq, i, vm);
          if (ds.zero_buffers) {
            const float zeros[kILP] = {};
            store_pack(buffer, i, zeros);
          }
        },
        [&](int64_t i) {
          float m = exp_avg[i], v = exp_avg_sq[i], vm = kAmsgrad ? max_sq[i] : 0.0f;
          w.store(i, adam_update<kAdamW, kAmsgrad, kWeightDecay>(w.load(i), gs * buffer[i], m, v,
                                                                 vm, h, s));
          exp_avg[i] = m;
          exp_avg_sq[i] = v;
          if (kAmsgrad) max_sq[i] = vm;
          if (ds.zero_buffers) buffer[i] = 0.0f;
        });
  }
};

// One implementation, registered twice: Adam and AdamW differ only in how weight
// decay is applied (kAdamW), a compile-time choice.
template <bool kAdamW>
void adam_cuda(at::TensorList params, at::TensorList buffers,
               at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList state_steps,
               at::TensorList master_params, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool amsgrad, bool maximize, double grad_scale,
               const std::optional<at::Tensor>& grad_scale_tensor,
               const std::optional<at::Tensor>& found_inf, bool zero_buffers,
               bool stochastic_rounding, int64_t seed) {
  constexpr const char* op =
      kAdamW ? "accumkernels::adamw_step_and_zero_" : "accumkernels::adam_step_and_zero_";
  check_adam_arguments(op, params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                       master_params, amsgrad, stochastic_rounding, grad_scale_tensor, found_inf);
  if (params.empty()) return;
  const at::Device device = params[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const float* found = found_inf.has_value() ? found_inf->const_data_ptr<float>() : nullptr;

  {
    std::vector<std::vector<void*>> steps(1);
    for (const auto& s : state_steps) steps[0].push_back(s.data_ptr());
    multi_tensor_apply<1>(steps, std::vector<int64_t>(state_steps.size(), 1), {},
                          IncrementStep{}, found);
  }
  const AdamHyper h = make_adam_hyper(lr, beta1, beta2, eps, weight_decay);
  const DeviceScalars ds{static_cast<float>(grad_scale),
                         grad_scale_tensor.has_value() ? grad_scale_tensor->const_data_ptr<float>()
                                                       : nullptr,
                         found, maximize, zero_buffers};
  for (const Dtype d : {Dtype::kFloat32, Dtype::kBFloat16, Dtype::kFloat16}) {
    std::vector<std::vector<void*>> lists(kLists);
    std::vector<int64_t> numels;
    std::vector<int> indices;
    for (size_t i = 0; i < params.size(); ++i) {
      if (storage_dtype(params[i].scalar_type()) != d) continue;
      indices.push_back(static_cast<int>(i));
      lists[0].push_back(params[i].data_ptr());
      lists[1].push_back(ptr_or_null(master_params, i));
      lists[2].push_back(buffers[i].data_ptr());
      lists[3].push_back(exp_avgs[i].data_ptr());
      lists[4].push_back(exp_avg_sqs[i].data_ptr());
      lists[5].push_back(ptr_or_null(max_exp_avg_sqs, i));
      lists[6].push_back(state_steps[i].data_ptr());
      numels.push_back(params[i].numel());
    }
    if (numels.empty()) continue;
    with_dtype(d, [&](auto p) {
      with_bool(!master_params.empty(), [&](auto master) {
        with_stochastic<decltype(p)::value, decltype(master)::value>(stochastic_rounding, [&](auto sr) {
          with_bool(amsgrad, [&](auto is_amsgrad) {
            with_bool(weight_decay != 0.0, [&](auto wd) {
              multi_tensor_apply<kLists>(
                  lists, numels, indices,
                  AdamFunctor<decltype(p)::value, decltype(master)::value, decltype(sr)::value,
                              kAdamW, decltype(is_amsgrad)::value, decltype(wd)::value>{},
                  h, ds, static_cast<uint32_t>(seed));
            });
          });
        });
      });
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CUDA, m) {
  m.impl("adam_step_and_zero_", &adam_cuda<false>);
  m.impl("adamw_step_and_zero_", &adam_cuda<true>);
}

}  // namespace accumkernels::cuda

// sgd_step_and_zero_ on CUDA: torch.optim.SGD's update with
// g = grad_scale * buffer, then buffer = 0, one multi-tensor launch per param dtype.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "accumkernels/formulas.h"
#include "multi_tensor.cuh"
#include "step.cuh"

namespace accumkernels::cuda {
namespace {

constexpr const char* kOp = "accumkernels::sgd_step_and_zero_";
// Lists: 0 param, 1 master, 2 buffer, 3 momentum buffer.
constexpr int kLists = 4;

template <Dtype P, bool kMaster, bool kStochastic, Momentum kMomentum, bool kNesterov,
          bool kWeightDecay>
struct SgdFunctor {
  __device__ void operator()(const Meta<kLists>& meta, int t, int64_t start, int64_t n, int,
                             SgdHyper h, DeviceScalars ds, uint32_t seed) {
    using T = typename Storage<P>::type;
    constexpr bool kHasMomentum = kMomentum != Momentum::kNone;
    float* buffer = static_cast<float*>(meta.addresses[2][t]) + start;
    if (ds.skip()) {
      if (ds.zero_buffers) zero_chunk(buffer, n);
      return;
    }
    const WeightsAt<P, kMaster, kStochastic> w{
        static_cast<T*>(meta.addresses[0][t]) + start,
        kMaster ? static_cast<float*>(meta.addresses[1][t]) + start : nullptr, seed,
        static_cast<uint32_t>(meta.index[t]), start};
    float* mom = kHasMomentum ? static_cast<float*>(meta.addresses[3][t]) + start : nullptr;
    const float gs = ds.scale();
    const bool vector_ok =
        w.aligned_for_packs() && aligned<float>(buffer) && (!kHasMomentum || aligned<float>(mom));
    for_chunk(
        n, vector_ok,
        [&](int64_t i) {
          float g[kILP], b[kILP] = {}, p[kILP];
          load_pack(g, buffer, i);
          if (kMomentum == Momentum::kRunning) load_pack(b, mom, i);
          w.load_pack(p, i);
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            p[k] = sgd_update<kMomentum, kNesterov, kWeightDecay>(p[k], gs * g[k], b[k], h);
          }
          w.store_pack(i, p);
          if (kHasMomentum) store_pack(mom, i, b);
          if (ds.zero_buffers) {
            const float zeros[kILP] = {};
            store_pack(buffer, i, zeros);
          }
        },
        [&](int64_t i) {
          float b = kMomentum == Momentum::kRunning ? mom[i] : 0.0f;
          w.store(i, sgd_update<kMomentum, kNesterov, kWeightDecay>(w.load(i), gs * buffer[i], b, h));
          if (kHasMomentum) mom[i] = b;
          if (ds.zero_buffers) buffer[i] = 0.0f;
        });
  }
};

void sgd_step_and_zero_cuda(at::TensorList params, at::TensorList buffers,
                            at::TensorList momentum_buffers, at::TensorList master_params,
                            double lr, double momentum, double dampening, double weight_decay,
                            bool nesterov, bool maximize, bool is_first_step, double grad_scale,
                            const std::optional<at::Tensor>& grad_scale_tensor,
                            const std::optional<at::Tensor>& found_inf, bool zero_buffers,
                            bool stochastic_rounding, int64_t seed) {
  check_sgd_arguments(kOp, params, buffers, momentum_buffers, master_params, momentum,
                      stochastic_rounding, grad_scale_tensor, found_inf);
  if (params.empty()) return;
  const at::Device device = params[0].device();
  const c10::cuda::CUDAGuard guard(device);

  const SgdHyper h = make_sgd_hyper(lr, momentum, dampening, weight_decay);
  const Momentum mode = momentum == 0.0
                            ? Momentum::kNone
                            : (is_first_step ? Momentum::kFirstStep : Momentum::kRunning);
  const DeviceScalars ds{static_cast<float>(grad_scale),
                         grad_scale_tensor.has_value() ? grad_scale_tensor->const_data_ptr<float>()
                                                       : nullptr,
                         found_inf.has_value() ? found_inf->const_data_ptr<float>() : nullptr,
                         maximize, zero_buffers};
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
      lists[3].push_back(ptr_or_null(momentum_buffers, i));
      numels.push_back(params[i].numel());
    }
    if (numels.empty()) continue;
    with_dtype(d, [&](auto p) {
      with_bool(!master_params.empty(), [&](auto master) {
        with_stochastic<decltype(p)::value, decltype(master)::value>(stochastic_rounding, [&](auto sr) {
          with_momentum(mode, [&](auto mom) {
            with_bool(nesterov, [&](auto nest) {
              with_bool(weight_decay != 0.0, [&](auto wd) {
                multi_tensor_apply<kLists>(
                    lists, numels, indices,
                    SgdFunctor<decltype(p)::value, decltype(master)::value, decltype(sr)::value,
                               decltype(mom)::value, decltype(nest)::value, decltype(wd)::value>{},
                    h, ds, static_cast<uint32_t>(seed));
              });
            });
          });
        });
      });
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CUDA, m) {
  m.impl("sgd_step_and_zero_", &sgd_step_and_zero_cuda);
}

}  // namespace accumkernels::cuda

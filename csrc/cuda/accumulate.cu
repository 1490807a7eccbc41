// accumulate_ on CUDA: buffer = (0 if overwrite else buffer) + scale * float32(grad)
// for every pair, one multi-tensor launch per grad dtype present in the list.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "accumkernels/formulas.h"
#include "multi_tensor.cuh"

namespace accumkernels::cuda {
namespace {

constexpr const char* kOp = "accumkernels::accumulate_";

template <Dtype G, bool kOverwrite>
struct AccumulateFunctor {
  __device__ void operator()(const Meta<2>& meta, int t, int64_t start, int64_t n, int,
                             float scale_value, const float* scale_tensor, float* found_inf) {
    using T = typename Storage<G>::type;
    float* buffer = static_cast<float*>(meta.addresses[0][t]) + start;
    const T* grad = static_cast<const T*>(meta.addresses[1][t]) + start;
    const float scale = scale_tensor != nullptr ? scale_value * *scale_tensor : scale_value;
    bool nonfinite = false;
    for_chunk(
        n, aligned<float>(buffer) && aligned<T>(grad),
        [&](int64_t i) {
          T g[kILP];
          float b[kILP];
          load_pack(g, grad, i);
          if (!kOverwrite) load_pack(b, buffer, i);
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            const float x = Storage<G>::load(g[k]);
            nonfinite |= is_nonfinite(x);
            b[k] = accumulate<kOverwrite>(kOverwrite ? 0.0f : b[k], x, scale);
          }
          store_pack(buffer, i, b);
        },
        [&](int64_t i) {
          const float x = Storage<G>::load(grad[i]);
          nonfinite |= is_nonfinite(x);
          buffer[i] = accumulate<kOverwrite>(kOverwrite ? 0.0f : buffer[i], x, scale);
        });
    // Every writer stores the same 1.0f: no atomics needed.
    if (found_inf != nullptr && __syncthreads_or(nonfinite) && threadIdx.x == 0) *found_inf = 1.0f;
  }
};

template <Dtype G>
void launch_for_dtype(const std::vector<std::vector<void*>>& lists, const std::vector<int64_t>& numels,
                      bool overwrite, float scale, const float* scale_tensor, float* found_inf) {
  if (overwrite) {
    multi_tensor_apply<2>(lists, numels, {}, AccumulateFunctor<G, true>{}, scale, scale_tensor,
                          found_inf);
  } else {
    multi_tensor_apply<2>(lists, numels, {}, AccumulateFunctor<G, false>{}, scale, scale_tensor,
                          found_inf);
  }
}

void accumulate_cuda(at::TensorList buffers, at::TensorList grads, double scale,
                     const std::optional<at::Tensor>& scale_tensor, bool overwrite,
                     const std::optional<at::Tensor>& found_inf) {
  check_length(kOp, grads, "grads", buffers.size(), "one grad per buffer");
  if (buffers.empty()) return;
  const at::Device device = buffers[0].device();
  for (size_t i = 0; i < buffers.size(); ++i) {
    check_tensor(kOp, buffers[i], "buffers", i, device, {at::kFloat});
    check_like(kOp, grads[i], "grads", i, buffers[i], "buffers",
               {at::kFloat, at::kBFloat16, at::kHalf});
  }
  check_scalar_tensor(kOp, scale_tensor, "scale_tensor", device);
  check_scalar_tensor(kOp, found_inf, "found_inf", device);
  const c10::cuda::CUDAGuard guard(device);

  // One launch per grad dtype: the functor is compiled per dtype.
  for (const Dtype d : {Dtype::kBFloat16, Dtype::kFloat16, Dtype::kFloat32}) {
    std::vector<std::vector<void*>> lists(2);
    std::vector<int64_t> numels;
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (storage_dtype(grads[i].scalar_type()) != d) continue;
      lists[0].push_back(buffers[i].data_ptr());
      lists[1].push_back(const_cast<void*>(grads[i].const_data_ptr()));
      numels.push_back(buffers[i].numel());
    }
    if (numels.empty()) continue;
    const float* st = scale_tensor.has_value() ? scale_tensor->const_data_ptr<float>() : nullptr;
    float* fi = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
    const float s = static_cast<float>(scale);
    switch (d) {
      case Dtype::kBFloat16:
        launch_for_dtype<Dtype::kBFloat16>(lists, numels, overwrite, s, st, fi);
        break;
      case Dtype::kFloat16:
        launch_for_dtype<Dtype::kFloat16>(lists, numels, overwrite, s, st, fi);
        break;
      case Dtype::kFloat32:
        launch_for_dtype<Dtype::kFloat32>(lists, numels, overwrite, s, st, fi);
        break;
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CUDA, m) { m.impl("accumulate_", &accumulate_cuda); }

}  // namespace accumkernels::cuda

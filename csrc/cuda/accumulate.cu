// accumulate_ on CUDA: buffer = (0 if overwrite else buffer) + scale * float32(grad)
// for every pair, one multi-tensor launch per grad dtype present in the list.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../op_args.h"
#include "../tensor_lists.h"
#include "accumkernels/dispatch.h"
#include "accumkernels/formulas.h"
#include "multi_tensor.cuh"

namespace accumkernels::cuda {
namespace {

template <Dtype G, bool kOverwrite>
struct AccumulateFunctor {
  __device__ void operator()(const Meta<2>& meta, int t, int64_t start, int64_t n, int,
                             float scale_value, const float* scale_tensor, float* found_inf) {
    using T = typename Storage<G>::type;
    constexpr int N = kVec<T>;
    float* buffer = static_cast<float*>(meta.addresses[0][t]) + start;
    const T* grad = static_cast<const T*>(meta.addresses[1][t]) + start;
    const float scale = scale_tensor != nullptr ? scale_value * *scale_tensor : scale_value;
    bool nonfinite = false;
    for_chunk<N>(
        n, aligned<float, N>(buffer) && aligned<T, N>(grad),
        [&](int64_t i) {
          T g[N];
          float b[N];
          load_pack<N>(g, grad, i);
          if (!kOverwrite) load_pack<N>(b, buffer, i);
#pragma unroll
          for (int k = 0; k < N; ++k) {
            const float x = Storage<G>::load(g[k]);
            nonfinite |= is_nonfinite(x);
            b[k] = accumulate<kOverwrite>(kOverwrite ? 0.0f : b[k], x, scale);
          }
          store_pack<N>(buffer, i, b);
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

void run_accumulate(const AccumulateArgs& a) {
  const c10::cuda::CUDAGuard guard(a.buffers[0].device());
  for (const DtypeGroup& g : group_by_dtype(a.grads, {a.buffers, a.grads})) {
    with_dtype(g.dtype, [&](auto d) {
      with_bool(a.overwrite, [&](auto overwrite) {
        multi_tensor_apply<2>(g.pointers, g.numels, {},
                              AccumulateFunctor<decltype(d)::value, decltype(overwrite)::value>{},
                              a.scale, a.scale_tensor, a.found_inf);
      });
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CUDA, m) {
  m.impl("accumulate_", &accumulate_entry<run_accumulate>);
}

}  // namespace accumkernels::cuda

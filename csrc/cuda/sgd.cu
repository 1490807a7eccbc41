// sgd_step_and_zero_ on CUDA: torch.optim.SGD's update with
// g = grad_scale * buffer, then buffer = 0, one multi-tensor launch per param dtype.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../op_args.h"
#include "accumkernels/formulas.h"
#include "multi_tensor.cuh"
#include "step.cuh"

namespace accumkernels::cuda {
namespace {

// Lists: 0 param, 1 master, 2 buffer, 3 momentum buffer.
constexpr int kLists = 4;

template <Dtype P, bool kMaster, bool kStochastic, Momentum kMomentum>
struct SgdFunctor {
  __device__ void operator()(const Meta<kLists>& meta, int t, int64_t start, int64_t n, int,
                             SgdHyper h, StepScale scale, bool zero_buffers, uint32_t seed) {
    using T = typename Storage<P>::type;
    constexpr int N = kVec<T>;
    constexpr bool kHasMomentum = kMomentum != Momentum::kNone;
    float* buffer = chunk_floats(meta, 2, t, start);
    if (scale.skip()) {
      if (zero_buffers) zero_chunk(buffer, n);
      return;
    }
    const auto w = chunk_weights<P, kMaster, kStochastic>(meta, t, start, seed);
    float* mom = kHasMomentum ? chunk_floats(meta, 3, t, start) : nullptr;
    const float gs = scale.scale();
    const bool vector_ok = aligned_for_packs<N>(w) && aligned<float, N>(buffer) &&
                           (!kHasMomentum || aligned<float, N>(mom));
    for_chunk<N>(
        n, vector_ok,
        [&](int64_t i) {
          float g[N], b[N] = {}, p[N];
          load_pack<N>(g, buffer, i);
          if (kMomentum == Momentum::kRunning) load_pack<N>(b, mom, i);
          load_weights<N>(w, p, i);
#pragma unroll
          for (int k = 0; k < N; ++k) p[k] = sgd_update<kMomentum>(p[k], gs * g[k], b[k], h);
          store_weights<N>(w, i, p);
          if (kHasMomentum) store_pack<N>(mom, i, b);
          if (zero_buffers) {
            const float zeros[N] = {};
            store_pack<N>(buffer, i, zeros);
          }
        },
        [&](int64_t i) {
          float b = kMomentum == Momentum::kRunning ? mom[i] : 0.0f;
          w.store(i, sgd_update<kMomentum>(w.load(i), gs * buffer[i], b, h));
          if (kHasMomentum) mom[i] = b;
          if (zero_buffers) buffer[i] = 0.0f;
        });
  }
};

void run_sgd(const SgdArgs& a) {
  const c10::cuda::CUDAGuard guard(a.params[0].device());
  const bool master = !a.master_params.empty();
  for (const DtypeGroup& g :
       group_by_dtype(a.params, {a.params, a.master_params, a.buffers, a.momentum_buffers})) {
    with_weights_kind(g, master, a.sr.enabled, [&](auto p, auto m, auto sr) {
      with_momentum(a.momentum, [&](auto mode) {
        multi_tensor_apply<kLists>(
            g.pointers, g.numels, group_streams(g, a.sr),
            SgdFunctor<decltype(p)::value, decltype(m)::value, decltype(sr)::value,
                       decltype(mode)::value>{},
            a.hyper, a.scale, a.zero_buffers, a.sr.seed);
      });
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CUDA, m) { m.impl("sgd_step_and_zero_", &sgd_entry<run_sgd>); }

}  // namespace accumkernels::cuda

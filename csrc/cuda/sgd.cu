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

template <Dtype P, WeightsKind K, Dtype S, Momentum kMomentum>
struct SgdFunctor {
  __device__ void operator()(const Meta<kLists>& meta, int t, int64_t start, int64_t n, int,
                             SgdHyper h, StepScale scale, bool zero_buffers, uint32_t seed) {
    constexpr int N = kStepVec<P, S>;
    constexpr bool kHasMomentum = kMomentum != Momentum::kNone;
    float* buffer = chunk_floats(meta, 2, t, start);
    if (scale.skip()) {
      if (zero_buffers) zero_chunk(buffer, n);
      return;
    }
    const auto w = chunk_weights<P, K>(meta, t, start);
    const auto mom = chunk_state<S, 1>(meta, 3, t, start);
    const SrChunk sr = chunk_draws(meta, t, start, seed);
    const float gs = scale.scale();
    const bool vector_ok = aligned_for_packs<N>(w) && aligned<float, N>(buffer) &&
                           (!kHasMomentum || aligned_for_packs<N>(mom));
    for_chunk<N>(
        n, vector_ok,
        [&](int64_t i) {
          float g[N], b[N] = {}, p[N];
          load_pack<N>(g, buffer, i);
          if (kMomentum == Momentum::kRunning) load_state<N>(mom, b, i);
          load_weights<N>(w, p, i);
#pragma unroll
          for (int k = 0; k < N; ++k) p[k] = sgd_update<kMomentum>(p[k], gs * g[k], b[k], h);
          store_weights<N>(w, i, p, sr);
          if (kHasMomentum) store_state<N>(mom, i, b, sr);
          if (zero_buffers) {
            const float zeros[N] = {};
            store_pack<N>(buffer, i, zeros);
          }
        },
        [&](int64_t i) {
          float b = kMomentum == Momentum::kRunning ? mom.load(i) : 0.0f;
          w.store(i, sgd_update<kMomentum>(w.load(i), gs * buffer[i], b, h), sr);
          if (kHasMomentum) mom.store(i, b, sr);
          if (zero_buffers) buffer[i] = 0.0f;
        });
  }
};

void run_sgd(const SgdArgs& a) {
  const c10::cuda::CUDAGuard guard(a.params[0].device());
  for (const DtypeGroup& g :
       group_by_dtype(a.params, {a.params, a.master_params, a.buffers, a.momentum_buffers})) {
    with_step_kind(g, step_weights_kind(g.dtype, a.masters, a.sr), a.state_dtype, [&](auto p, auto k, auto s) {
      with_momentum(a.momentum, [&](auto mode) {
        multi_tensor_apply<kLists>(
            g.pointers, g.numels, group_streams(g, a.sr),
            SgdFunctor<decltype(p)::value, decltype(k)::value, decltype(s)::value,
                       decltype(mode)::value>{},
            a.hyper, a.scale, a.zero_buffers, a.sr.seed);
      });
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CUDA, m) { m.impl("sgd_step_and_zero_", &sgd_entry<run_sgd>); }

}  // namespace accumkernels::cuda

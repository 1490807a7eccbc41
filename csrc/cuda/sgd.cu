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

template <Dtype P, WeightsKind K, Dtype S, Momentum kMomentum, Dtype G>
struct SgdFunctor {
  __device__ void operator()(const Meta<kLists>& meta, int t, int64_t start, int64_t n, int,
                             SgdHyper h, StepScale scale, bool zero_buffers, uint32_t seed) {
    constexpr int N = kStepVec<P, S>;
    constexpr bool kHasMomentum = kMomentum != Momentum::kNone;
    auto* buffer = chunk_grads<G>(meta, t, start);
    if (scale.skip()) {
      if (zero_buffers) zero_chunk(buffer, n);
      return;
    }
    const auto w = chunk_weights<P, K>(meta, t, start);
    const auto mom = chunk_state<S, 1>(meta, 3, t, start);
    const SrChunk sr = chunk_draws(meta, t, start, seed);
    const float gs = scale.scale();
    const bool vector_ok = aligned_for_packs<N>(w) && aligned<typename Storage<G>::type, N>(buffer) &&
                           (!kHasMomentum || aligned_for_packs<N>(mom));
    for_chunk<N>(
        n, vector_ok,
        [&](int64_t i) {
          float g[N], b[N] = {}, p[N];
          load_grads<N, G>(g, buffer, i);
          if (kMomentum == Momentum::kRunning) load_state<N>(mom, b, i);
          load_weights<N>(w, p, i);
#pragma unroll
          for (int k = 0; k < N; ++k) p[k] = sgd_update<kMomentum>(p[k], gs * g[k], b[k], h);
          store_weights<N>(w, i, p, sr);
          if (kHasMomentum) store_state<N>(mom, i, b, sr);
          if (zero_buffers) zero_pack<N>(buffer, i);
        },
        [&](int64_t i) {
          float b = kMomentum == Momentum::kRunning ? mom.load(i) : 0.0f;
          w.store(i, sgd_update<kMomentum>(w.load(i), gs * Storage<G>::load(buffer[i]), b, h), sr);
          if (kHasMomentum) mom.store(i, b, sr);
          if (zero_buffers) buffer[i] = {};
        });
  }
};

// 8-bit momentum buffers (stored as exp_avg, formulas.h): lists as
// SgdFunctor's, then 4 their block scales; a warp per block, kPerLane adjacent
// elements a lane (step.cuh's Lane).
constexpr int kLists8 = 5;

template <Dtype P, WeightsKind K, Momentum kMomentum, Dtype G>
struct Sgd8Functor {
  __device__ void operator()(const Meta<kLists8>& meta, int t, int64_t start, int64_t n, int,
                             SgdHyper h, StepScale scale, bool zero_buffers, uint32_t seed) {
    auto* buffer = chunk_grads<G>(meta, t, start);
    if (scale.skip()) {
      if (zero_buffers) zero_chunk(buffer, n);
      return;
    }
    const auto w = chunk_weights<P, K>(meta, t, start);
    uint8_t* codes = static_cast<uint8_t*>(meta.addresses[3][t]) + start;
    float* scales = chunk_floats(meta, 4, t, start / kState8Block);
    const SrChunk sr = chunk_draws(meta, t, start, seed);
    const float gs = scale.scale();
    const bool vector_ok = aligned_for_lanes<P, K, G>(w, buffer, codes);
    const int lane = static_cast<int>(threadIdx.x) % kWarp;
    const int warps = static_cast<int>(blockDim.x) / kWarp;
    const int64_t blocks = (n + kState8Block - 1) / kState8Block;
    for (int64_t blk = threadIdx.x / kWarp; blk < blocks; blk += warps) {
      const Lane l(blk, lane, n, vector_ok);
      const float old_scale = scales[blk];
      float p[kPerLane], g[kPerLane], b_new[kPerLane];
      uint8_t c[kPerLane];
      lane_load_update_inputs<P, K, G>(l, w, buffer, p, g);
      if (kMomentum == Momentum::kRunning) lane_load_codes(l, codes, c);
      float b_max = 0.0f;
      bool b_nan = false;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        b_new[k] = 0.0f;
        if (k >= l.count) continue;
        float b = kMomentum == Momentum::kRunning ? decode_exp_avg(c[k], old_scale) : 0.0f;
        p[k] = sgd_update<kMomentum>(p[k], gs * g[k], b, h);
        b_new[k] = b;
        b_max = b_max > fabsf(b) ? b_max : fabsf(b);
        b_nan |= b != b;
      }
      lane_store_weights(l, w, p, sr, buffer, zero_buffers);
      const float new_scale = warp_block_scale(b_max, b_nan);
      const float divisor = state8_divisor(new_scale);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) c[k] = encode_exp_avg(b_new[k], divisor, sr_draw<1>(sr, l.first + k));
      lane_store_codes(l, codes, c);
      if (lane == 0) scales[blk] = new_scale;
    }
  }
};

void run_sgd(const SgdArgs& a) {
  const c10::cuda::CUDAGuard guard(a.params[0].device());
  if (a.state8) {
    for (const DtypeGroup& g : group_by_dtype(a.params, {a.params, a.master_params, a.buffers,
                                                        a.momentum_buffers, a.momentum_buffer_scales})) {
      with_step_kind(g, a.buffers, step_weights_kind(g.dtype, a.masters, a.sr), Dtype::kFloat32,
                     [&](auto p, auto k, auto, auto gd) {
        auto launch = [&](auto mode) {
          multi_tensor_apply<kLists8>(
              g.pointers, g.numels, group_streams(g, a.sr),
              Sgd8Functor<decltype(p)::value, decltype(k)::value, decltype(mode)::value, decltype(gd)::value>{},
              a.hyper, a.scale, a.zero_buffers, a.sr.seed);
        };
        if (a.momentum == Momentum::kRunning) {
          launch(std::integral_constant<Momentum, Momentum::kRunning>{});
        } else {
          launch(std::integral_constant<Momentum, Momentum::kFirstStep>{});
        }
      });
    }
    return;
  }
  for (const DtypeGroup& g :
       group_by_dtype(a.params, {a.params, a.master_params, a.buffers, a.momentum_buffers})) {
    with_step_kind(g, a.buffers, step_weights_kind(g.dtype, a.masters, a.sr), a.state_dtype,
                   [&](auto p, auto k, auto s, auto gd) {
      with_momentum(a.momentum, [&](auto mode) {
        multi_tensor_apply<kLists>(
            g.pointers, g.numels, group_streams(g, a.sr),
            SgdFunctor<decltype(p)::value, decltype(k)::value, decltype(s)::value,
                       decltype(mode)::value, decltype(gd)::value>{},
            a.hyper, a.scale, a.zero_buffers, a.sr.seed);
      });
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CUDA, m) { m.impl("sgd_step_and_zero_", &sgd_entry<run_sgd>); }

}  // namespace accumkernels::cuda

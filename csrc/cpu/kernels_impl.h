// The CPU loops, written once and compiled per ISA: kernels_<isa>.cpp includes
// this after a `#pragma GCC target(...)`, inside namespace
// accumkernels::cpu::AK_CPU_ISA so the variants never share a symbol. The
// loops are plain `#pragma omp simd` loops over the formulas of formulas.h;
// the compiler vectorizes them at the width of the target ISA.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "accumkernels/dispatch.h"
#include "accumkernels/formulas.h"
#include "kernels.h"

#ifndef AK_CPU_ISA
#error "define AK_CPU_ISA before including kernels_impl.h"
#endif

namespace accumkernels::cpu::AK_CPU_ISA {
namespace {

template <Dtype G, bool kOverwrite>
bool accumulate_loop(float* __restrict buffer, const typename Storage<G>::type* __restrict grad,
                     int64_t n, float scale) {
  uint32_t nonfinite = 0;
#pragma omp simd reduction(| : nonfinite)
  for (int64_t i = 0; i < n; ++i) {
    const float g = Storage<G>::load(grad[i]);
    nonfinite |= is_nonfinite(g) ? 1u : 0u;
    buffer[i] = accumulate<kOverwrite>(kOverwrite ? 0.0f : buffer[i], g, scale);
  }
  return nonfinite != 0;
}

bool accumulate_chunk(const AccumulateChunk& c) {
  bool nonfinite = false;
  with_dtype(c.grad_dtype, [&](auto g) {
    constexpr Dtype G = decltype(g)::value;
    using T = typename Storage<G>::type;
    with_bool(c.overwrite, [&](auto overwrite) {
      nonfinite = accumulate_loop<G, decltype(overwrite)::value>(
          c.buffer, static_cast<const T*>(c.grad), c.n, c.scale);
    });
  });
  return nonfinite;
}

// Weights live in `master` (fp32) when given, else in `param`; the updated
// weights are written to both. kStochastic: bf16 params rounded stochastically.
template <Dtype P, bool kMaster, bool kStochastic>
struct Weights {
  using T = typename Storage<P>::type;
  T* __restrict param;
  float* __restrict master;
  StochasticRounding sr;
  AK_HD float load(int64_t i) const { return kMaster ? master[i] : Storage<P>::load(param[i]); }
  AK_HD void store(int64_t i, float w) const {
    if (kMaster) master[i] = w;
    if constexpr (kStochastic) {
      param[i] = float_to_bf16_stochastic(
          w, sr_random(sr.seed, sr.tensor, static_cast<uint64_t>(sr.first + i)));
    } else {
      param[i] = Storage<P>::store(w);
    }
  }
};

template <Dtype P, bool kMaster, bool kStochastic, Momentum kMomentum, bool kNesterov,
          bool kWeightDecay, bool kZero>
void sgd_loop(const SgdChunk& c, const SgdHyper& h) {
  const Weights<P, kMaster, kStochastic> w{static_cast<typename Storage<P>::type*>(c.param),
                                           c.master, c.sr};
  float* __restrict buffer = c.buffer;
  float* __restrict momentum_buffer = c.momentum_buffer;
  const float grad_scale = c.grad_scale;
#pragma omp simd
  for (int64_t i = 0; i < c.n; ++i) {
    const float g = grad_scale * buffer[i];
    float b = kMomentum == Momentum::kRunning ? momentum_buffer[i] : 0.0f;
    w.store(i, sgd_update<kMomentum, kNesterov, kWeightDecay>(w.load(i), g, b, h));
    if (kMomentum != Momentum::kNone) momentum_buffer[i] = b;
    if (kZero) buffer[i] = 0.0f;
  }
}

void sgd_chunk(const SgdChunk& c, const SgdHyper& h, SgdFlags f) {
  with_dtype(c.param_dtype, [&](auto p) {
    with_bool(c.master != nullptr, [&](auto master) {
      with_stochastic<decltype(p)::value, decltype(master)::value>(c.sr.enabled, [&](auto sr) {
        with_momentum(f.momentum, [&](auto momentum) {
          with_bool(f.nesterov, [&](auto nesterov) {
            with_bool(f.weight_decay, [&](auto wd) {
              with_bool(c.zero_buffer, [&](auto zero) {
                sgd_loop<decltype(p)::value, decltype(master)::value, decltype(sr)::value,
                         decltype(momentum)::value, decltype(nesterov)::value, decltype(wd)::value,
                         decltype(zero)::value>(c, h);
              });
            });
          });
        });
      });
    });
  });
}

template <Dtype P, bool kMaster, bool kStochastic, bool kAdamW, bool kAmsgrad, bool kWeightDecay,
          bool kZero>
void adam_loop(const AdamChunk& c, const AdamHyper& h) {
  const Weights<P, kMaster, kStochastic> w{static_cast<typename Storage<P>::type*>(c.param),
                                           c.master, c.sr};
  float* __restrict buffer = c.buffer;
  float* __restrict exp_avg = c.exp_avg;
  float* __restrict exp_avg_sq = c.exp_avg_sq;
  float* __restrict max_exp_avg_sq = c.max_exp_avg_sq;
  const float grad_scale = c.grad_scale;
  const AdamStepScalars s = c.scalars;
#pragma omp simd
  for (int64_t i = 0; i < c.n; ++i) {
    const float g = grad_scale * buffer[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    float v_max = kAmsgrad ? max_exp_avg_sq[i] : 0.0f;
    w.store(i, adam_update<kAdamW, kAmsgrad, kWeightDecay>(w.load(i), g, m, v, v_max, h, s));
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (kAmsgrad) max_exp_avg_sq[i] = v_max;
    if (kZero) buffer[i] = 0.0f;
  }
}

void adam_chunk(const AdamChunk& c, const AdamHyper& h, AdamFlags f) {
  with_dtype(c.param_dtype, [&](auto p) {
    with_bool(c.master != nullptr, [&](auto master) {
      with_stochastic<decltype(p)::value, decltype(master)::value>(c.sr.enabled, [&](auto sr) {
        with_bool(f.adamw, [&](auto adamw) {
          with_bool(f.amsgrad, [&](auto amsgrad) {
            with_bool(f.weight_decay, [&](auto wd) {
              with_bool(c.zero_buffer, [&](auto zero) {
                adam_loop<decltype(p)::value, decltype(master)::value, decltype(sr)::value,
                          decltype(adamw)::value, decltype(amsgrad)::value, decltype(wd)::value,
                          decltype(zero)::value>(c, h);
              });
            });
          });
        });
      });
    });
  });
}

double sum_squares(const float* __restrict x, int64_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    sum += v * v;
  }
  return sum;
}

void zero(float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;
}

}  // namespace

const KernelTable& table() {
  static const KernelTable t{AK_CPU_ISA_NAME, accumulate_chunk, sgd_chunk, adam_chunk, sum_squares,
                             zero};
  return t;
}

}  // namespace accumkernels::cpu::AK_CPU_ISA

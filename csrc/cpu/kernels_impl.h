// The CPU loops, written once and compiled per ISA: kernels_<isa>.cpp includes
// this after a `#pragma GCC target(...)`, inside namespace
// accumkernels::cpu::AK_CPU_ISA so the variants never share a symbol. The
// loops are plain `#pragma omp simd` loops over the formulas of formulas.h;
// the compiler vectorizes them at the width of the target ISA. Template
// parameters are what changes the loop's loads and stores (param dtype,
// weights kind, state dtype, momentum mode, zeroing) and, for Adam, the
// update's flags (see StaticAdamFlags); SGD's flags are plain values.
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
bool accumulate_loop(float* AK_RESTRICT buffer, const typename Storage<G>::type* AK_RESTRICT grad,
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

bool accumulate_chunk(const AccumulateCall& call, const AccumulateChunk& c) {
  bool nonfinite = false;
  with_dtype(call.grad_dtype, [&](auto g) {
    constexpr Dtype G = decltype(g)::value;
    with_bool(call.overwrite, [&](auto overwrite) {
      nonfinite = accumulate_loop<G, decltype(overwrite)::value>(
          c.buffer, static_cast<const typename Storage<G>::type*>(c.grad), c.n, call.scale);
    });
  });
  return nonfinite;
}

template <Dtype P, WeightsKind K>
Weights<P, K> weights(const WeightsChunk& c) {
  return {static_cast<typename Storage<P>::type*>(c.param), c.master};
}

template <Dtype S, uint32_t kSlot>
State<S, kSlot> state(void* data) {
  return {static_cast<typename Storage<S>::type*>(data)};
}

// Calls f(Weights<...>{...}, std::integral_constant<Dtype, G>) with the
// weights type of this call and the dtype G of its buffers: fp32 sums, or
// gradients of the param's dtype (read as they are).
template <typename F>
void with_param_weights(const StepCall& call, const WeightsChunk& c, F&& f) {
  with_dtype(call.param_dtype, [&](auto p) {
    constexpr Dtype P = decltype(p)::value;
    with_weights_kind<P>(call.weights, [&](auto kind) {
      const auto w = weights<P, decltype(kind)::value>(c);
      with_grad_dtype<P>(call.grad_dtype, [&](auto g) { f(w, g); });
    });
  });
}

// Calls f(Weights<...>{...}, grad dtype, state dtype) for this call.
template <typename F>
void with_weights(const StepCall& call, const WeightsChunk& c, F&& f) {
  with_param_weights(call, c, [&](const auto& w, auto g) {
    with_state_dtype(call.state_dtype, [&](auto s) { f(w, g, s); });
  });
}

// The buffer of a chunk as G's storage type.
template <Dtype G>
typename Storage<G>::type* grads_of(void* buffer) {
  return static_cast<typename Storage<G>::type*>(buffer);
}

// The hyperparameters are copied into locals: read through a reference they
// might alias the arrays the loop writes, and the compiler would reload them
// (and branch on their flags) on every element instead of vectorizing.
template <Momentum kMomentum, bool kZero, Dtype G, typename W, typename St>
void sgd_loop(const W& weights_in, const St& momentum_in, const SrChunk& sr_in, const SgdChunk& c,
              float grad_scale, const SgdHyper& hyper) {
  const SgdHyper h = hyper;
  const W w = weights_in;
  const St mom = momentum_in;
  const SrChunk sr = sr_in;
  typename Storage<G>::type* AK_RESTRICT buffer = grads_of<G>(c.buffer);
  const int32_t n = static_cast<int32_t>(c.n);  // <= kChunk
#pragma omp simd
  for (int32_t i = 0; i < n; ++i) {
    const float g = grad_scale * Storage<G>::load(buffer[i]);
    float b = kMomentum == Momentum::kRunning ? mom.load(i) : 0.0f;
    w.store(i, sgd_update<kMomentum>(w.load(i), g, b, h), sr);
    if (kMomentum != Momentum::kNone) mom.store(i, b, sr);
    if (kZero) buffer[i] = typename Storage<G>::type{};
  }
}

// Runs f(block, first element, length) over the blocks of kState8Block
// elements of a chunk of n (which starts at a block boundary; the last block
// may be shorter). The lengths are int32: the 8-bit loops index from their
// block's first element with 32-bit k (64-bit index vectors spill, adam8_loop).
template <typename F>
inline __attribute__((always_inline)) void for_each_state8_block(int64_t n, F&& f) {
  for (int64_t b = 0; b * kState8Block < n; ++b) {
    const int64_t first = b * kState8Block;
    f(b, first, static_cast<int32_t>(n - first < kState8Block ? n - first : kState8Block));
  }
}

// SGD's momentum buffer in 8 bits (stored as exp_avg), as adam8_loop: per
// block, decode (a running buffer), update, encode.
template <Momentum kMomentum, bool kZero, Dtype G, typename W>
void sgd8_loop(const W& weights_in, const SrChunk& sr_in, const SgdChunk& c, float grad_scale,
               const SgdHyper& hyper) {
  const SgdHyper h = hyper;
  const W w = weights_in;
  const SrChunk sr = sr_in;
  alignas(64) float b_block[kState8Block];
  alignas(64) uint32_t draws[kState8Block];  // of rounding slot 1
  for_each_state8_block(c.n, [&](int64_t blk, int64_t first, int32_t n) {
    const W wb = w.at(first);
    const SrChunk srb = sr.at(first);
    typename Storage<G>::type* AK_RESTRICT buffer = grads_of<G>(c.buffer) + first;
    uint8_t* AK_RESTRICT codes = static_cast<uint8_t*>(c.momentum_buffer) + first;
    if (kMomentum == Momentum::kRunning) {
      const float scale = c.momentum_buffer_scales[blk];
#pragma omp simd
      for (int32_t k = 0; k < n; ++k) b_block[k] = decode_exp_avg(codes[k], scale);
    }
    uint32_t b_max = 0;  // of the magnitudes' bits (state8_abs_bits)
#pragma omp simd reduction(max : b_max)
    for (int32_t k = 0; k < n; ++k) {
      const float g = grad_scale * Storage<G>::load(buffer[k]);
      float b = kMomentum == Momentum::kRunning ? b_block[k] : 0.0f;
      wb.store(k, sgd_update<kMomentum>(wb.load(k), g, b, h), srb);
      const uint32_t b_abs = state8_abs_bits(b);
      b_block[k] = b;
      draws[k] = sr_draw<1>(srb, k);
      b_max = b_max > b_abs ? b_max : b_abs;
      if (kZero) buffer[k] = typename Storage<G>::type{};
    }
    const float scale_new = state8_block_scale_of_bits(b_max);
    const float divisor = state8_divisor(scale_new);
#pragma omp simd
    for (int32_t k = 0; k < n; ++k) codes[k] = encode_exp_avg(b_block[k], divisor, draws[k]);
    c.momentum_buffer_scales[blk] = scale_new;
  });
}

void sgd_chunk(const StepCall& call, const SgdHyper& h, Momentum momentum, const SgdChunk& c) {
  const SrChunk sr = sr_chunk(call.seed, c.weights.stream, c.weights.first);
  if (call.state8 && momentum != Momentum::kNone) {
    with_param_weights(call, c.weights, [&](const auto& w, auto g) {
      constexpr Dtype G = decltype(g)::value;
      with_bool(call.zero_buffers, [&](auto zero) {
        if (momentum == Momentum::kRunning) {
          sgd8_loop<Momentum::kRunning, decltype(zero)::value, G>(w, sr, c, call.grad_scale, h);
        } else {
          sgd8_loop<Momentum::kFirstStep, decltype(zero)::value, G>(w, sr, c, call.grad_scale, h);
        }
      });
    });
    return;
  }
  with_weights(call, c.weights, [&](const auto& w, auto g, auto s) {
    const auto mom = state<decltype(s)::value, 1>(c.momentum_buffer);
    with_momentum(momentum, [&](auto mode) {
      with_bool(call.zero_buffers, [&](auto zero) {
        sgd_loop<decltype(mode)::value, decltype(zero)::value, decltype(g)::value>(w, mom, sr, c,
                                                                                  call.grad_scale, h);
      });
    });
  });
}

template <typename Flags, bool kZero, Dtype G, typename W, typename M, typename V, typename VMax>
void adam_loop(const W& weights_in, const M& m_in, const V& v_in, const VMax& v_max_in, const SrChunk& sr_in,
               const AdamChunk& c, float grad_scale, const AdamHyper& hyper) {
  constexpr bool kAmsgrad = Flags::amsgrad;
  constexpr Flags flags{};
  const AdamHyper h = hyper;
  const W w = weights_in;
  const M exp_avg = m_in;
  const V exp_avg_sq = v_in;
  const VMax max_exp_avg_sq = v_max_in;
  const SrChunk sr = sr_in;
  typename Storage<G>::type* AK_RESTRICT buffer = grads_of<G>(c.buffer);
  const AdamStepScalars s = c.scalars;
  const int32_t n = static_cast<int32_t>(c.n);  // <= kChunk
#pragma omp simd
  for (int32_t i = 0; i < n; ++i) {
    const float g = grad_scale * Storage<G>::load(buffer[i]);
    float m = exp_avg.load(i);
    float v = exp_avg_sq.load(i);
    float v_max = kAmsgrad ? max_exp_avg_sq.load(i) : 0.0f;
    w.store(i, adam_update(w.load(i), g, m, v, v_max, h, s, flags), sr);
    exp_avg.store(i, m, sr);
    exp_avg_sq.store(i, v, sr);
    if (kAmsgrad) max_exp_avg_sq.store(i, v_max, sr);
    if (kZero) buffer[i] = typename Storage<G>::type{};
  }
}

// 8-bit state (formulas.h's decode_/encode_exp_avg and _exp_avg_sq), block by
// block in three loops over fp32 locals: decode the old moments; update them,
// step and store the param, and take the new moments' block maxima (exp_avg_sq
// as r = sqrt(v)), the new scales (state8_block_scale); encode. Why three
// loops, not one: a loop that reads uint8 codes is vectorized at 64 lanes, and
// with the whole update in it its fp32 values no longer fit the registers
// (measured 1.25x slower); and the loops index from the block's start with
// 32-bit k, as 64-bit index vectors spill too.
template <typename Flags, bool kZero, Dtype G, typename W>
void adam8_loop(const W& weights_in, const SrChunk& sr_in, const AdamChunk& c, float grad_scale,
                const AdamHyper& hyper) {
  constexpr Flags flags{};
  const AdamHyper h = hyper;
  const W w = weights_in;
  const SrChunk sr = sr_in;
  const AdamStepScalars s = c.scalars;
  alignas(64) float m_block[kState8Block];  // exp_avg: old, then new
  alignas(64) float v_block[kState8Block];  // exp_avg_sq: old v, then new r = sqrt(v)
  alignas(64) uint32_t draws[kState8Block];  // of rounding slots 1 and 2
  for_each_state8_block(c.n, [&](int64_t b, int64_t first, int32_t n) {
    const W wb = w.at(first);
    const SrChunk srb = sr.at(first);
    typename Storage<G>::type* AK_RESTRICT buffer = grads_of<G>(c.buffer) + first;
    uint8_t* AK_RESTRICT m_codes = static_cast<uint8_t*>(c.exp_avg) + first;
    uint8_t* AK_RESTRICT v_codes = static_cast<uint8_t*>(c.exp_avg_sq) + first;
    const float m_scale = c.exp_avg_scales[b];
    const float v_scale = c.exp_avg_sq_scales[b];
#pragma omp simd
    for (int32_t k = 0; k < n; ++k) {
      m_block[k] = decode_exp_avg(m_codes[k], m_scale);
      v_block[k] = decode_exp_avg_sq(v_codes[k], v_scale);
    }
    uint32_t m_max = 0;  // of the magnitudes' bits (state8_abs_bits)
    uint32_t r_max = 0;
#pragma omp simd reduction(max : m_max, r_max)
    for (int32_t k = 0; k < n; ++k) {
      const float g = grad_scale * Storage<G>::load(buffer[k]);
      float m = m_block[k];
      float v = v_block[k];
      float v_max = 0.0f;
      wb.store(k, adam_update(wb.load(k), g, m, v, v_max, h, s, flags), srb);
      const float r = __builtin_sqrtf(v);
      m_block[k] = m;
      v_block[k] = r;
      draws[k] = sr_draws_1_2(srb, k);
      const uint32_t m_abs = state8_abs_bits(m);
      const uint32_t r_abs = state8_abs_bits(r);
      m_max = m_max > m_abs ? m_max : m_abs;
      r_max = r_max > r_abs ? r_max : r_abs;
      if (kZero) buffer[k] = typename Storage<G>::type{};
    }
    const float m_scale_new = state8_block_scale_of_bits(m_max);
    const float r_scale_new = state8_block_scale_of_bits(r_max);
    const float m_divisor = state8_divisor(m_scale_new);
    const float r_divisor = state8_divisor(r_scale_new);
#pragma omp simd
    for (int32_t k = 0; k < n; ++k) {
      m_codes[k] = encode_exp_avg(m_block[k], m_divisor, draws[k]);
      v_codes[k] = encode_exp_avg_sq(v_block[k], r_divisor, draws[k] >> sr_slot_shift(2));
    }
    c.exp_avg_scales[b] = m_scale_new;
    c.exp_avg_sq_scales[b] = r_scale_new;
  });
}

void adam8_chunk(const StepCall& call, const AdamHyper& h, const AdamChunk& c, const SrChunk& sr) {
  with_param_weights(call, c.weights, [&](const auto& w, auto g) {
    with_bool(h.adamw, [&](auto adamw) {
      with_bool(h.has_weight_decay, [&](auto wd) {
        with_bool(call.zero_buffers, [&](auto zero) {
          using Flags = StaticAdamFlags<decltype(adamw)::value, false, decltype(wd)::value>;
          adam8_loop<Flags, decltype(zero)::value, decltype(g)::value>(w, sr, c, call.grad_scale, h);
        });
      });
    });
  });
}

void adam_chunk(const StepCall& call, const AdamHyper& h, const AdamChunk& c) {
  const SrChunk sr = sr_chunk(call.seed, c.weights.stream, c.weights.first);
  if (call.state8) {
    adam8_chunk(call, h, c, sr);
    return;
  }
  with_weights(call, c.weights, [&](const auto& w, auto g, auto state_dtype) {
    constexpr Dtype G = decltype(g)::value;
    constexpr Dtype S = decltype(state_dtype)::value;
    const auto m = state<S, 1>(c.exp_avg);
    const auto v = state<S, 2>(c.exp_avg_sq);
    const auto v_max = state<S, 3>(c.max_exp_avg_sq);
    with_bool(h.adamw, [&](auto adamw) {
      with_bool(h.amsgrad, [&](auto amsgrad) {
        with_bool(h.has_weight_decay, [&](auto wd) {
          with_bool(call.zero_buffers, [&](auto zero) {
            using Flags = StaticAdamFlags<decltype(adamw)::value, decltype(amsgrad)::value,
                                          decltype(wd)::value>;
            adam_loop<Flags, decltype(zero)::value, G>(w, m, v, v_max, sr, c, call.grad_scale, h);
          });
        });
      });
    });
  });
}

template <Dtype D>
double sum_squares_of(const typename Storage<D>::type* AK_RESTRICT x, int64_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const double v = Storage<D>::load(x[i]);
    sum += v * v;
  }
  return sum;
}

double sum_squares(Dtype d, const void* x, int64_t n) {
  double sum = 0.0;
  with_dtype(d, [&](auto dtype) {
    constexpr Dtype D = decltype(dtype)::value;
    sum = sum_squares_of<D>(static_cast<const typename Storage<D>::type*>(x), n);
  });
  return sum;
}

void zero(float* AK_RESTRICT x, int64_t n) {
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

// Run-time values to compile-time constants: with_bool(b, f) calls
// f(std::bool_constant<b>), and likewise for the storage dtype, the momentum
// mode and stochastic rounding, so kernels are templates on everything that
// changes their inner loop. Shared by the CPU and CUDA host code.
#pragma once

#include <type_traits>

#include "accumkernels/formulas.h"

namespace accumkernels {

template <typename F>
void with_bool(bool b, F&& f) {
  if (b) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

template <typename F>
void with_dtype(Dtype d, F&& f) {
  switch (d) {
    case Dtype::kFloat32:
      f(std::integral_constant<Dtype, Dtype::kFloat32>{});
      break;
    case Dtype::kBFloat16:
      f(std::integral_constant<Dtype, Dtype::kBFloat16>{});
      break;
    case Dtype::kFloat16:
      f(std::integral_constant<Dtype, Dtype::kFloat16>{});
      break;
  }
}

template <typename F>
void with_momentum(Momentum m, F&& f) {
  switch (m) {
    case Momentum::kNone:
      f(std::integral_constant<Momentum, Momentum::kNone>{});
      break;
    case Momentum::kFirstStep:
      f(std::integral_constant<Momentum, Momentum::kFirstStep>{});
      break;
    case Momentum::kRunning:
      f(std::integral_constant<Momentum, Momentum::kRunning>{});
      break;
  }
}

// Only bf16 params without master weights are ever rounded stochastically, so
// only they get that variant.
template <Dtype P, bool kMaster, typename F>
void with_stochastic(bool enabled, F&& f) {
  if constexpr (P == Dtype::kBFloat16 && !kMaster) {
    with_bool(enabled, f);
  } else {
    f(std::false_type{});
  }
}

}  // namespace accumkernels

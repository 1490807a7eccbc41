// Run-time values to compile-time constants: with_bool(b, f) calls
// f(std::bool_constant<b>), and likewise for the storage dtype, the momentum
// mode, the weights kind, the state dtype and a step's grad dtype, so kernels are templates on everything that
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

// The weights kinds a param dtype has (accumkernels.ops refuses the others):
// fp32 params are their own weights; bf16 params all four kinds; fp16 params
// their own (rounded to nearest) or an fp32 master copy.
template <Dtype P, typename F>
void with_weights_kind(WeightsKind k, F&& f) {
  using K = WeightsKind;
  if constexpr (P == Dtype::kBFloat16) {
    switch (k) {
      case K::kParam:
        f(std::integral_constant<K, K::kParam>{});
        break;
      case K::kStochastic:
        f(std::integral_constant<K, K::kStochastic>{});
        break;
      case K::kMaster:
        f(std::integral_constant<K, K::kMaster>{});
        break;
      case K::kRemainder:
        f(std::integral_constant<K, K::kRemainder>{});
        break;
    }
  } else if constexpr (P == Dtype::kFloat16) {
    if (k == K::kMaster) {
      f(std::integral_constant<K, K::kMaster>{});
    } else {
      f(std::integral_constant<K, K::kParam>{});
    }
  } else {
    f(std::integral_constant<K, K::kParam>{});
  }
}

// State is stored in fp32 or bf16.
template <typename F>
void with_state_dtype(Dtype d, F&& f) {
  if (d == Dtype::kBFloat16) {
    f(std::integral_constant<Dtype, Dtype::kBFloat16>{});
  } else {
    f(std::integral_constant<Dtype, Dtype::kFloat32>{});
  }
}

// A step's buffers over params of dtype P hold fp32 sums or gradients of P:
// calls f(std::integral_constant<Dtype, G>) with the one of the two that
// `grad_dtype` names (for fp32 params they are the same).
template <Dtype P, typename F>
void with_grad_dtype(Dtype grad_dtype, F&& f) {
  if constexpr (P == Dtype::kFloat32) {
    f(std::integral_constant<Dtype, P>{});
  } else if (grad_dtype == Dtype::kFloat32) {
    f(std::integral_constant<Dtype, Dtype::kFloat32>{});
  } else {
    f(std::integral_constant<Dtype, P>{});
  }
}

}  // namespace accumkernels

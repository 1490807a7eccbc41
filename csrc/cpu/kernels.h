// Torch-free interface between the CPU op entry points (csrc/cpu/<op>.cpp) and
// the vectorized loops, which are compiled once per ISA (kernels_<isa>.cpp) and
// chosen at run time. Every pointer here is already offset to the chunk start.
#pragma once

#include <cstdint>

#include "accumkernels/formulas.h"

namespace accumkernels::cpu {

// Where the chunk's elements sit, for the random bits of stochastic rounding
// (bf16 params without master weights only).
struct StochasticRounding {
  bool enabled;
  uint32_t seed;
  uint32_t tensor;  // position in the op's list
  int64_t first;    // index of the chunk's first element in its tensor
};

struct AccumulateChunk {
  float* buffer;
  const void* grad;
  Dtype grad_dtype;
  int64_t n;
  float scale;
  bool overwrite;
};

struct SgdChunk {
  void* param;
  Dtype param_dtype;
  float* master;  // nullptr: the param itself holds the weights
  float* buffer;
  float* momentum_buffer;  // nullptr when momentum == 0
  int64_t n;
  float grad_scale;  // negated for maximize
  bool zero_buffer;
  StochasticRounding sr;
};

struct SgdFlags {
  Momentum momentum;
  bool nesterov;
  bool weight_decay;
};

struct AdamChunk {
  void* param;
  Dtype param_dtype;
  float* master;  // nullptr: the param itself holds the weights
  float* buffer;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr unless amsgrad
  int64_t n;
  float grad_scale;  // negated for maximize
  AdamStepScalars scalars;
  bool zero_buffer;
  StochasticRounding sr;
};

struct AdamFlags {
  bool adamw;
  bool amsgrad;
  bool weight_decay;
};

// One set of loops for one instruction set.
struct KernelTable {
  const char* isa;
  // Returns true if any grad element is inf or NaN.
  bool (*accumulate)(const AccumulateChunk&);
  void (*sgd)(const SgdChunk&, const SgdHyper&, SgdFlags);
  void (*adam)(const AdamChunk&, const AdamHyper&, AdamFlags);
  // Sum of squares in double, in a fixed order for a given n.
  double (*sum_squares)(const float*, int64_t);
  void (*zero)(float*, int64_t);
};

// The best table this CPU supports, or the one named by the environment
// variable ACCUMKERNELS_CPU_ISA (default, avx2, avx512); chosen once.
const KernelTable& kernels();

// The tables compiled into this build, for the dispatcher.
const KernelTable& kernels_default();
#if defined(__x86_64__)
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512();
#endif

}  // namespace accumkernels::cpu

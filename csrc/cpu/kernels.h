// Torch-free interface between the CPU op entry points (csrc/cpu/<op>.cpp) and
// the vectorized loops, which are compiled once per ISA (kernels_<isa>.cpp) and
// chosen at run time. A call describes what is the same for every chunk of one
// dtype group; a chunk holds pointers already offset to its first element.
#pragma once

#include <cstdint>

#include "accumkernels/formulas.h"

namespace accumkernels::cpu {

// The ops cut their tensors into chunks of at most kChunk elements
// (parallel.h), and a kernel call gets one chunk: the step loops index it with
// int32: with a 64-bit index the rounding hashes' index vectors take twice
// the registers and instructions (measured: 6% more arithmetic in the
// bf16-state AdamW step on AVX-512).
constexpr int64_t kChunk = int64_t{1} << 16;

struct AccumulateCall {
  Dtype grad_dtype;
  bool overwrite;
  float scale;
};

struct AccumulateChunk {
  float* buffer;
  const void* grad;
  int64_t n;
};

// What every step chunk shares: the weights (param, optional master weights
// or remainders) and where the chunk sits, for the bits of stochastic rounding.
struct WeightsChunk {
  void* param;
  void* master;     // fp32 masters or int16 remainders (by StepCall::weights); else nullptr
  uint32_t stream;  // the param's stream id
  int64_t first;    // index of the chunk's first element in the param (chunks
                    // never cross a multiple of 2^32: see SrChunk)
};

struct StepCall {
  Dtype param_dtype;
  WeightsKind weights;
  Dtype grad_dtype;   // of the chunks' buffers: fp32 sums, or gradients of the param's dtype
  Dtype state_dtype;  // of every state tensor of the call: fp32 or bf16 (fp32 when state8)
  bool state8;        // the state tensors are 8-bit codes with block scales
  uint32_t seed;
  float grad_scale;  // grad_scale * grad_scale_tensor, read once per call
  bool zero_buffers;
};

// Buffer pointers are of StepCall::grad_dtype, state pointers of StepCall::state_dtype.
struct SgdChunk {
  WeightsChunk weights;
  void* buffer;
  void* momentum_buffer;  // nullptr when momentum == 0
  // 8-bit state (StepCall::state8): momentum_buffer holds uint8 codes, these
  // their blocks' scales from the chunk's first block on; else nullptr.
  float* momentum_buffer_scales;
  int64_t n;
};

struct AdamChunk {
  WeightsChunk weights;
  void* buffer;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // nullptr unless amsgrad
  // 8-bit state (StepCall::state8): exp_avg and exp_avg_sq are uint8 codes,
  // these their blocks' scales from the chunk's first block on (an 8-bit
  // chunk starts at a block boundary of its tensor); else nullptr.
  float* exp_avg_scales;
  float* exp_avg_sq_scales;
  int64_t n;
  AdamStepScalars scalars;
};

// One set of loops for one instruction set.
struct KernelTable {
  const char* isa;
  // Returns true if any grad element is inf or NaN.
  bool (*accumulate)(const AccumulateCall&, const AccumulateChunk&);
  void (*sgd)(const StepCall&, const SgdHyper&, Momentum, const SgdChunk&);
  void (*adam)(const StepCall&, const AdamHyper&, const AdamChunk&);
  // Sum of squares in double of n values stored as the dtype (fp32, bf16,
  // fp16; each square exact), in a fixed order for a given n.
  double (*sum_squares)(Dtype, const void*, int64_t);
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

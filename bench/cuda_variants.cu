// Variants of the CUDA AdamW steps, built apart from the extension by
// bench/cuda_variants.py to time on a GPU which change moves a step toward
// the memory bound before it goes into csrc/cuda/adam.cuh. Three groups, all
// on bf16 params with stochastic rounding, from the fp32 buffer:
//
// "defaults" (bf16 state) and "fp32 state" (the defaults' yardstick in issue
// #27): csrc's AdamFunctor as the extension launches it, and
// SrStep<S, kPacks, kPipelined, kStaticFlags, kMath>, the same step with
//   kPacks        packs of 8 elements a thread loads before its arithmetic
//                 (AdamFunctor: 1)
//   kPipelined    the next iteration's packs loaded before this one's
//                 arithmetic, so loads are in flight while a warp computes
//   kStaticFlags  AdamW's flags (decoupled weight decay on, amsgrad off) as
//                 template constants: no branch on them in the loop
//   kMath         kStep: the step; kNearest: the step rounded to nearest
//                 (no hashes: the stochastic rounding's cost); kMemory: the
//                 same loads and stores around a single add (the access
//                 pattern's own time)
// "8bit" (8-bit state): csrc's Adam8Functor.
//
// Each runs over csrc's chunks of kChunk elements, a block each (for one
// tensor of whole chunks, what multi_tensor_apply launches), in blocks of
// kThreads under __launch_bounds__(kThreads, kMinBlocks) (kMinBlocks 0: no
// minimum named): the extension's are 512 threads and no minimum; a minimum
// of 2 caps a 512-thread block at 64 registers, so that two fit an SM. Every
// variant that computes the step does so with formulas.h's functions, so it
// gives the extension's bits.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "accumkernels/formulas.h"
#include "cuda/adam.cuh"
#include "cuda/multi_tensor.cuh"
#include "cuda/step.cuh"

namespace accumkernels::cuda {
namespace {

constexpr int kN = 8;  // elements a pack: 16 bytes of bf16
enum Math : int { kStep = 0, kNearest = 1, kMemory = 2 };

// One pack's inputs as loaded: fp32 sums, exp_avg and exp_avg_sq in the
// state's storage type, bf16 params.
template <Dtype S>
struct RawPack {
  using T = typename Storage<S>::type;
  float g[kN];
  T m[kN], v[kN];
  uint16_t p[kN];
};

template <Dtype S>
__device__ __forceinline__ void load_raw(RawPack<S>& r, const float* buffer, const typename RawPack<S>::T* m,
                                         const typename RawPack<S>::T* v, const uint16_t* p, int64_t i) {
  load_pack<kN>(r.g, buffer, i);
  load_pack<kN>(r.m, m, i);
  load_pack<kN>(r.v, v, i);
  load_pack<kN>(r.p, p, i);
}

template <Dtype S, int kPacks, bool kPipelined, bool kStaticFlags, int kMath>
struct SrStep {
  static constexpr Dtype P = Dtype::kBFloat16;
  static constexpr WeightsKind K = WeightsKind::kStochastic;

  __device__ void operator()(const Meta<kAdamLists>& meta, int t, int64_t start, int64_t n, int, AdamHyper h,
                             StepScale scale, bool, uint32_t seed) {
    float* buffer = chunk_grads<Dtype::kFloat32>(meta, t, start);
    const auto w = chunk_weights<P, K>(meta, t, start);
    const auto exp_avg = chunk_state<S, 1>(meta, 3, t, start);
    const auto exp_avg_sq = chunk_state<S, 2>(meta, 4, t, start);
    const SrChunk sr = chunk_draws(meta, t, start, seed);
    const float step = *static_cast<const float*>(meta.addresses[6][t]);
    const AdamStepScalars s = adam_bias_corrections(h, step);
    const float gs = scale.scale();
    const int64_t stride = static_cast<int64_t>(blockDim.x) * kN;  // between a thread's packs
    const int64_t advance = stride * kPacks;                       // an iteration
    auto compute_store = [&](const RawPack<S>& r, int64_t i) {
      float p[kN], m[kN], v[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        p[k] = Storage<P>::load(r.p[k]);
        m[k] = Storage<S>::load(r.m[k]);
        v[k] = Storage<S>::load(r.v[k]);
        float vm = 0.0f;
        if constexpr (kMath == kMemory) {
          p[k] = p[k] + r.g[k];
        } else if constexpr (kStaticFlags) {
          p[k] = adam_update(p[k], gs * r.g[k], m[k], v[k], vm, h, s, StaticAdamFlags<true, false, true>{});
        } else {
          p[k] = adam_update(p[k], gs * r.g[k], m[k], v[k], vm, h, s, adam_flags(h));
        }
      }
      if constexpr (kMath == kStep) {
        store_weights<kN>(w, i, p, sr);
        store_state<kN>(exp_avg, i, m, sr);
        store_state<kN>(exp_avg_sq, i, v, sr);
      } else {
        uint16_t pp[kN];
        typename RawPack<S>::T mm[kN], vv[kN];
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          pp[k] = Storage<P>::store(p[k]);
          mm[k] = Storage<S>::store(m[k]);
          vv[k] = Storage<S>::store(v[k]);
        }
        store_pack<kN>(w.param, i, pp);
        store_pack<kN>(exp_avg.data, i, mm);
        store_pack<kN>(exp_avg_sq.data, i, vv);
      }
      zero_pack<kN>(buffer, i);
    };
    // The host checks that every chunk is a whole number of iterations.
    int64_t i = static_cast<int64_t>(threadIdx.x) * kN;
    if constexpr (kPipelined) {
      RawPack<S> next[kPacks];
#pragma unroll
      for (int j = 0; j < kPacks; ++j) load_raw(next[j], buffer, exp_avg.data, exp_avg_sq.data, w.param, i + j * stride);
      for (; i < n; i += advance) {
        RawPack<S> cur[kPacks];
#pragma unroll
        for (int j = 0; j < kPacks; ++j) cur[j] = next[j];
        if (i + advance < n) {
#pragma unroll
          for (int j = 0; j < kPacks; ++j) {
            load_raw(next[j], buffer, exp_avg.data, exp_avg_sq.data, w.param, i + advance + j * stride);
          }
        }
#pragma unroll
        for (int j = 0; j < kPacks; ++j) compute_store(cur[j], i + j * stride);
      }
    } else {
      for (; i < n; i += advance) {
        RawPack<S> cur[kPacks];
#pragma unroll
        for (int j = 0; j < kPacks; ++j) load_raw(cur[j], buffer, exp_avg.data, exp_avg_sq.data, w.param, i + j * stride);
#pragma unroll
        for (int j = 0; j < kPacks; ++j) compute_store(cur[j], i + j * stride);
      }
    }
  }
};

// multi_tensor_kernel's body (run_block_chunk, the chunk's length a run-time
// value, as there) under other launch bounds: kMinBlocks 0 names none, as
// multi_tensor_kernel (ptxas then keeps the extension's register counts; an
// explicit minimum of 1 lets it take more).
template <int D, typename Step, int kThreads>
__global__ void __launch_bounds__(kThreads)
    bounded_kernel(const Meta<D> meta, Step step, AdamHyper h, StepScale scale, bool zero_buffers, uint32_t seed) {
  run_block_chunk(meta, step, h, scale, zero_buffers, seed);
}

template <int D, typename Step, int kThreads, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    min_blocks_kernel(const Meta<D> meta, Step step, AdamHyper h, StepScale scale, bool zero_buffers, uint32_t seed) {
  run_block_chunk(meta, step, h, scale, zero_buffers, seed);
}

template <int D, typename Step, int kThreads, int kMinBlocks>
constexpr auto variant_kernel() {
  if constexpr (kMinBlocks == 0) {
    return bounded_kernel<D, Step, kThreads>;
  } else {
    return min_blocks_kernel<D, Step, kThreads, kMinBlocks>;
  }
}

// A variant: its name, its group, whether it computes the step (and so gives
// the extension's bits), its launch over one tensor of each of its lists (n
// elements, whole chunks) and its kernel's resources on the current device.
struct Variant {
  const char* name;
  const char* group;
  bool same_bits;
  int lists;
  void (*launch)(const std::vector<void*>&, int64_t, AdamHyper, StepScale, uint32_t);
  std::tuple<int, int, int> (*resources)();
};

template <int D, typename Step, int kThreads, int kMinBlocks>
void launch(const std::vector<void*>& lists, int64_t n, AdamHyper h, StepScale scale, uint32_t seed) {
  auto meta = std::make_unique<Meta<D>>();  // 32 KB: not on the host stack
  for (int d = 0; d < D; ++d) meta->addresses[d][0] = lists[d];
  meta->numel[0] = n;
  meta->stream[0] = 0;  // the op's stream id of its first (only) param
  meta->first_global_chunk = 0;
  for (int64_t b = 0; b < n / kChunk; ++b) {
    meta->block_to_tensor[b] = 0;
    meta->block_to_chunk[b] = static_cast<int>(b);
  }
  variant_kernel<D, Step, kThreads, kMinBlocks>()<<<static_cast<unsigned>(n / kChunk), kThreads, 0,
                                                    c10::cuda::getCurrentCUDAStream()>>>(*meta, Step{}, h, scale, true,
                                                                                         seed);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// (registers a thread, local memory bytes a thread (spills), resident blocks an SM).
template <int D, typename Step, int kThreads, int kMinBlocks>
std::tuple<int, int, int> resources() {
  const auto kernel = variant_kernel<D, Step, kThreads, kMinBlocks>();
  cudaFuncAttributes attributes;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
  return {attributes.numRegs, static_cast<int>(attributes.localSizeBytes), blocks};
}

template <int D, typename Step, int kThreads = kBlock, int kMinBlocks = 0>
Variant variant(const char* name, const char* group, bool same_bits) {
  return {name, group, same_bits, D, launch<D, Step, kThreads, kMinBlocks>, resources<D, Step, kThreads, kMinBlocks>};
}

template <Dtype S, int kPacks, bool kPipelined, bool kStaticFlags, int kMath, int kThreads = kBlock,
          int kMinBlocks = 0>
Variant sr_step(const char* name) {
  return variant<kAdamLists, SrStep<S, kPacks, kPipelined, kStaticFlags, kMath>, kThreads, kMinBlocks>(
      name, S == Dtype::kBFloat16 ? "defaults" : "fp32 state", kMath == kStep);
}

constexpr Dtype kBf16 = Dtype::kBFloat16;
constexpr Dtype kFp32 = Dtype::kFloat32;
using CsrcDefaults = AdamFunctor<kBf16, WeightsKind::kStochastic, kBf16, kFp32>;
using CsrcFp32State = AdamFunctor<kBf16, WeightsKind::kStochastic, kFp32, kFp32>;
using Csrc8bit = Adam8Functor<kBf16, WeightsKind::kStochastic, kFp32>;

const std::vector<Variant>& all_variants() {
  static const std::vector<Variant> variants = {
      variant<kAdamLists, CsrcDefaults>("csrc's AdamFunctor", "defaults", true),
      sr_step<kBf16, 1, false, true, kStep>("static flags"),
      sr_step<kBf16, 1, false, true, kStep, 256>("static flags, 256 threads"),
      sr_step<kBf16, 1, true, true, kStep>("pipelined, static flags"),
      sr_step<kBf16, 1, true, true, kStep, 256, 3>("pipelined, static flags, 256 threads, 3 blocks an SM"),
      sr_step<kBf16, 2, false, true, kStep, 512, 2>("2 packs, static flags, 2 blocks an SM"),
      sr_step<kBf16, 2, false, false, kStep, 512, 2>("2 packs, runtime flags, 2 blocks an SM"),
      sr_step<kBf16, 1, false, true, kNearest>("round to nearest (no hashes), static flags"),
      sr_step<kBf16, 1, false, true, kMemory>("memory only (loads, one add, stores)"),
      variant<kAdamLists, CsrcFp32State>("csrc's AdamFunctor", "fp32 state", true),
      sr_step<kFp32, 1, false, true, kStep>("static flags"),
      sr_step<kFp32, 1, false, true, kStep, 256>("static flags, 256 threads"),
      sr_step<kFp32, 1, true, true, kStep, 256, 3>("pipelined, static flags, 256 threads, 3 blocks an SM"),
      sr_step<kFp32, 2, false, true, kStep, 512, 2>("2 packs, static flags, 2 blocks an SM"),
      sr_step<kFp32, 1, false, true, kMemory>("memory only (loads, one add, stores)"),
      variant<kAdam8Lists, Csrc8bit>("csrc's Adam8Functor", "8bit", true),
      variant<kAdam8Lists, Csrc8bit, 512, 2>("Adam8Functor, 2 blocks an SM", "8bit", true),
      variant<kAdam8Lists, Csrc8bit, 256>("Adam8Functor, 256 threads", "8bit", true),
      variant<kAdam8Lists, Csrc8bit, 256, 4>("Adam8Functor, 256 threads, 4 blocks an SM", "8bit", true),
  };
  return variants;
}

// (name, group, same_bits) of each variant, by index.
std::vector<std::tuple<std::string, std::string, bool>> variants() {
  std::vector<std::tuple<std::string, std::string, bool>> out;
  for (const auto& v : all_variants()) out.emplace_back(v.name, v.group, v.same_bits);
  return out;
}

// Variant `index`, or an error naming the index.
const Variant& variant_at(int64_t index) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(all_variants().size()), "no variant ", index);
  return all_variants()[index];
}

std::tuple<int, int, int> resources_of(int64_t index) { return variant_at(index).resources(); }

// Variant `index`'s AdamW step over its lists (one tensor each, in the
// extension's list order; None where the list is empty), with the
// extension's op's meaning; the step tensor holds the step count the update
// uses (the op counts it itself first).
void run(int64_t index, const std::vector<std::optional<at::Tensor>>& tensors, double lr, double beta1, double beta2,
         double eps, double weight_decay, int64_t seed) {
  const Variant& v = variant_at(index);
  TORCH_CHECK(static_cast<int>(tensors.size()) == v.lists, v.name, " takes ", v.lists, " lists");
  TORCH_CHECK(tensors[0].has_value() && tensors[0]->is_cuda(), "list 0 (the param) must be a CUDA tensor");
  const int64_t n = tensors[0]->numel();
  TORCH_CHECK(n % kChunk == 0 && n / kChunk <= kMaxBlocks, "numel must be a whole number of chunks of ", kChunk,
              ", at most ", kMaxBlocks, " of them (one launch)");
  std::vector<void*> lists;
  for (const auto& t : tensors) {
    TORCH_CHECK(!t.has_value() || (t->is_cuda() && t->is_contiguous()), "every tensor contiguous on CUDA");
    lists.push_back(t.has_value() ? t->data_ptr() : nullptr);
  }
  const c10::cuda::CUDAGuard guard(tensors[0]->device());
  const AdamHyper h = make_adam_hyper(lr, beta1, beta2, eps, weight_decay, true, false);
  v.launch(lists, n, h, StepScale{1.0f, nullptr, nullptr}, static_cast<uint32_t>(seed));
}

}  // namespace
}  // namespace accumkernels::cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("variants", &accumkernels::cuda::variants);
  m.def("resources", &accumkernels::cuda::resources_of);
  m.def("run", &accumkernels::cuda::run);
}

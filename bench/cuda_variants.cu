// Variants of the CUDA defaults step (adamw_step_and_zero_ on bf16 params with
// bf16 state, stochastic rounding, from an fp32 buffer), built apart from the
// extension by bench/cuda_variants.py to time on a GPU which change moves the
// step toward the memory bound before one goes into csrc/cuda/adam.cu. Every
// variant runs formulas.h's functions (adam_update, the Weights and State
// roundings, the chunk's draws) over csrc/cuda's chunks of kChunk elements,
// a block each (for one tensor of whole chunks, what multi_tensor_apply
// launches), so the ones that compute the step give the extension's bits; the
// last two leave parts out to time what is left.
//
// A variant is DefaultsStep<kPacks, kPipelined, kStaticFlags, kMath> run by
// blocks of kThreads with __launch_bounds__(kThreads, kMinBlocks) (csrc: 512
// threads, no minimum; a minimum of 2 caps a 512-thread block's registers at
// 64, so that two blocks fit an SM):
//   kPacks        packs of 8 elements a thread loads before its arithmetic
//                 (csrc's AdamFunctor: 1)
//   kPipelined    the next iteration's packs are loaded before this one's
//                 arithmetic, so loads are in flight while a warp computes
//   kStaticFlags  AdamW's flags (decoupled weight decay on, amsgrad off) as
//                 template constants: no branch on them in the loop
//   kMath         kStep: the step; kNearest: the step rounded to nearest
//                 (no hashes: the stochastic rounding's cost); kMemory: the
//                 same loads and stores around a single add (the access
//                 pattern's own time)
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "accumkernels/formulas.h"
#include "cuda/multi_tensor.cuh"
#include "cuda/step.cuh"

namespace accumkernels::cuda {
namespace {

constexpr int kLists = 7;  // as adam.cu's: 0 param, 1 master, 2 buffer, 3 exp_avg, 4 exp_avg_sq, 5 max, 6 step
constexpr int kN = 8;      // elements a pack: 16 bytes of bf16
enum Math : int { kStep = 0, kNearest = 1, kMemory = 2 };

// One pack's inputs as loaded: fp32 sums, bf16 exp_avg, exp_avg_sq and param.
struct RawPack {
  float g[kN];
  uint16_t m[kN], v[kN], p[kN];
};

__device__ __forceinline__ void load_raw(RawPack& r, const float* buffer, const uint16_t* m, const uint16_t* v,
                                         const uint16_t* p, int64_t i) {
  load_pack<kN>(r.g, buffer, i);
  load_pack<kN>(r.m, m, i);
  load_pack<kN>(r.v, v, i);
  load_pack<kN>(r.p, p, i);
}

template <int kPacks, bool kPipelined, bool kStaticFlags, int kMath>
struct DefaultsStep {
  static constexpr Dtype P = Dtype::kBFloat16;
  static constexpr WeightsKind K = WeightsKind::kStochastic;

  __device__ void operator()(const Meta<kLists>& meta, int t, int64_t start, int64_t n, int, AdamHyper h,
                             StepScale scale, bool, uint32_t seed) {
    float* buffer = chunk_grads<Dtype::kFloat32>(meta, t, start);
    const auto w = chunk_weights<P, K>(meta, t, start);
    const auto exp_avg = chunk_state<Dtype::kBFloat16, 1>(meta, 3, t, start);
    const auto exp_avg_sq = chunk_state<Dtype::kBFloat16, 2>(meta, 4, t, start);
    const SrChunk sr = chunk_draws(meta, t, start, seed);
    const float step = *static_cast<const float*>(meta.addresses[6][t]);
    const AdamStepScalars s = adam_bias_corrections(h, step);
    const float gs = scale.scale();
    const int64_t stride = static_cast<int64_t>(blockDim.x) * kN;  // between a thread's packs
    const int64_t advance = stride * kPacks;                       // an iteration
    auto compute_store = [&](const RawPack& r, int64_t i) {
      float p[kN], m[kN], v[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        p[k] = Storage<P>::load(r.p[k]);
        m[k] = Storage<Dtype::kBFloat16>::load(r.m[k]);
        v[k] = Storage<Dtype::kBFloat16>::load(r.v[k]);
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
        uint16_t pp[kN], mm[kN], vv[kN];
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          pp[k] = Storage<P>::store(p[k]);
          mm[k] = Storage<Dtype::kBFloat16>::store(m[k]);
          vv[k] = Storage<Dtype::kBFloat16>::store(v[k]);
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
      RawPack next[kPacks];
#pragma unroll
      for (int j = 0; j < kPacks; ++j) load_raw(next[j], buffer, exp_avg.data, exp_avg_sq.data, w.param, i + j * stride);
      for (; i < n; i += advance) {
        RawPack cur[kPacks];
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
        RawPack cur[kPacks];
#pragma unroll
        for (int j = 0; j < kPacks; ++j) load_raw(cur[j], buffer, exp_avg.data, exp_avg_sq.data, w.param, i + j * stride);
#pragma unroll
        for (int j = 0; j < kPacks; ++j) compute_store(cur[j], i + j * stride);
      }
    }
  }
};

template <typename Step, int kThreads, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    variant_kernel(const Meta<kLists> meta, Step step, AdamHyper h, StepScale scale, uint32_t seed) {
  step(meta, 0, static_cast<int64_t>(blockIdx.x) * kChunk, kChunk, static_cast<int>(blockIdx.x), h, scale, true, seed);
}

// A variant: its name, whether it computes the step (and so gives the
// extension's bits), its kernel's template arguments as cuobjdump prints them
// (bench/cuda_variants.py reads its registers so), and its launch over one
// tensor of each list (n elements, whole chunks).
struct Variant {
  const char* name;
  bool same_bits;
  std::string args;
  void (*launch)(const Meta<kLists>&, int64_t, AdamHyper, StepScale, uint32_t);
};

template <int kPacks, bool kPipelined, bool kStaticFlags, int kMath, int kThreads, int kMinBlocks>
void launch(const Meta<kLists>& meta, int64_t n, AdamHyper h, StepScale scale, uint32_t seed) {
  using Step = DefaultsStep<kPacks, kPipelined, kStaticFlags, kMath>;
  variant_kernel<Step, kThreads, kMinBlocks><<<static_cast<unsigned>(n / kChunk), kThreads, 0,
                                               c10::cuda::getCurrentCUDAStream()>>>(meta, Step{}, h, scale, seed);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int kPacks, bool kPipelined, bool kStaticFlags, int kMath, int kThreads = kBlock, int kMinBlocks = 1>
Variant variant(const char* name) {
  const auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  return {name, kMath == kStep,
          std::to_string(kPacks) + ", " + flag(kPipelined) + ", " + flag(kStaticFlags) + ", " + std::to_string(kMath) +
              ">, " + std::to_string(kThreads) + ", " + std::to_string(kMinBlocks),
          launch<kPacks, kPipelined, kStaticFlags, kMath, kThreads, kMinBlocks>};
}

const std::vector<Variant>& all_variants() {
  static const std::vector<Variant> variants = {
      variant<1, false, false, kStep, 512, 2>("1 pack, runtime flags (csrc's loop), 2 blocks an SM"),
      variant<1, false, true, kStep>("static flags"),
      variant<1, true, true, kStep>("pipelined, static flags"),
      variant<1, true, true, kStep, 512, 2>("pipelined, static flags, 2 blocks an SM"),
      variant<1, true, true, kStep, 256, 3>("pipelined, static flags, 256 threads, 3 blocks an SM"),
      variant<2, false, true, kStep>("2 packs, static flags"),
      variant<2, false, true, kStep, 512, 2>("2 packs, static flags, 2 blocks an SM"),
      variant<2, false, false, kStep, 512, 2>("2 packs, runtime flags, 2 blocks an SM"),
      variant<1, false, true, kNearest>("round to nearest (no hashes), static flags"),
      variant<1, false, true, kMemory>("memory only (loads, one add, stores)"),
  };
  return variants;
}

// (name, same_bits, template arguments) of each variant, by index.
std::vector<std::tuple<std::string, bool, std::string>> variants() {
  std::vector<std::tuple<std::string, bool, std::string>> out;
  for (const auto& v : all_variants()) out.emplace_back(v.name, v.same_bits, v.args);
  return out;
}

// Variant `index`'s AdamW step of (p bf16, g fp32 buffer, m and v bf16,
// step: the step count this update uses) with the extension's op's meaning.
void run(int64_t index, at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, at::Tensor step, double lr,
         double beta1, double beta2, double eps, double weight_decay, int64_t seed) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(all_variants().size()), "no variant ", index);
  TORCH_CHECK(p.is_cuda() && p.scalar_type() == at::kBFloat16 && g.scalar_type() == at::kFloat &&
                  m.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                  step.scalar_type() == at::kFloat,
              "expected bf16 p, m, v, an fp32 buffer and an fp32 step");
  const int64_t n = p.numel();
  TORCH_CHECK(n % kChunk == 0 && n / kChunk <= 65535, "numel must be a whole number of chunks of ", kChunk,
              ", at most 65535 of them");
  for (const auto& t : {g, m, v}) TORCH_CHECK(t.numel() == n && t.is_contiguous(), "tensors of p's numel");
  const c10::cuda::CUDAGuard guard(p.device());
  auto meta = std::make_unique<Meta<kLists>>();  // 32 KB: not on the host stack
  void* lists[kLists] = {p.data_ptr(), nullptr, g.data_ptr(), m.data_ptr(), v.data_ptr(), nullptr, step.data_ptr()};
  for (int d = 0; d < kLists; ++d) meta->addresses[d][0] = lists[d];
  meta->numel[0] = n;
  meta->stream[0] = 0;  // the op's stream id of its first (only) param
  meta->first_global_chunk = 0;
  const AdamHyper h = make_adam_hyper(lr, beta1, beta2, eps, weight_decay, true, false);
  all_variants()[index].launch(*meta, n, h, StepScale{1.0f, nullptr, nullptr}, static_cast<uint32_t>(seed));
}

}  // namespace
}  // namespace accumkernels::cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("variants", &accumkernels::cuda::variants);
  m.def("run", &accumkernels::cuda::run);
}

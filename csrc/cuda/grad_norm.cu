// grad_norm on CUDA: sqrt(sum of x^2 over every element of every buffer;
// fp32, bf16 or fp16). Deterministic, with no float atomics: pass 1 writes
// one double partial sum per chunk (a fixed-order tree inside each block; one
// multi-tensor launch per dtype, in the order fp32, bf16, fp16), pass 2 adds
// the partials in a fixed order in one block.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "../tensor_lists.h"
#include "accumkernels/dispatch.h"
#include "accumkernels/formulas.h"
#include "multi_tensor.cuh"

namespace accumkernels::cuda {
namespace {

constexpr const char* kOp = "accumkernels::grad_norm";

// Sum of `value` over the block, in a fixed order; the result is valid in thread 0.
__device__ double block_sum(double value) {
  __shared__ double shared[kBlock];
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kBlock / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  return shared[0];
}

template <Dtype D>
struct SumSquaresFunctor {
  __device__ void operator()(const Meta<1>& meta, int t, int64_t start, int64_t n,
                             int global_chunk, double* partials) {
    using T = typename Storage<D>::type;
    const T* x = static_cast<const T*>(meta.addresses[0][t]) + start;
    double sum = 0.0;
    constexpr int N = kVec<T>;
    for_chunk<N>(
        n, aligned<T, N>(x),
        [&](int64_t i) {
          T v[N];
          load_pack<N>(v, x, i);
#pragma unroll
          for (int k = 0; k < N; ++k) {
            const double value = Storage<D>::load(v[k]);
            sum += value * value;
          }
        },
        [&](int64_t i) {
          const double value = Storage<D>::load(x[i]);
          sum += value * value;
        });
    const double total = block_sum(sum);
    if (threadIdx.x == 0) partials[global_chunk] = total;
  }
};

__global__ void __launch_bounds__(kBlock) finish_norm(const double* partials, int64_t count,
                                                      float* out) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  const double total = block_sum(sum);
  if (threadIdx.x == 0) *out = static_cast<float>(sqrt(total));
}

at::Tensor grad_norm_cuda(at::TensorList buffers) {
  TORCH_CHECK_VALUE(!buffers.empty(), kOp,
                    ": buffers is empty; expected at least one tensor (the result's device comes "
                    "from them)");
  const at::Device device = buffers[0].device();
  for (size_t i = 0; i < buffers.size(); ++i) {
    check_tensor(kOp, buffers[i], "buffers", i, device, {at::kFloat, at::kBFloat16, at::kHalf});
  }
  const c10::cuda::CUDAGuard guard(device);
  const std::vector<DtypeGroup> groups = group_by_dtype(buffers, {buffers});
  int64_t chunks = 0;
  for (const DtypeGroup& g : groups) {
    for (const int64_t n : g.numels) chunks += (n + kChunk - 1) / kChunk;
  }
  const at::TensorOptions f32 = buffers[0].options().dtype(at::kFloat);
  if (chunks == 0) return at::zeros({}, f32);
  at::Tensor partials = at::empty({chunks}, f32.dtype(at::kDouble));
  at::Tensor out = at::empty({}, f32);
  double* group_partials = partials.data_ptr<double>();
  for (const DtypeGroup& g : groups) {  // each group's partials after the previous group's
    with_dtype(g.dtype, [&](auto d) {
      multi_tensor_apply<1>(g.pointers, g.numels, {}, SumSquaresFunctor<decltype(d)::value>{},
                            group_partials);
    });
    for (const int64_t n : g.numels) group_partials += (n + kChunk - 1) / kChunk;
  }
  finish_norm<<<1, kBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(partials.data_ptr<double>(),
                                                                   chunks, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CUDA, m) { m.impl("grad_norm", &grad_norm_cuda); }

}  // namespace accumkernels::cuda

// The multi-tensor launcher shared by every CUDA op.
//
// A call covers D parallel lists of tensors (e.g. params, buffers, exp_avgs).
// The host walks the tensors in fixed chunks of kChunk elements and packs, into
// the kernel's argument struct, the addresses of the tensors in flight and a
// block -> (tensor, chunk) map; one launch covers up to kMaxBlocks chunks of up
// to Meta<D>::kMaxTensors tensors, and the host launches again when either
// fills. Offsets are 64-bit. Functors receive one chunk and do fp32 math on it
// with the formulas of formulas.h, using 16-byte (or ILP-wide) vector loads
// when every pointer of the chunk is aligned and a scalar loop otherwise.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <vector>

namespace accumkernels::cuda {

constexpr int64_t kChunk = int64_t{1} << 16;
constexpr int kBlock = 512;
constexpr int kILP = 4;
constexpr int kMaxBlocks = 320;
constexpr int kArgBudget = 4000;  // bytes of kernel arguments (the portable 4 KiB limit)

template <int D>
struct Meta {
  static constexpr int kMaxTensors = (kArgBudget - kMaxBlocks * (1 + 4) - 16) / (D * 8 + 8 + 4);
  void* addresses[D][kMaxTensors];
  int64_t numel[kMaxTensors];
  int index[kMaxTensors];  // the tensor's position in the op's list (stochastic rounding)
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
  int first_global_chunk;  // global index of this launch's first chunk (grad_norm partials)
};

template <int D, typename Functor, typename... Args>
__global__ void __launch_bounds__(kBlock) multi_tensor_kernel(const Meta<D> meta, Functor functor,
                                                              Args... args) {
  const int tensor = meta.block_to_tensor[blockIdx.x];
  const int64_t chunk = meta.block_to_chunk[blockIdx.x];
  const int64_t start = chunk * kChunk;
  const int64_t n = min(kChunk, meta.numel[tensor] - start);
  functor(meta, tensor, start, n, meta.first_global_chunk + static_cast<int>(blockIdx.x), args...);
}

// Launches `functor` over every chunk of the D lists (all lists have equal
// numels per index; `indices` gives each tensor's position in the op's list,
// empty meaning 0, 1, 2, ...). Returns the number of chunks.
template <int D, typename Functor, typename... Args>
int64_t multi_tensor_apply(const std::vector<std::vector<void*>>& lists,
                           const std::vector<int64_t>& numels, const std::vector<int>& indices,
                           Functor functor, Args... args) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Meta<D> meta{};
  int slot = 0;          // the slot of the current tensor in this launch
  int blocks = 0;        // chunks packed into this launch
  int64_t chunks_seen = 0;
  auto launch = [&]() {
    multi_tensor_kernel<D><<<blocks, kBlock, 0, stream>>>(meta, functor, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    meta.first_global_chunk = static_cast<int>(chunks_seen);
    blocks = 0;
  };
  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t n = numels[t];
    if (n == 0) continue;
    for (int d = 0; d < D; ++d) meta.addresses[d][slot] = lists[d][t];
    meta.numel[slot] = n;
    meta.index[slot] = indices.empty() ? static_cast<int>(t) : indices[t];
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[blocks] = static_cast<unsigned char>(slot);
      meta.block_to_chunk[blocks] = static_cast<int>(c);
      ++blocks;
      ++chunks_seen;
      const bool last = c == chunks - 1;
      if (blocks == kMaxBlocks || (last && slot + 1 == Meta<D>::kMaxTensors)) {
        launch();
        if (last) {
          slot = -1;  // every slot is free again
        } else {      // the tensor goes on in the next launch, from slot 0
          for (int d = 0; d < D; ++d) meta.addresses[d][0] = meta.addresses[d][slot];
          meta.numel[0] = meta.numel[slot];
          meta.index[0] = meta.index[slot];
          slot = 0;
        }
      }
    }
    ++slot;
  }
  if (blocks > 0) launch();
  return chunks_seen;
}

// ---- element access ------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
__device__ __forceinline__ bool aligned(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kILP)) == 0;
}

template <typename T>
__device__ __forceinline__ void load_pack(T (&dst)[kILP], const T* src, int64_t i) {
  const Pack<T, kILP> p = *reinterpret_cast<const Pack<T, kILP>*>(src + i);
#pragma unroll
  for (int k = 0; k < kILP; ++k) dst[k] = p.v[k];
}

template <typename T>
__device__ __forceinline__ void store_pack(T* dst, int64_t i, const T (&src)[kILP]) {
  Pack<T, kILP> p;
#pragma unroll
  for (int k = 0; k < kILP; ++k) p.v[k] = src[k];
  *reinterpret_cast<Pack<T, kILP>*>(dst + i) = p;
}

// Runs body(i) for every element of a chunk of n elements: vectorized
// (ILP elements at a time, one pack load per list) when `vector_ok`, else
// element by element. The body gets a compile-time flag saying which.
template <typename VecBody, typename ScalarBody>
__device__ __forceinline__ void for_chunk(int64_t n, bool vector_ok, VecBody vec_body,
                                          ScalarBody scalar_body) {
  if (vector_ok && n % kILP == 0) {
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kILP; i < n;
         i += static_cast<int64_t>(blockDim.x) * kILP) {
      vec_body(i);
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) scalar_body(i);
  }
}

}  // namespace accumkernels::cuda

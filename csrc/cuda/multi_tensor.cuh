// The multi-tensor launcher shared by every CUDA op.
//
// A call covers D parallel lists of tensors (e.g. params, buffers, exp_avgs).
// The host walks the tensors in fixed chunks of kChunk elements and packs, into
// the kernel's argument struct, the addresses of the tensors in flight and a
// block -> (tensor, chunk) map; one launch covers up to max_blocks() chunks of
// up to Meta<D>::kMaxTensors tensors, and the host launches again when either
// fills. Launches are sized in whole waves of the blocks the device holds at
// once (SM count x resident blocks per SM for this kernel), so no launch ends
// in a small second wave. Everything a kernel needs travels in its arguments
// (up to 32 KB, CUDA >= 12.1 on sm_70+): no host->device copy, so a captured
// CUDA graph replays it as is. Offsets are 64-bit. Functors receive one chunk
// and do fp32 math with the formulas of formulas.h, using 16-byte vector
// accesses (Pack) when every pointer of the chunk is aligned for them and a
// scalar loop otherwise.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <vector>

namespace accumkernels::cuda {

constexpr int64_t kChunk = int64_t{1} << 16;
constexpr int kBlock = 512;
constexpr int kMaxBlocks = 2048;
constexpr int kArgBudget = 32000;  // bytes of kernel arguments (32764 allowed on sm_70+)

template <int D>
struct Meta {
  static constexpr int kMaxTensors =
      (kArgBudget - kMaxBlocks * (2 + 4) - 16) / (D * 8 + 8 + 4);
  void* addresses[D][kMaxTensors];
  int64_t numel[kMaxTensors];
  uint32_t stream[kMaxTensors];  // the tensor's stream id (stochastic rounding)
  uint16_t block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
  int first_global_chunk;  // global index of this launch's first chunk (grad_norm partials)
};

// One block's work: look up its (tensor, chunk) and run the functor on that
// chunk. The body of multi_tensor_kernel, and of any kernel that runs the same
// functors under other launch bounds (bench/cuda_variants.cu).
template <int D, typename Functor, typename... Args>
__device__ __forceinline__ void run_block_chunk(const Meta<D>& meta, Functor functor, Args... args) {
  const int tensor = meta.block_to_tensor[blockIdx.x];
  const int64_t chunk = meta.block_to_chunk[blockIdx.x];
  const int64_t start = chunk * kChunk;
  const int64_t n = min(kChunk, meta.numel[tensor] - start);
  functor(meta, tensor, start, n, meta.first_global_chunk + static_cast<int>(blockIdx.x), args...);
}

template <int D, typename Functor, typename... Args>
__global__ void __launch_bounds__(kBlock) multi_tensor_kernel(const Meta<D> meta, Functor functor,
                                                              Args... args) {
  run_block_chunk(meta, functor, args...);
}

// The most chunks one launch of `kernel` takes on the current device: whole
// waves of the blocks the device runs at once, within kMaxBlocks. Computed
// once per kernel and device.
template <typename Kernel>
int max_blocks(Kernel kernel) {
  static std::array<int, 64> per_device{};  // 0: not computed yet
  const int device = c10::cuda::current_device();
  int& cached = per_device.at(device);
  if (cached == 0) {
    int sms = 0, resident = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kBlock, 0));
    const int wave = std::max(1, sms * resident);
    cached = wave >= kMaxBlocks ? kMaxBlocks : (kMaxBlocks / wave) * wave;
  }
  return cached;
}

// Launches `functor` over every chunk of the D lists (all lists have equal
// numels per index; `streams` gives each tensor's stream id, empty meaning 0).
// Returns the number of chunks.
template <int D, typename Functor, typename... Args>
int64_t multi_tensor_apply(const std::vector<std::vector<void*>>& lists,
                           const std::vector<int64_t>& numels, const std::vector<uint32_t>& streams,
                           Functor functor, Args... args) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto kernel = multi_tensor_kernel<D, Functor, Args...>;
  const int launch_cap = max_blocks(kernel);
  auto meta = std::make_unique<Meta<D>>();  // 32 KB: not on the host stack
  int slot = 0;    // the slot of the current tensor in this launch
  int blocks = 0;  // chunks packed into this launch
  int64_t chunks_seen = 0;
  auto launch = [&]() {
    kernel<<<blocks, kBlock, 0, stream>>>(*meta, functor, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    meta->first_global_chunk = static_cast<int>(chunks_seen);
    blocks = 0;
  };
  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t n = numels[t];
    if (n == 0) continue;
    for (int d = 0; d < D; ++d) meta->addresses[d][slot] = lists[d][t];
    meta->numel[slot] = n;
    meta->stream[slot] = streams.empty() ? 0u : streams[t];
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      meta->block_to_tensor[blocks] = static_cast<uint16_t>(slot);
      meta->block_to_chunk[blocks] = static_cast<int>(c);
      ++blocks;
      ++chunks_seen;
      const bool last = c == chunks - 1;
      if (blocks == launch_cap || (last && slot + 1 == Meta<D>::kMaxTensors)) {
        launch();
        if (last) {
          slot = -1;  // every slot is free again
        } else {      // the tensor goes on in the next launch, from slot 0
          for (int d = 0; d < D; ++d) meta->addresses[d][0] = meta->addresses[d][slot];
          meta->numel[0] = meta->numel[slot];
          meta->stream[0] = meta->stream[slot];
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

// Elements per vector access for a kernel whose narrowest stored type is T:
// 16 bytes of it (4 fp32, 8 bf16/fp16); wider arrays in the same loop take
// several 16-byte accesses.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ bool aligned(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * N)) == 0;
}

template <int N, typename T>
__device__ __forceinline__ void load_pack(T (&dst)[N], const T* src, int64_t i) {
  const Pack<T, N> p = *reinterpret_cast<const Pack<T, N>*>(src + i);
#pragma unroll
  for (int k = 0; k < N; ++k) dst[k] = p.v[k];
}

template <int N, typename T>
__device__ __forceinline__ void store_pack(T* dst, int64_t i, const T (&src)[N]) {
  Pack<T, N> p;
#pragma unroll
  for (int k = 0; k < N; ++k) p.v[k] = src[k];
  *reinterpret_cast<Pack<T, N>*>(dst + i) = p;
}

// Runs body(i) for every element of a chunk of n elements: vectorized
// (N elements at a time, one pack access per list) when `vector_ok`, the
// last n % N elements (or all of them) element by element.
template <int N, typename VecBody, typename ScalarBody>
__device__ __forceinline__ void for_chunk(int64_t n, bool vector_ok, VecBody vec_body,
                                          ScalarBody scalar_body) {
  const int64_t vector_end = vector_ok ? n - n % N : 0;
  for (int64_t i = static_cast<int64_t>(threadIdx.x) * N; i < vector_end;
       i += static_cast<int64_t>(blockDim.x) * N) {
    vec_body(i);
  }
  for (int64_t i = vector_end + threadIdx.x; i < n; i += blockDim.x) scalar_body(i);
}

}  // namespace accumkernels::cuda

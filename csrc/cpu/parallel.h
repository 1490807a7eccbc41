// Work splitting for the CPU kernels: a list of tensors is seen as one flat
// index space cut into fixed chunks of kChunk elements. Chunks cross tensor
// boundaries, so threads get equal work whatever the tensor sizes, and the
// chunk boundaries depend only on the sizes, never on the thread count (which
// is what makes grad_norm deterministic).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace accumkernels::cpu {

// The grains: a second thread is woken only for at least this much work, some
// 50-100 µs of it on one thread. accumulate_ and grad_norm stream at about
// 0.3 ns an element; the steps compute at 0.8-2 (the zeroing of a skipped
// window's buffers shares their loop).
constexpr int64_t kFoldGrain = int64_t{1} << 18;
constexpr int64_t kStepGrain = int64_t{1} << 16;

class FlatIndex {
 public:
  // The unit parallel_for_elements cuts at: a multiple of every alignment the
  // step kernels ask for (the 8-bit state's blocks) and a divisor of kChunk.
  static constexpr int64_t kSplit = 4096;
  static_assert(kChunk % kSplit == 0 && kSplit % kState8Block == 0, "kSplit divides a chunk, a block divides kSplit");

  explicit FlatIndex(const std::vector<int64_t>& numels) : starts_(numels.size() + 1, 0) {
    for (size_t i = 0; i < numels.size(); ++i) starts_[i + 1] = starts_[i] + numels[i];
  }

  int64_t total() const { return starts_.back(); }
  int64_t num_chunks() const { return (total() + kChunk - 1) / kChunk; }

  // Calls f(tensor, offset, length) for each piece of [begin, end) that lies
  // in one tensor, in order.
  template <typename F>
  void for_each_segment(int64_t begin, int64_t end, F&& f) const {
    size_t t = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
    while (begin < end) {
      while (starts_[t + 1] <= begin) ++t;  // skip empty tensors
      const int64_t stop = std::min(end, starts_[t + 1]);
      f(t, begin - starts_[t], stop - begin);
      begin = stop;
    }
  }

  // Runs f(chunk, begin, end) for every chunk, in parallel over chunks (a
  // list of up to kFoldGrain elements on the calling thread): for grad_norm,
  // whose partial sums follow the chunks.
  template <typename F>
  void parallel_for_chunks(F&& f) const {
    const int64_t total_elements = total();
    at::parallel_for(0, num_chunks(), kFoldGrain / kChunk, [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        f(c, c * kChunk, std::min(total_elements, (c + 1) * kChunk));
      }
    });
  }

  // Elementwise work, whose result does not depend on how it is cut: runs
  // f(begin, end) over [0, total) in pieces of at most kChunk elements, each
  // starting at a multiple of kSplit. A list of up to `grain` elements stays
  // on the calling thread; a longer one is shared in balanced contiguous runs,
  // one a thread (fewer threads where there is under a grain for each).
  // Handing whole chunks out (parallel_for_chunks) leaves a list of two or
  // three chunks on one thread (three: two and one) and still pays for waking
  // the other, tens of µs: measured on a 2-core EPYC VM inside a backward pass,
  // a 137K-element fold took 64-69 µs on one thread against 78-99 over chunks.
  template <typename F>
  void parallel_for_elements(int64_t grain, F&& f) const {
    const int64_t total_elements = total();
    const int64_t units = (total_elements + kSplit - 1) / kSplit;
    at::parallel_for(0, units, std::max<int64_t>(1, grain / kSplit), [&](int64_t first, int64_t last) {
      const int64_t end = std::min(total_elements, last * kSplit);
      for (int64_t begin = first * kSplit; begin < end; begin += kChunk) {
        f(begin, std::min(end, begin + kChunk));
      }
    });
  }

 private:
  std::vector<int64_t> starts_;
};

}  // namespace accumkernels::cpu

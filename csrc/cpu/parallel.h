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

class FlatIndex {
 public:
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

  // Runs f(chunk, begin, end) for every chunk, in parallel over chunks.
  template <typename F>
  void parallel_for_chunks(F&& f) const {
    const int64_t total_elements = total();
    at::parallel_for(0, num_chunks(), 1, [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        f(c, c * kChunk, std::min(total_elements, (c + 1) * kChunk));
      }
    });
  }

 private:
  std::vector<int64_t> starts_;
};

}  // namespace accumkernels::cpu

// accumulate_ on the CPU: buffer = (0 if overwrite else buffer) + scale * float32(grad)
// for every pair, one parallel pass per grad dtype present in the list.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>

#include "../op_args.h"
#include "../tensor_lists.h"
#include "kernels.h"
#include "parallel.h"

namespace accumkernels::cpu {
namespace {

void run_accumulate(const AccumulateArgs& a) {
  const float scale = a.scale_tensor != nullptr ? a.scale * *a.scale_tensor : a.scale;
  const KernelTable& k = kernels();
  std::atomic<bool> nonfinite{false};
  for (const DtypeGroup& g : group_by_dtype(a.grads, {a.buffers, a.grads})) {
    const AccumulateCall call{g.dtype, a.overwrite, scale};
    const int64_t element = g.dtype == Dtype::kFloat32 ? 4 : 2;
    const FlatIndex index(g.numels);
    index.parallel_for_elements(kFoldGrain, [&](int64_t begin, int64_t end) {
      bool chunk_nonfinite = false;
      index.for_each_segment(begin, end, [&](size_t t, int64_t offset, int64_t length) {
        chunk_nonfinite |= k.accumulate(
            call, {static_cast<float*>(g.pointers[0][t]) + offset,
                   static_cast<const char*>(g.pointers[1][t]) + offset * element, length});
      });
      if (chunk_nonfinite) nonfinite.store(true, std::memory_order_relaxed);
    });
  }
  if (a.found_inf != nullptr && nonfinite.load()) *a.found_inf = 1.0f;
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CPU, m) {
  m.impl("accumulate_", &accumulate_entry<run_accumulate>);
}

}  // namespace accumkernels::cpu

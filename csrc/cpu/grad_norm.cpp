// grad_norm on the CPU: sqrt(sum of x^2 over every element of every buffer).
// Per-chunk partial sums in double, added in chunk order: the same inputs
// give the same bits whatever the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../checks.h"
#include "../tensor_lists.h"
#include "kernels.h"
#include "parallel.h"

namespace accumkernels::cpu {
namespace {

constexpr const char* kOp = "accumkernels::grad_norm";

at::Tensor grad_norm_cpu(at::TensorList buffers) {
  TORCH_CHECK_VALUE(!buffers.empty(), kOp,
                    ": buffers is empty; expected at least one tensor (the result's device comes "
                    "from them)");
  for (size_t i = 0; i < buffers.size(); ++i) {
    check_tensor(kOp, buffers[i], "buffers", i, at::kCPU, {at::kFloat});
  }
  const KernelTable& k = kernels();
  double total = 0.0;
  for (const DtypeGroup& g : group_by_dtype(buffers, {buffers})) {  // one group: all fp32
    const FlatIndex index(g.numels);
    std::vector<double> partial(index.num_chunks(), 0.0);
    index.parallel_for_chunks([&](int64_t chunk, int64_t begin, int64_t end) {
      double sum = 0.0;
      index.for_each_segment(begin, end, [&](size_t t, int64_t offset, int64_t length) {
        sum += k.sum_squares(static_cast<const float*>(g.pointers[0][t]) + offset, length);
      });
      partial[chunk] = sum;
    });
    for (double p : partial) total += p;
  }
  at::Tensor out = at::empty({}, buffers[0].options());
  *out.data_ptr<float>() = static_cast<float>(std::sqrt(total));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CPU, m) { m.impl("grad_norm", &grad_norm_cpu); }

}  // namespace accumkernels::cpu

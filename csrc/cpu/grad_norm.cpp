// grad_norm on the CPU: sqrt(sum of x^2 over every element of every buffer;
// fp32, bf16 or fp16). Per-chunk partial sums in double, added in chunk order
// within each dtype's group and the groups in the order fp32, bf16, fp16: the
// same inputs give the same bits whatever the thread count.
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
    check_tensor(kOp, buffers[i], "buffers", i, at::kCPU, {at::kFloat, at::kBFloat16, at::kHalf});
  }
  const KernelTable& k = kernels();
  double total = 0.0;
  for (const DtypeGroup& g : group_by_dtype(buffers, {buffers})) {
    const FlatIndex index(g.numels);
    const int64_t element = g.dtype == Dtype::kFloat32 ? 4 : 2;
    std::vector<double> partial(index.num_chunks(), 0.0);
    index.parallel_for_chunks([&](int64_t chunk, int64_t begin, int64_t end) {
      double sum = 0.0;
      index.for_each_segment(begin, end, [&](size_t t, int64_t offset, int64_t length) {
        sum += k.sum_squares(g.dtype, static_cast<const char*>(g.pointers[0][t]) + offset * element, length);
      });
      partial[chunk] = sum;
    });
    for (double p : partial) total += p;
  }
  at::Tensor out = at::empty({}, buffers[0].options().dtype(at::kFloat));
  *out.data_ptr<float>() = static_cast<float>(std::sqrt(total));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(accumkernels, CPU, m) { m.impl("grad_norm", &grad_norm_cpu); }

}  // namespace accumkernels::cpu

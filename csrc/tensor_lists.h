// Host-side list handling shared by the CPU and CUDA entry points: the
// tensors of a call grouped by storage dtype (kernels are compiled per
// dtype), and the data pointers of each group's parallel lists.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <vector>

#include "accumkernels/formulas.h"

namespace accumkernels {

inline Dtype storage_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return Dtype::kBFloat16;
    case at::kHalf:
      return Dtype::kFloat16;
    default:
      return Dtype::kFloat32;
  }
}

// The tensors of one storage dtype: their places in the op's lists, their
// element counts and, per list of the call, their data pointers (null where an
// optional list is empty). Tensors with no elements are left out.
struct DtypeGroup {
  Dtype dtype;
  std::vector<size_t> indices;
  std::vector<int64_t> numels;
  std::vector<std::vector<void*>> pointers;
};

// Groups by the dtype of `key` (e.g. the params), in the order fp32, bf16, fp16.
inline std::vector<DtypeGroup> group_by_dtype(at::TensorList key,
                                              std::initializer_list<at::TensorList> lists) {
  std::vector<DtypeGroup> groups;
  for (const Dtype d : {Dtype::kFloat32, Dtype::kBFloat16, Dtype::kFloat16}) {
    DtypeGroup g{d, {}, {}, std::vector<std::vector<void*>>(lists.size())};
    for (size_t i = 0; i < key.size(); ++i) {
      if (storage_dtype(key[i].scalar_type()) != d || key[i].numel() == 0) continue;
      g.indices.push_back(i);
      g.numels.push_back(key[i].numel());
      size_t k = 0;
      for (const at::TensorList& list : lists) {
        g.pointers[k++].push_back(list.empty() ? nullptr
                                               : const_cast<void*>(list[i].const_data_ptr()));
      }
    }
    if (!g.indices.empty()) groups.push_back(std::move(g));
  }
  return groups;
}

// The storage dtype of `list`'s tensors in group `g` (one per group: the op's checks say so).
inline Dtype group_dtype(at::TensorList list, const DtypeGroup& g) {
  return storage_dtype(list[g.indices[0]].scalar_type());
}

}  // namespace accumkernels

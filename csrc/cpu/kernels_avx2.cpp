// The loops for AVX2 + FMA + F16C. Headers come first so that only the code
// of kernels_impl.h is compiled for the target.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "accumkernels/dispatch.h"
#include "accumkernels/formulas.h"
#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define AK_CPU_ISA isa_avx2
#define AK_CPU_ISA_NAME "avx2"
#include "kernels_impl.h"
#pragma GCC pop_options

namespace accumkernels::cpu {
const KernelTable& kernels_avx2() { return isa_avx2::table(); }
}  // namespace accumkernels::cpu

// The loops for AVX-512 (F, BW, VL, DQ) at 512-bit vector width. Headers come
// first so that only the code of kernels_impl.h is compiled for the target.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "accumkernels/dispatch.h"
#include "accumkernels/formulas.h"
#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#define AK_CPU_ISA isa_avx512
#define AK_CPU_ISA_NAME "avx512"
#include "kernels_impl.h"
#pragma GCC pop_options

namespace accumkernels::cpu {
const KernelTable& kernels_avx512() { return isa_avx512::table(); }
}  // namespace accumkernels::cpu

// The loops for the baseline ISA of the build (SSE2 on x86-64).
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "accumkernels/dispatch.h"

#define AK_CPU_ISA isa_default
#define AK_CPU_ISA_NAME "default"
#include "kernels_impl.h"

namespace accumkernels::cpu {
const KernelTable& kernels_default() { return isa_default::table(); }
}  // namespace accumkernels::cpu

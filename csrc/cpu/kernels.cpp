// Picks the CPU loops at run time: the widest ISA the processor supports, or
// the one forced by ACCUMKERNELS_CPU_ISA (used by the tests to run every
// variant this machine can execute).
#include "kernels.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace accumkernels::cpu {
namespace {

bool cpu_has(const std::string& isa) {
#if defined(__x86_64__)
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  if (isa == "avx512") {
    return cpu_has("avx2") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }
#endif
  return isa == "default";
}

const KernelTable& table_for(const std::string& isa) {
#if defined(__x86_64__)
  if (isa == "avx512") return kernels_avx512();
  if (isa == "avx2") return kernels_avx2();
#endif
  return kernels_default();
}

const KernelTable& choose() {
  const char* forced = std::getenv("ACCUMKERNELS_CPU_ISA");
  if (forced != nullptr && *forced != '\0') {
    const std::string isa(forced);
    if (isa != "default" && isa != "avx2" && isa != "avx512") {
      throw std::invalid_argument("ACCUMKERNELS_CPU_ISA must be one of default, avx2, avx512; got '" +
                                  isa + "'");
    }
    if (!cpu_has(isa)) {
      throw std::invalid_argument("ACCUMKERNELS_CPU_ISA=" + isa +
                                  " but this CPU (or build) does not support it");
    }
    return table_for(isa);
  }
  for (const char* isa : {"avx512", "avx2"}) {
    if (cpu_has(isa)) return table_for(isa);
  }
  return kernels_default();
}

}  // namespace

const KernelTable& kernels() {
  static const KernelTable& chosen = choose();
  return chosen;
}

}  // namespace accumkernels::cpu

"""Builds accumkernels._C, the native ops, with torch.utils.cpp_extension and ninja.

- The CPU sources are always built. The loops (csrc/cpu/kernels_*.cpp) are
  compiled once per ISA and chosen at run time, so the build never uses
  -march=native and the wheel runs on any x86-64 (or, default only, any CPU).
- The CUDA sources (csrc/cuda/*.cu) are built when torch is a CUDA build and a
  CUDA toolkit is found (see _cuda_home). TORCH_CUDA_ARCH_LIST overrides the
  default architectures (8.0 and 9.0 plus PTX).
- ACCUMKERNELS_SKIP_CUDA=1 builds the CPU kernels only, toolkit or not (a
  CPU wheel; CI's check of the installed package uses one).
- ACCUMKERNELS_SKIP_NATIVE=1 builds no native code: the package then runs on
  its pure-PyTorch reference backend only.
- Where a GPU is visible (torch.cuda.is_available()) or ACCUMKERNELS_REQUIRE_CUDA=1,
  a missing toolkit or a CPU-only torch is an error, never a silent CPU-only build.
- No floating-point contraction anywhere (-ffp-contract=off, nvcc --fmad=false;
  the Triton kernels launch with enable_fp_fusion=False): every backend rounds
  `a + b * c` twice, as the reference does, so the same inputs give the same
  bits on every ISA and device.

Install with `pip install --no-build-isolation .` into an environment that
already has torch: torch is deliberately not a build requirement, since build
isolation would install a second torch to build against.
"""

import os
import platform
import sys
from pathlib import Path

from setuptools import setup

try:
    import torch  # noqa: F401  (the extension is built against the torch installed here)
except ImportError:
    sys.exit(
        "accumkernels: this build cannot import torch. Install torch into your environment first, then build with "
        "`pip install --no-build-isolation -e .` (pip's default build isolation hides the installed torch)."
    )

ROOT = Path(__file__).parent.resolve()
# -fopenmp: at::parallel_for is inline and runs serially unless the extension
# itself is compiled with OpenMP (torch's own build uses it).
# -ffp-contract=off: GCC fuses a + b * c into an FMA by default wherever the
# ISA has one (the AVX2 and AVX-512 loops), which rounds once instead of twice;
# every backend rounds twice, so every ISA gives the same bits.
# (tests/test_native.py reads this list, to compile the CPU loops as the build does.)
CXX_FLAGS = ["-O3", "-std=c++20", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=hidden"]
CSRC = ROOT / "csrc"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _cpu_sources() -> list[str]:
    sources = [CSRC / "ops.cpp", CSRC / "module.cpp", CSRC / "grad_inbox.cpp", *sorted((CSRC / "cpu").glob("*.cpp"))]
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        # The ISA variants are x86-64 only; elsewhere the default loops serve.
        sources = [s for s in sources if s.name not in {"kernels_avx2.cpp", "kernels_avx512.cpp"}]
    return [str(s.relative_to(ROOT)) for s in sources]


def _cuda_home():
    """The CUDA toolkit folder: CUDA_HOME or CUDA_PATH if set (and then only
    it), else /usr/local/cuda, else torch's guess. torch guesses from the nvcc
    on PATH, which is wrong where that nvcc is a wrapper script outside the
    toolkit, so a folder only counts if it holds both bin/nvcc and
    include/cuda_runtime.h."""
    from torch.utils import cpp_extension

    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for home in (explicit,) if explicit else ("/usr/local/cuda", cpp_extension.CUDA_HOME):
        if home and (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include" / "cuda_runtime.h").exists():
            return str(Path(home).resolve())
    return None


def _log(message: str) -> None:
    # pip shows a build's stderr with -v and on failure; plain prints are hidden by --quiet.
    print(f"accumkernels: {message}", file=sys.stderr, flush=True)


def _extensions():
    if _truthy("ACCUMKERNELS_SKIP_NATIVE"):
        _log("ACCUMKERNELS_SKIP_NATIVE is set: no native code is built (reference backend only)")
        return [], {}
    import torch
    from torch.utils import cpp_extension

    link_flags = ["-fopenmp"]
    sources = _cpu_sources()
    cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (CSRC / "cuda").glob("*.cu"))
    skip_cuda = _truthy("ACCUMKERNELS_SKIP_CUDA")
    if skip_cuda and _truthy("ACCUMKERNELS_REQUIRE_CUDA"):
        sys.exit("accumkernels: ACCUMKERNELS_SKIP_CUDA and ACCUMKERNELS_REQUIRE_CUDA are both set: unset one")
    cuda_home = _cuda_home() if torch.version.cuda and not skip_cuda else None
    with_cuda = bool(cuda_sources) and cuda_home is not None
    required = _truthy("ACCUMKERNELS_REQUIRE_CUDA") or (torch.cuda.is_available() and not skip_cuda)
    if required and not with_cuda:
        reason = (
            f"torch {torch.__version__} is a CPU-only build"
            if not torch.version.cuda
            else "no CUDA toolkit was found (CUDA_HOME, CUDA_PATH or /usr/local/cuda must hold bin/nvcc and "
            "include/cuda_runtime.h)"
        )
        why = "a GPU is visible" if torch.cuda.is_available() else "ACCUMKERNELS_REQUIRE_CUDA is set"
        sys.exit(f"accumkernels: {why} but the CUDA kernels cannot be built: {reason}")
    if with_cuda:
        # cpp_extension reads its module-level CUDA_HOME when it builds.
        os.environ["CUDA_HOME"] = cuda_home
        cpp_extension.CUDA_HOME = cuda_home
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
        extension = cpp_extension.CUDAExtension(
            "accumkernels._C",
            sources + cuda_sources,
            include_dirs=[str(CSRC / "include")],
            define_macros=[("ACCUMKERNELS_WITH_CUDA", "1")],
            extra_link_args=link_flags,
            extra_compile_args={
                "cxx": CXX_FLAGS,
                "nvcc": ["-O3", "-std=c++20", "-lineinfo", "--fmad=false"],
            },
        )
    else:
        extension = cpp_extension.CppExtension(
            "accumkernels._C",
            sources,
            include_dirs=[str(CSRC / "include")],
            extra_compile_args={"cxx": CXX_FLAGS},
            extra_link_args=link_flags,
        )
    if with_cuda:
        _log(
            f"building the CPU kernels (3 ISA variants) and the CUDA kernels for "
            f"{os.environ['TORCH_CUDA_ARCH_LIST']} with {cuda_home}; about 4 minutes on 2 cores"
        )
    else:
        _log(
            f"building the CPU kernels (3 ISA variants), no CUDA{' (ACCUMKERNELS_SKIP_CUDA)' if skip_cuda else ''}; "
            "about 2 minutes on 2 cores"
        )
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=True)
    return [extension], {"build_ext": build_ext}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

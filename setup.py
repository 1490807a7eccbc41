"""Builds accumkernels._C, the native ops, with torch.utils.cpp_extension and ninja.

- The CPU sources are always built. The loops (csrc/cpu/kernels_*.cpp) are
  compiled once per ISA and chosen at run time, so the build never uses
  -march=native and the wheel runs on any x86-64 (or, default only, any CPU).
- The CUDA sources (csrc/cuda/*.cu) are built when torch is a CUDA build and a
  CUDA toolkit is found (see _cuda_home). TORCH_CUDA_ARCH_LIST overrides the
  default architectures (8.0 and 9.0 plus PTX).
- ACCUMKERNELS_SKIP_NATIVE=1 builds no native code: the package then runs on
  its pure-PyTorch reference backend only.

Install with `pip install --no-build-isolation .` into an environment that
already has torch: torch is deliberately not a build requirement, since build
isolation would install a second torch to build against.
"""

import os
import platform
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _cpu_sources() -> list[str]:
    sources = [CSRC / "ops.cpp", CSRC / "module.cpp", *sorted((CSRC / "cpu").glob("*.cpp"))]
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        # The ISA variants are x86-64 only; elsewhere the default loops serve.
        sources = [s for s in sources if s.name not in {"kernels_avx2.cpp", "kernels_avx512.cpp"}]
    return [str(s.relative_to(ROOT)) for s in sources]


def _cuda_home():
    """The CUDA toolkit folder: CUDA_HOME or CUDA_PATH if set, else /usr/local/cuda,
    else torch's guess. torch guesses from the nvcc on PATH, which is wrong where
    that nvcc is a wrapper script outside the toolkit, so a folder only counts if
    it holds both bin/nvcc and include/cuda_runtime.h."""
    from torch.utils import cpp_extension

    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda", cpp_extension.CUDA_HOME):
        if home and (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include" / "cuda_runtime.h").exists():
            return str(Path(home).resolve())
    return None


def _extensions():
    if _truthy("ACCUMKERNELS_SKIP_NATIVE"):
        return [], {}
    import torch
    from torch.utils import cpp_extension

    # -fopenmp: at::parallel_for is inline and runs serially unless the
    # extension itself is compiled with OpenMP (torch's own build uses it).
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp", "-fno-math-errno", "-fvisibility=hidden"]
    link_flags = ["-fopenmp"]
    sources = _cpu_sources()
    cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (CSRC / "cuda").glob("*.cu"))
    cuda_home = _cuda_home() if torch.version.cuda else None
    with_cuda = bool(cuda_sources) and cuda_home is not None
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
                "cxx": cxx_flags,
                "nvcc": ["-O3", "-std=c++20", "-lineinfo"],
            },
        )
    else:
        extension = cpp_extension.CppExtension(
            "accumkernels._C",
            sources,
            include_dirs=[str(CSRC / "include")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=True)
    return [extension], {"build_ext": build_ext}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

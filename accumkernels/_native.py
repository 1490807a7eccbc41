"""Loads the compiled extension accumkernels._C, if it was built.

Importing it registers the native ops under ``torch.ops.accumkernels``. A
missing or broken build never makes ``import accumkernels`` fail: the error is
kept and raised, with the command that builds the extension, when a native
backend is asked for.
"""

from __future__ import annotations

import torch  # noqa: F401  (libtorch must be loaded before _C)

BUILD_HINT = (
    "build it from the repository root with `pip install --no-build-isolation -e .` "
    "(in an environment that already has torch; see README.md), or use backend='reference'"
)

try:
    from . import _C
except ImportError as error:  # not built, or built against another torch
    _C = None
    LOAD_ERROR: ImportError | None = error
else:
    LOAD_ERROR = None


def is_loaded() -> bool:
    return _C is not None


def with_cuda() -> bool:
    """True if the extension was built with its CUDA kernels."""
    return _C is not None and bool(_C.with_cuda)


def cpu_isa() -> str | None:
    """The instruction set of the CPU loops in use ('default', 'avx2', 'avx512')."""
    return None if _C is None else _C.cpu_isa


def require() -> None:
    """Raises a RuntimeError that says how to build the extension, if it is missing."""
    if _C is None:
        raise RuntimeError(f"accumkernels native extension is not available ({LOAD_ERROR}); {BUILD_HINT}")

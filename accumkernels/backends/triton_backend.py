"""The Triton backend (kernels in backends/triton/, one file per op): every op
as Triton kernels behind torch.library custom ops (``torch.ops.accumkernels_triton.*``).

Available where triton imports and either a CUDA device is present or
``TRITON_INTERPRET=1`` was set before this package was imported (the
interpreter then runs the kernels on CPU tensors: that is how CI tests them).

The ops are opaque custom ops rather than ``triton_op``s: their multi-tensor
launches read tensor addresses from a device table, which torch.compile could
not follow for mutation analysis, so code calling them compiles with each op
as one node.
"""

from __future__ import annotations

import os

import torch

from .._op_table import OPS

_INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"

try:
    import triton  # noqa: F401
except ImportError as error:
    _IMPORT_ERROR: Exception | None = error
else:
    _IMPORT_ERROR = None


def unavailable_reason() -> str | None:
    if _IMPORT_ERROR is not None:
        return f"triton is not installed ({_IMPORT_ERROR})"
    if not _INTERPRET and not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 before importing accumkernels to run on the CPU)"
    return None


def supports(device: torch.device) -> bool:
    return device.type == "cuda" or (_INTERPRET and device.type == "cpu")


def _ops():
    from .triton import accumulate, adam, grad_norm, sgd  # noqa: F401  (registers the custom ops)

    return torch.ops.accumkernels_triton


def _entry(name: str):
    """The op ``name`` of the op table as torch.ops.accumkernels_triton.<name>, by keyword."""

    def call(**args):
        return getattr(_ops(), name)(**args)

    call.__name__ = call.__qualname__ = name
    return call


globals().update({name: _entry(name) for name in OPS})

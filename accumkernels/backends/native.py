"""The native backends: the C++ (CPU) and CUDA kernels behind torch.ops.accumkernels.

Both are the same torch.ops calls; torch's dispatcher picks the CPU or CUDA
kernel from the tensors' device. What differs is which device each serves and
whether this build and machine can run it.
"""

from __future__ import annotations

import torch

from .. import _native
from .._op_table import OPS


class NativeBackend:
    """A backend (see accumkernels.backends.Backend) whose ops are torch.ops.accumkernels.*."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def supports(self, device: torch.device) -> bool:
        return device.type == self.device_type

    def unavailable_reason(self) -> str | None:
        if not _native.is_loaded():
            return f"the native extension is not built ({_native.LOAD_ERROR}); {_native.BUILD_HINT}"
        if self.device_type == "cuda":
            if not _native.with_cuda():
                return "the native extension was built without CUDA kernels (CPU-only torch or no nvcc at build time)"
            if not torch.cuda.is_available():
                return "no CUDA device is available"
        return None


def _entry(name: str):
    """The op ``name`` of the op table as torch.ops.accumkernels.<name>, by keyword."""

    def call(self, **args):
        return getattr(torch.ops.accumkernels, name)(**args)

    call.__name__ = call.__qualname__ = name
    return call


for _name in OPS:
    setattr(NativeBackend, _name, _entry(_name))


cpu = NativeBackend("cpu")
cuda = NativeBackend("cuda")

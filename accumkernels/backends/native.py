"""The native backends: the C++ (CPU) and CUDA kernels behind torch.ops.accumkernels.

Both are the same torch.ops calls; torch's dispatcher picks the CPU or CUDA
kernel from the tensors' device. What differs is which device each serves and
whether this build and machine can run it.
"""

from __future__ import annotations

import torch

from .. import _native


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

    def accumulate_(self, **args) -> None:
        torch.ops.accumkernels.accumulate_(**args)

    def sgd_step_and_zero_(self, **args) -> None:
        torch.ops.accumkernels.sgd_step_and_zero_(**args)

    def adam_step_and_zero_(self, **args) -> None:
        torch.ops.accumkernels.adam_step_and_zero_(**args)

    def adamw_step_and_zero_(self, **args) -> None:
        torch.ops.accumkernels.adamw_step_and_zero_(**args)

    def grad_norm(self, **args) -> torch.Tensor:
        return torch.ops.accumkernels.grad_norm(**args)


cpu = NativeBackend("cpu")
cuda = NativeBackend("cuda")

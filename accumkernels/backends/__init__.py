"""Backend registry: which implementations exist, which run here, which to pick.

A backend serves some device types and may be unavailable in this process
(extension not built, no GPU). ``backend=None`` picks the first available one
for the tensors' device in ``PREFERENCE``; a backend named by the caller is
used as named or refused with the reason, never swapped for another.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch

from .._op_table import OPS
from . import native, reference, triton_backend


class Backend(Protocol):
    """What accumkernels.ops needs of a backend: ``supports`` and
    ``unavailable_reason``, and one function per op of the op table
    (accumkernels._op_table.OPS), which takes the arguments of the op's schema
    in csrc/ops.cpp by keyword, already validated, and computes the formula of
    its accumkernels.ops docstring; reference.py is the oracle."""

    def supports(self, device: torch.device) -> bool: ...

    def unavailable_reason(self) -> str | None:
        """None if the backend runs in this process, else why not (with a fix)."""


def check_backend(name: str, backend) -> None:
    """Raises if ``backend`` lacks an op of the op table (a backend added without all of them)."""
    missing = [op for op in OPS if not callable(getattr(backend, op, None))]
    if missing:
        raise TypeError(f"accumkernels backend {name!r} does not implement {missing}")


BACKENDS: dict[str, Backend] = {
    "reference": reference,
    "cpu": native.cpu,
    "cuda": native.cuda,
    "triton": triton_backend,
}

for _name, _backend in BACKENDS.items():
    check_backend(_name, _backend)

# Fastest first, per device type; reference serves every device last. On CUDA
# the native kernels come before Triton until a GPU benchmark shows otherwise.
PREFERENCE = {
    "cpu": ("cpu", "reference"),
    "cuda": ("cuda", "triton", "reference"),
}


def available_backends() -> list[str]:
    """Names of the backends usable in this process, e.g. ['reference', 'cpu']."""
    return [name for name, b in BACKENDS.items() if b.unavailable_reason() is None]


_warned_fallback: set[str] = set()


def resolve(name: str | None, device: torch.device) -> Backend:
    """The backend module to run on ``device``; raises if ``name`` cannot serve it."""
    if name is not None:
        if name not in BACKENDS:
            raise ValueError(f"backend must be None or one of {sorted(BACKENDS)}; got {name!r}")
        b = BACKENDS[name]
        reason = b.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"backend {name!r} is not available: {reason}")
        if not b.supports(device):
            raise ValueError(f"backend {name!r} does not run on {device.type} tensors")
        return b
    for candidate in PREFERENCE.get(device.type, ("reference",)):
        b = BACKENDS[candidate]
        if b.unavailable_reason() is None and b.supports(device):
            if candidate == "reference" and device.type in PREFERENCE and device.type not in _warned_fallback:
                _warned_fallback.add(device.type)
                fast = PREFERENCE[device.type][0]
                warnings.warn(
                    f"accumkernels: running {device.type} tensors on the slow reference backend because "
                    f"backend {fast!r} is not available: {BACKENDS[fast].unavailable_reason()}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return b
    raise RuntimeError(f"no accumkernels backend runs on {device.type} tensors")

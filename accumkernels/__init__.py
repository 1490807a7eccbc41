"""accumkernels: exact, fast, memory-lean gradient accumulation for PyTorch.

Fused kernels fold bf16/fp16/fp32 gradients into persistent fp32 buffers
(``accumulate_``) and run an optimizer step that reads those buffers and
clears them in the same pass (``sgd_step_and_zero_``, ``adam_step_and_zero_``,
``adamw_step_and_zero_``), plus a deterministic ``grad_norm``. Each op has a
pure-PyTorch reference and native CPU kernels; ``available_backends()`` lists
what this process can run.
"""

from . import _native
from .backends import available_backends
from .optim import AccumulatingOptimizer
from .ops import (
    accumulate_,
    adam_step_and_zero_,
    adamw_step_and_zero_,
    grad_norm,
    sgd_step_and_zero_,
)

if _native.is_loaded():
    from . import _fake

    _fake.register()

__all__ = [
    "AccumulatingOptimizer",
    "accumulate_",
    "adam_step_and_zero_",
    "adamw_step_and_zero_",
    "available_backends",
    "grad_norm",
    "sgd_step_and_zero_",
]
__version__ = "0.1.0"

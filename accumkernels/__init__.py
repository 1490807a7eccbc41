"""accumkernels: exact, fast, memory-lean gradient accumulation for PyTorch.

``AdamW``, ``Adam`` and ``SGD`` take ``torch.optim``'s signatures and drop in
where it is built; ``AccumulatingOptimizer`` wraps any ``torch.optim``
optimizer. Gradients are summed in fp32 buffers over a window of micro-batches
and one fused step updates the params (bf16 params stochastically rounded, with
bf16 state, by default), in the user's loop, in HF Trainer, Accelerate,
Lightning, on many processes, on FSDP2 models and pipeline stages. ``plan_window`` picks the micro-batch
size and accumulation steps for a memory budget. Underneath, fused ops fold
bf16/fp16/fp32 gradients into fp32 buffers (``accumulate_``), step from them
and clear them in one pass (``sgd_step_and_zero_``, ``adam_step_and_zero_``,
``adamw_step_and_zero_``) and take a deterministic ``grad_norm``; each has a
pure-PyTorch reference and CPU, CUDA and Triton kernels
(``available_backends()`` lists what this process runs).
"""

from . import _native
from .backends import available_backends
from .ops import (
    accumulate_,
    adam_step_and_zero_,
    adamw_step_and_zero_,
    grad_norm,
    sgd_step_and_zero_,
)
from .optim import SGD, AccumulatingOptimizer, Adam, AdamW
from .plan import WindowPlan, plan_window

if _native.is_loaded():
    from . import _fake

    _fake.register()

__all__ = [
    "AccumulatingOptimizer",
    "Adam",
    "AdamW",
    "SGD",
    "accumulate_",
    "adam_step_and_zero_",
    "adamw_step_and_zero_",
    "available_backends",
    "grad_norm",
    "plan_window",
    "sgd_step_and_zero_",
    "WindowPlan",
]
__version__ = "0.1.0"

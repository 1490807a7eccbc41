"""Fake (meta) kernels for the native ops, so that torch.compile and
torch.library.opcheck can trace them, one per op of the op table
(accumkernels._op_table): a mutating op returns nothing, grad_norm a 0-dim
fp32 tensor on the buffers' device."""

from __future__ import annotations

import torch

from ._op_table import OPS


def _nothing(*args, **kwargs) -> None:
    return None


def _scalar(tensors, *args, **kwargs):
    return tensors[0].new_empty((), dtype=torch.float32)


def register() -> None:
    for name, op in OPS.items():
        torch.library.register_fake(f"accumkernels::{name}", _nothing if op.returns is None else _scalar)

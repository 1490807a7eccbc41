"""Fake (meta) kernels for the native ops, so that torch.compile and
torch.library.opcheck can trace them: the mutating ops return nothing and
grad_norm returns a 0-dim fp32 tensor on the buffers' device."""

from __future__ import annotations

import torch


def _nothing(*args, **kwargs) -> None:
    return None


def _grad_norm(buffers):
    return buffers[0].new_empty(())


def register() -> None:
    for name in ("accumulate_", "sgd_step_and_zero_", "adam_step_and_zero_", "adamw_step_and_zero_"):
        torch.library.register_fake(f"accumkernels::{name}", _nothing)
    torch.library.register_fake("accumkernels::grad_norm", _grad_norm)

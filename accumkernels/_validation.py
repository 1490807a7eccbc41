"""Argument checks for the public ops, shared by every backend.

Everything is checked before any backend runs, so a bad call writes nothing.
Errors name the argument and list index: TypeError for a wrong type, dtype or
layout, ValueError for a wrong length, size, layout or value, RuntimeError for
a wrong device (as torch does).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PARAM_DTYPES = GRAD_DTYPES
F32 = (torch.float32,)
STATE_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.uint8,
)  # optimizer state (bf16: rounded stochastically; uint8: 8-bit codes)
MASTER_DTYPES = (torch.float32, torch.int16)  # fp32 master weights, or int16 remainders of bf16 params


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def as_tensor_list(op: str, value, name: str, *, optional: bool = False) -> list[torch.Tensor]:
    """A list or tuple of tensors (None or empty for an absent optional list)."""
    if value is None and optional:
        return []
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        raise TypeError(f"{op}: {name} must be a list or tuple of tensors; got {type(value).__name__}")
    out = list(value)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name}[{i}] must be a torch.Tensor; got {type(t).__name__}")
    return out


def first_dtype(tensors: list[torch.Tensor]) -> torch.dtype | None:
    """The dtype a list of tensors must share: that of its first (None if empty)."""
    return tensors[0].dtype if tensors else None


def check_same_dtype(op: str, tensors: list[torch.Tensor], name: str, i: int, reason: str) -> None:
    if tensors[i].dtype != tensors[0].dtype:
        raise TypeError(
            f"{op}: {name}[{i}] has dtype {tensors[i].dtype} but {name}[0] has {tensors[0].dtype}; {reason}"
        )


def check_length(op: str, values: list, name: str, expected: int, reason: str) -> None:
    if len(values) != expected:
        raise ValueError(f"{op}: {name} has {len(values)} tensors; expected {expected} ({reason})")


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill numel() slots of memory."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def check_tensor(op: str, t: torch.Tensor, name: str, i: int, device: torch.device, dtypes) -> None:
    # The common case (dense, right device and dtype) costs a few attribute
    # reads; messages are only built on failure.
    if t.layout != torch.strided:
        raise TypeError(f"{op}: {name}[{i}] has layout {t.layout}; expected a strided (dense) tensor, not a sparse one")
    if t.device != device:
        raise RuntimeError(f"{op}: {name}[{i}] is on {t.device}; expected {device} (the device of the first tensor)")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name}[{i}] has dtype {t.dtype}; expected one of {_names(dtypes)}")
    if not is_dense(t):
        raise ValueError(
            f"{op}: {name}[{i}] (sizes {tuple(t.shape)}, strides {t.stride()}) is not dense; "
            "expected a tensor whose elements fill its memory (contiguous in some dimension order)"
        )


def check_like(op: str, t: torch.Tensor, name: str, i: int, ref: torch.Tensor, ref_name: str, dtypes) -> None:
    """t is valid and holds its elements in the same memory order as ref."""
    check_tensor(op, t, name, i, ref.device, dtypes)
    if t.numel() != ref.numel():
        raise ValueError(
            f"{op}: {name}[{i}] has {t.numel()} elements (shape {tuple(t.shape)}); "
            f"{ref_name}[{i}] has {ref.numel()} (shape {tuple(ref.shape)})"
        )
    if not (t.is_contiguous() and ref.is_contiguous()) and (t.shape != ref.shape or t.stride() != ref.stride()):
        raise ValueError(
            f"{op}: {name}[{i}] (sizes {tuple(t.shape)}, strides {t.stride()}) is not laid out like "
            f"{ref_name}[{i}] (sizes {tuple(ref.shape)}, strides {ref.stride()}); "
            "expected both contiguous or the same sizes and strides"
        )


def scale_argument(op: str, value, name: str, device: torch.device | None) -> tuple[float, torch.Tensor | None]:
    """A scale given as a Python number or a 1-element fp32 tensor on ``device``
    (any device when None: an empty call), split into the (float, tensor) pair
    of the op schema."""
    if isinstance(value, torch.Tensor):
        check_scalar_tensor(op, value, name, value.device if device is None else device)
        return 1.0, value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a float or a 1-element float32 tensor; got {type(value).__name__}")
    return float(value), None


def positions_argument(op: str, positions, count: int) -> list[int]:
    """Stochastic rounding stream ids: None (each tensor's place in the list)
    or one int in [0, 2**32) per tensor; returned as a list ([] for None)."""
    if positions is None:
        return []
    if isinstance(positions, torch.Tensor) or not isinstance(positions, Sequence):
        raise TypeError(f"{op}: positions must be None or a list of ints; got {type(positions).__name__}")
    out = list(positions)
    if len(out) != count:
        raise ValueError(f"{op}: positions has {len(out)} entries; expected one per param ({count})")
    for i, p in enumerate(out):
        if isinstance(p, bool) or not isinstance(p, numbers.Integral) or not 0 <= p < 2**32:
            raise ValueError(f"{op}: positions[{i}] must be an int in [0, 2**32); got {p!r}")
    return [int(p) for p in out]


def check_scalar_tensor(op: str, t, name: str, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a 1-element float32 tensor or None; got {type(t).__name__}")
    if t.layout != torch.strided or t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be a strided float32 tensor; got {t.dtype}, {t.layout}")
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must have 1 element; got {t.numel()} (shape {tuple(t.shape)})")
    if t.device != device:
        raise RuntimeError(f"{op}: {name} is on {t.device}; expected {device}, the device of the tensors")


def check_number(
    op: str, value, name: str, *, low: float | None = None, high: float | None = None, high_inclusive: bool = True
) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a float; got {type(value).__name__}")
    x = float(value)
    if (
        x != x
        or (low is not None and x < low)
        or (high is not None and (x > high or (x == high and not high_inclusive)))
    ):
        bounds = ([f">= {low}"] if low is not None else []) + (
            [f"{'<=' if high_inclusive else '<'} {high}"] if high is not None else []
        )
        raise ValueError(f"{op}: {name} must be a number{' ' + ' and '.join(bounds) if bounds else ''}; got {value}")
    return x


def check_disjoint(op: str, written: dict, read: dict) -> None:
    """No tensor the op writes shares memory with any other tensor it touches.

    ``written`` and ``read`` map argument names to lists of tensors or to one
    tensor (or None). Sweeps the byte ranges in address order, keeping the
    furthest-reaching range seen so far among all ranges and among written
    ones: a range that starts before either end overlaps a range it must not.
    """
    spans = []
    for is_written, lists in ((True, written), (False, read)):
        for name, tensors in lists.items():
            if tensors is None:
                continue
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
                name = name + "#"  # a single tensor: labelled without an index
            for i, t in enumerate(tensors):
                n = t.numel()
                if n:
                    start = t.data_ptr()
                    spans.append((start, start + n * t.element_size(), is_written, name, i))
    spans.sort()
    any_end = written_end = 0
    any_span = written_span = None
    for span in spans:
        start, end, is_written = span[0], span[1], span[2]
        other = written_span if start < written_end else (any_span if is_written and start < any_end else None)
        if other is not None:
            raise ValueError(
                f"{op}: {_label(span)} shares memory with {_label(other)}; a tensor the op writes must not "
                "overlap any other argument (pass separate tensors)"
            )
        if end > any_end:
            any_end, any_span = end, span
        if is_written and end > written_end:
            written_end, written_span = end, span


def _label(span) -> str:
    name, i = span[3], span[4]
    return name[:-1] if name.endswith("#") else f"{name}[{i}]"

"""Plan a training window for a memory budget: the micro-batch size and the
number of accumulation steps that reach a global batch without running out of
memory, found by measuring instead of by crashing.

The peak of a training step is predicted as::

    peak(b) = static + a + c * b + margin

static    what the wrapper setup holds whatever the micro-batch: the params, the
          wrapper's fp32 buffers (the same layout it will build), the optimizer
          state (SGD's momentum, Adam's two moments, amsgrad's maximum, in
          each param's state dtype; step counts) and master weights (fp32
          copies or 16-bit remainders), computed from the model and options.
          A window of one micro-batch on one process holds no buffers (the
          gradients, in the params' dtypes, instead): where global_batch fits
          in one micro-batch so counted, the plan is that window;
a + c*b   what a micro-step allocates beyond that (activations, temporaries,
          gradients in flight), measured by running forward and backward at a
          few small micro-batch sizes b with the wrapper installed (CUDA: the
          allocator's peak; CPU: the running sum of torch's profiler memory
          events, every allocation and free), and fitted by least squares (the
          fit's worst relative residual is reported);
margin    allocator and workspace slack: 5 % of the rest.

No out-of-memory retry loop: nothing runs at sizes that were not asked for.
The model is left as it was: no param or optimizer state changes, no ``.grad``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .optim import static_bytes

MARGIN = 0.05
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def _mib(n: float) -> str:
    """Bytes in the unit that shows them (a small model's shortfall is not '0.0 MiB')."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass
class WindowPlan:
    """A micro-batch size and number of accumulation steps for a global batch.

    ``micro_batch_size * accum_steps == global_batch`` when ``exact``; otherwise
    the last micro-batch holds ``last_micro_batch`` samples (pass
    ``normalize="items"`` and the samples of each micro-batch as ``num_items``
    for the exact mean over the global batch)."""

    micro_batch_size: int
    accum_steps: int
    global_batch: int
    last_micro_batch: int
    exact: bool
    budget_bytes: int
    predicted_peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    fit: dict = field(default_factory=dict)  # a, c, sizes measured, their bytes, worst residual
    passes: int = 0  # forward/backward passes the planning ran
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        rows = [
            ("micro_batch_size", str(self.micro_batch_size)),
            ("accum_steps", str(self.accum_steps)),
            (
                "global_batch",
                f"{self.global_batch}"
                + ("" if self.exact else f" (not divisible: the last micro-batch holds {self.last_micro_batch})"),
            ),
            ("predicted peak", f"{_mib(self.predicted_peak_bytes)} of a {_mib(self.budget_bytes)} budget"),
        ]
        rows += [(f"  {k}", _mib(v)) for k, v in self.breakdown.items()]
        f = self.fit
        rows.append(
            (
                "activation fit",
                f"a = {_mib(f['a'])}, c = {_mib(f['c'])} per sample, worst residual "
                f"{f['residual'] * 100:.1f} % (sizes {f['sizes']})",
            )
        )
        rows.append(("planning", f"{self.passes} forward/backward passes, {self.seconds:.2f} s"))
        width = max(len(k) for k, _ in rows)
        return "\n".join([f"{k.ljust(width)}  {v}" for k, v in rows] + [f"note: {n}" for n in self.notes])


def parse_budget(memory_budget, device: torch.device) -> int:
    """Bytes from an int, a string such as "12GiB", or (CUDA) a fraction in (0, 1]
    of the device's memory."""
    if isinstance(memory_budget, str):
        text = memory_budget.strip().lower().replace(" ", "")
        number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(number) :] or "b"
        if unit not in _UNITS or not number:
            raise ValueError(f"memory_budget {memory_budget!r}: expected a number of bytes or e.g. '12GiB', '800MB'")
        memory_budget = float(number) * _UNITS[unit]
    if (
        isinstance(memory_budget, bool)
        or not isinstance(memory_budget, (int, float))
        or not math.isfinite(memory_budget)
    ):
        raise TypeError(f"memory_budget must be a number of bytes (or a fraction on CUDA); got {memory_budget!r}")
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be > 0; got {memory_budget!r}")
    if memory_budget <= 1:
        if device.type != "cuda":
            raise ValueError(
                f"memory_budget={memory_budget} reads as a fraction of the device's memory, which "
                f"only CUDA devices report; on {device.type} give bytes"
            )
        return int(memory_budget * torch.cuda.get_device_properties(device).total_memory)
    return int(memory_budget)


def _snapshot_state(model, optimizer):
    """What the measuring passes may change: params, their .grad, module buffers
    (BatchNorm's running statistics and counts), the optimizer's state."""
    params = list(model.parameters())
    return (
        [p.detach().clone() for p in params],
        [p.grad for p in params],
        {k: dict(v) for k, v in optimizer.state.items()},
        [b.detach().clone() for b in model.buffers()],
    )


def _restore_state(model, optimizer, saved) -> None:
    with torch.no_grad():
        for p, value, grad in zip(model.parameters(), saved[0], saved[1]):
            p.copy_(value)
            p.grad = grad
        for b, value in zip(model.buffers(), saved[3]):
            b.copy_(value)
    optimizer.state.clear()
    optimizer.state.update(saved[2])


def _measure(model, loss_fn, optimizer, sizes, device, wrapper_options) -> tuple[list[int], float]:
    """Bytes a micro-step allocates beyond what exists before it, at each size,
    with the wrapper installed (it is closed afterwards, nothing stepped)."""
    from .optim import AccumulatingOptimizer

    options = {k: v for k, v in wrapper_options.items() if k not in ("accum_steps",)}
    wrapper = AccumulatingOptimizer(optimizer, accum_steps=2**31 - 1, **options)
    measured = []
    start = time.perf_counter()
    try:
        for b in sizes:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                _micro_step(model, loss_fn, wrapper, b)
                torch.cuda.synchronize(device)
                measured.append(torch.cuda.max_memory_allocated(device) - before)
            else:
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
                ) as prof:
                    _micro_step(model, loss_fn, wrapper, b)
                measured.append(profiled_peak(prof))
    finally:
        wrapper.close()
    return measured, time.perf_counter() - start


def profiled_peak(prof) -> int:
    """The peak of the CPU allocator's live bytes over a ``torch.profiler``
    run with ``profile_memory=True``, relative to its start: the running sum
    of its memory events, every allocation and free, in time order."""
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def _micro_step(model, loss_fn, wrapper, b: int) -> None:
    try:
        loss = loss_fn(model, b)
    except Exception as error:
        raise RuntimeError(f"loss_fn(model, {b}) failed: {type(error).__name__}: {error}") from error
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn(model, {b}) must return a scalar loss tensor; got {type(loss).__name__}")
    loss.backward()
    wrapper.step()


def _fit(sizes: list[int], measured: list[int]) -> tuple[float, float, float]:
    """Least squares a + c*b; the worst relative residual."""
    n = len(sizes)
    mean_b, mean_m = sum(sizes) / n, sum(measured) / n
    var = sum((b - mean_b) ** 2 for b in sizes)
    c = sum((b - mean_b) * (m - mean_m) for b, m in zip(sizes, measured)) / var if var else 0.0
    c = max(c, 0.0)
    a = mean_m - c * mean_b
    residual = max(abs(a + c * b - m) / max(m, 1) for b, m in zip(sizes, measured))
    return a, c, residual


def plan_window(
    model: torch.nn.Module,
    loss_fn,
    *,
    global_batch: int,
    memory_budget,
    optimizer: torch.optim.Optimizer,
    sizes: tuple[int, ...] = (2, 4, 8),
    **wrapper_options,
) -> WindowPlan:
    """The largest micro-batch that fits ``memory_budget`` and the accumulation
    steps that make ``global_batch`` of it.

    Args:
        model: the model to train (left unchanged).
        loss_fn: ``loss_fn(model, b)`` builds a micro-batch of ``b`` samples, runs
            the forward pass and returns the scalar loss (backward is run here).
        global_batch: the effective batch, in samples.
        memory_budget: bytes (an int, or a string like ``"12GiB"``), or on CUDA a
            fraction in (0, 1] of the device's memory.
        optimizer: the ``torch.optim`` optimizer to be wrapped (SGD, Adam, AdamW:
            its type and param groups decide the state); left unchanged.
        sizes: the micro-batch sizes measured (capped at ``global_batch``).
        wrapper_options: the AccumulatingOptimizer options to plan for
            (master_weights, stochastic_rounding, intake, sharded, ...).
    """
    from .optim import AccumulatingOptimizer

    if isinstance(optimizer, AccumulatingOptimizer):
        raise TypeError(
            "plan_window plans for a torch.optim optimizer that is not wrapped yet, and got "
            f"{type(optimizer).__name__} "
            "(an accumkernels optimizer already holding the params): pass torch.optim."
            f"{type(optimizer.optimizer).__name__}(...) with the same params, then build the accumkernels optimizer "
            "with accum_steps=plan (and its wrapper options as planned)"
        )
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be an int >= 1; got {global_batch!r}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        raise ValueError("the optimizer holds no params")
    device = params[0].device
    budget = parse_budget(memory_budget, device)
    # What a window of many micro-batches holds, and what a window of one holds (no fp32 buffers
    # where the wrapper then keeps none: the gradients in the params' dtypes instead).
    windowed = static_bytes(optimizer, **wrapper_options)
    single = static_bytes(optimizer, **{**wrapper_options, "accum_steps": 1})
    leanest = min(windowed, single, key=lambda parts: sum(parts.values()))
    if sum(leanest.values()) * (1 + MARGIN) >= budget:
        static = sum(leanest.values())
        raise ValueError(
            f"memory_budget {_mib(budget)} does not hold even the static part of training: "
            + ", ".join(f"{k} {_mib(v)}" for k, v in leanest.items())
            + f" (with a {MARGIN:.0%} margin {_mib(static * (1 + MARGIN))}): "
            + f"{_mib(static * (1 + MARGIN) - budget)} short"
        )
    sizes = sorted({min(int(s), global_batch) for s in sizes if int(s) >= 1})
    if len(sizes) < 2 and global_batch > 1:
        sizes = sorted({1, min(2, global_batch)})
    saved = _snapshot_state(model, optimizer)
    # The random numbers loss_fn and dropout draw come from a fork: the
    # caller's generators are where they were.
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            measured, seconds = _measure(model, loss_fn, optimizer, sizes, device, wrapper_options)
    finally:
        _restore_state(model, optimizer, saved)
    a, c, residual = _fit(sizes, measured) if len(sizes) > 1 else (measured[0], 0.0, 0.0)

    def peak(static: int, b: int) -> float:
        return (static + a + c * b) * (1 + MARGIN)

    # All of global_batch in one micro-batch where it fits beside what such a window holds; else
    # the largest micro-batch that fits beside the fp32 buffers of a window of several.
    if peak(sum(single.values()), global_batch) <= budget:
        breakdown, fitting = single, global_batch
    else:
        breakdown = windowed
        fitting = max((b for b in range(1, global_batch + 1) if peak(sum(windowed.values()), b) <= budget), default=0)
    static = sum(breakdown.values())
    if fitting == 0:
        raise ValueError(
            f"not even a micro-batch of 1 fits: predicted {_mib(peak(static, 1))} for a {_mib(budget)} budget "
            f"({_mib(static)} static, {_mib(a + c)} for one sample)"
        )
    divisor = max(d for d in range(1, fitting + 1) if global_batch % d == 0)
    notes = []
    if divisor * 2 > fitting or divisor == global_batch:
        b, steps, last = divisor, global_batch // divisor, divisor
    else:  # a divisor would waste more than half the memory: a ragged last micro-batch instead
        b, steps = fitting, -(-global_batch // fitting)
        last = global_batch - (steps - 1) * fitting
        notes.append(
            f"{global_batch} has no divisor near {fitting}: {steps - 1} micro-batches of {b} and a last one "
            f"of {last}; use normalize='items' with num_items = each micro-batch's samples for the exact "
            "mean"
        )
    if residual > 0.1:
        notes.append(
            f"the activation fit is off by up to {residual:.0%} at the sizes measured: pass sizes= closer to {b}"
        )
    predicted = peak(static, b)
    parts = dict(breakdown)
    parts[f"activations ({b} samples)"] = int(a + c * b)
    parts["margin"] = int(predicted - static - a - c * b)
    return WindowPlan(
        micro_batch_size=b,
        accum_steps=steps,
        global_batch=global_batch,
        last_micro_batch=last,
        exact=last == b,
        budget_bytes=budget,
        predicted_peak_bytes=int(predicted),
        breakdown=parts,
        fit={"a": a, "c": c, "sizes": sizes, "measured": measured, "residual": residual},
        passes=len(sizes),
        seconds=seconds,
        notes=notes,
    )

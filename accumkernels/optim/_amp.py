"""The only code that reads or writes GradScaler internals.

torch.amp.GradScaler keeps, per optimizer (keyed by ``id(optimizer)``), a
``stage`` (READY, UNSCALED, STEPPED) and the inf/NaN flags its ``update()``
consumes (``found_inf_per_device``); its scale is ``_scale``. An optimizer with
``_step_supports_amp_scaling = True`` is called by ``scaler.step()`` directly,
with the attributes ``grad_scale`` (the scale, or None once unscaled) and
``found_inf`` set on it for the duration of the call. tests/test_amp.py checks
every private name used here against the installed torch.
"""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState

from ._discovery import calling_frame


def is_enabled(scaler) -> bool:
    return scaler is not None and scaler.is_enabled()


def inverse_scale(scaler, device: torch.device) -> torch.Tensor:
    """1 / the current scale, as a 1-element fp32 tensor on ``device`` (the
    reciprocal taken in fp64, as GradScaler.unscale_ does)."""
    scale = scaler._scale
    if scale is None:
        raise RuntimeError("the GradScaler has not scaled a loss yet: call scaler.scale(loss).backward() first")
    return scale.double().reciprocal().float().reshape(1).to(device)


def report_found_inf(scaler, optimizer, device: torch.device, found_inf: torch.Tensor) -> None:
    """Hand ``found_inf`` to the scaler as this optimizer's inf check, for its
    next ``update()`` (which backs off when it is nonzero)."""
    scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {device: found_inf.reshape(())}


def report_micro_step(scaler, optimizer, device: torch.device, step_found_inf, distributed: bool) -> None:
    """Hooks intake, after each micro-step: the scaler's update() after this
    step() call backs off on what it is told here: the micro-step's own flag on
    one process; distributed, nothing (every rank's scaler sees the window's
    global flag at its end, and none before)."""
    if is_enabled(scaler):
        report_found_inf(scaler, optimizer, device, torch.zeros(1, device=device) if distributed else step_found_inf)


def was_unscaled(scaler, optimizer) -> bool:
    """``scaler.unscale_(optimizer)`` ran since the last ``update()``."""
    return scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED


def _step_codes() -> set:
    """The code of the GradScaler methods (of torch's class and its subclasses)
    that call ``optimizer.step()``."""
    codes, classes = set(), [torch.amp.GradScaler]
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        for name in ("step", "_maybe_opt_step"):
            method = cls.__dict__.get(name)
            if method is not None:
                codes.add(method.__code__)
    return codes


def scaler_driving(optimizer):
    """The GradScaler whose ``step(optimizer)`` is calling ``optimizer.step()``
    right now, or None. GradScaler passes no reference to itself (it sets
    ``optimizer.grad_scale``/``found_inf`` for the call when the optimizer
    handles scaling, and nothing otherwise): it is found on the call stack, a
    few frames up, by the code of its methods. (Only that frame's locals are
    read: reading a frame's f_locals pins its variables to it.) A stack walk:
    the intakes call it only where a cheaper sign says a scaler may be there
    (``may_be_driving``)."""
    codes = _step_codes()
    frame = calling_frame(lambda f: f.f_code in codes, skip=1, limit=8)
    candidate = None if frame is None else frame.f_locals.get("self")
    return candidate if isinstance(candidate, torch.amp.GradScaler) else None


# GradScaler.step() runs its inf check (_check_inf_per_device) on the
# optimizer's .grad before it calls the step of an optimizer that handles
# scaling: on intake "hooks"' FoldedGrad markers, which count it here. A
# change of the count tells the intake a scaler is stepping it (see
# may_be_driving), whatever object the scaler was handed.
_marker_checks = 0


def checking_inf_for_step() -> bool:
    """GradScaler.step() is running its own inf check of ``.grad``
    (``_check_inf_per_device``, with a unit scale) before it calls the step of
    an optimizer that handles scaling (the wrapper with intake "hooks", which
    checks every gradient as it folds it). Counted (see above)."""
    global _marker_checks
    code = torch.amp.GradScaler._check_inf_per_device.__code__
    found = calling_frame(lambda f: f.f_code is code, skip=1, limit=12) is not None
    _marker_checks += found
    return found


def marker_checks() -> int:
    """How many times a GradScaler's inf check met FoldedGrad markers so far."""
    return _marker_checks


def may_be_driving(optimizer, checks_seen: int) -> bool:
    """A cheap sign that a GradScaler is calling ``optimizer.step()`` (intake
    "hooks"): GradScaler set ``found_inf`` on it for the call, or its inf check
    met the markers since ``checks_seen``."""
    return "found_inf" in vars(optimizer) or _marker_checks != checks_seen


def unscale_and_check(views: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """views *= inv_scale in place, and found_inf = 1 if any element is inf or
    NaN (GradScaler's own fused kernel; no host sync)."""
    if views:
        torch._amp_foreach_non_finite_check_and_unscale_(views, found_inf.reshape(()), inv_scale.reshape(()))


class LossScale:
    """The factor that unscales the current micro-step's gradients as they are
    folded: 1 without a scaler, else 1 / its scale, read once per micro-step."""

    def __init__(self, scaler, device: torch.device) -> None:
        self.scaler = scaler
        self.device = device
        self._cached: torch.Tensor | None = None

    def __call__(self):
        if not is_enabled(self.scaler):
            return 1.0
        if self._cached is None:
            self._cached = inverse_scale(self.scaler, self.device)
        return self._cached

    def next_micro_step(self) -> None:
        self._cached = None


def _refuse_another_scaler(driver, loss_scale: LossScale):
    """The GradScaler given as grad_scaler= (or None): it must be the one calling step()."""
    given = loss_scale.scaler
    if given is not None and given is not driver:
        raise RuntimeError("step() is called by another GradScaler than the one given as grad_scaler=")
    return given


def refuse_no_grads(optimizer, window_holds) -> None:
    """GradScaler.step(optimizer) where no param has a ``.grad``: for a
    torch.optim optimizer it raises this AssertionError, before anything is
    stepped or its scale updated; for one that handles scaling (intake
    "hooks") it sets ``found_inf`` to the sum of no per-device flags, 0, and
    steps. The same error here, unless the window holds gradients after all."""
    if not isinstance(vars(optimizer).get("found_inf"), torch.Tensor) and not window_holds:
        raise AssertionError("No inf checks were recorded for this optimizer.")


def adopt(driver, optimizer, loss_scale: LossScale, intake, device: torch.device) -> None:
    """Intake "hooks": a GradScaler calls step() directly (the wrapper handles
    scaling). One the wrapper was not given is adopted at its first call:
    the window's sum so far is unscaled and checked in place, later
    micro-batches as they are folded. ``scaler.unscale_(opt)`` before is
    refused: there is no ``.grad`` for it to unscale."""
    given = _refuse_another_scaler(driver, loss_scale)
    if was_unscaled(driver, optimizer):
        raise RuntimeError(
            "scaler.unscale_(opt) found no .grad: with intake='hooks' gradients are folded into the wrapper's fp32 "
            "buffers during backward. Clip with max_grad_norm= or opt.clip_grad_norm_(), or use intake='grad'"
        )
    if given is None:
        intake.flush()
        intake.unscale_window(inverse_scale(driver, device), intake.window.step_found_inf)
        loss_scale.scaler = driver


def refuse_unscaling_running_sum(driver, loss_scale: LossScale, ends_window: bool) -> None:
    """Intake "grad": the scaler unscales ``.grad`` (the buffers) and skips
    step() on inf itself, so it must do that once per window."""
    _refuse_another_scaler(driver, loss_scale)
    if not ends_window:
        raise RuntimeError(
            "with intake='grad' a GradScaler unscales .grad, which holds the window's running sum: call "
            "scaler.step(opt) and scaler.update() once per window (accum_steps=None), or use intake='hooks'"
        )


def check_exposed_window(
    optimizer, scaler, views: list[torch.Tensor], found_inf: torch.Tensor, device: torch.device
) -> None:
    """Intake "grad" at the window's end: the inf/NaN check of the buffers and,
    for a GradScaler that did not unscale this window (step() called directly),
    their unscaling, in one pass; the scaler is told the result."""
    if is_enabled(scaler):
        if was_unscaled(scaler, optimizer):
            return  # the scaler unscaled .grad, checked it, and calls step() only when finite
        unscale_and_check(views, inverse_scale(scaler, device), found_inf)
        report_found_inf(scaler, optimizer, device, found_inf)
    else:
        unscale_and_check(views, torch.ones(1, device=device), found_inf)

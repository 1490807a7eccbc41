"""Mistakes that would train silently wrong, refused at ``step()`` with the
setting to change.

With ``accum_steps=N`` the wrapper counts the window: each ``step()`` call is
one micro-step. Two natural ports of an existing loop break that silently: a
loop or framework that accumulates by itself and calls ``step()`` once per
window (the window becomes N times too long, the loss divided twice), and a
framework that steps the LR scheduler, clips and logs at every ``step()``
call. Both are seen at the first ``step()``: a param that got more than one
gradient since the previous call, and a framework's code on the call stack.
"""

from __future__ import annotations

from ._discovery import frames_above

# Lightning counts every step() call as a global step in manual optimization
# too, where accumulate_grad_batches is refused and the loop counts by hand.
_LIGHTNING = (
    "Lightning (Trainer(accumulate_grad_batches=...); in manual optimization, call opt.step() and "
    "opt.zero_grad() every N-th batch, as with torch.optim)"
)
# Top-level packages whose code calls optimizer.step() for the user, and the
# setting in which each counts the window itself.
FRAMEWORKS = {
    "transformers": "HF Trainer (TrainingArguments(gradient_accumulation_steps=...))",
    "accelerate": "Accelerate (Accelerator(gradient_accumulation_steps=...))",
    "pytorch_lightning": _LIGHTNING,
    "lightning": _LIGHTNING,
}


def frameworks_calling() -> list[str]:
    """The frameworks (FRAMEWORKS' keys) whose code is on the call stack of
    the current step() call, innermost first."""
    found = []
    for frame in frames_above(skip=2, limit=60):
        top = frame.f_globals.get("__name__", "").partition(".")[0]
        if top in FRAMEWORKS and top not in found:
            found.append(top)
    return found


def _named(found: list[str]) -> str:
    return " and ".join(FRAMEWORKS[f] for f in reversed(found))


def refuse_framework_counting(accum_steps: int) -> None:
    """accum_steps=N while a framework calls step(): the framework counts windows."""
    found = frameworks_calling()
    if found:
        raise RuntimeError(
            f"AccumulatingOptimizer(accum_steps={accum_steps}) is being stepped by {_named(found)}, which counts the "
            "window itself and clips, logs and steps the LR scheduler at every step() call: build the wrapper with "
            "accum_steps=None (each step() call then ends a window) and set the window length in the framework"
        )


def framework_reading_grad(index) -> str | None:
    """The error for a framework reading a ``.grad`` that intake "hooks" folded
    (its clipping or norm logging, before step() could say more), or None
    where no framework is on the call stack."""
    found = frameworks_calling()
    if not found:
        return None
    return (
        f"{_named(found)} reads param {index}'s .grad (to clip or log it), but AccumulatingOptimizer (intake='hooks', "
        "the default with accum_steps=N) folded it into its fp32 buffer: with a framework, build the wrapper with "
        "accum_steps=None (its intake is then 'grad': .grad is the window's fp32 sum) and set the window length in "
        "the framework"
    )


def refuse_several_backwards(accum_steps: int, count: int, index: int) -> None:
    """accum_steps=N and a param got ``count`` > 1 gradients since the last step()."""
    raise RuntimeError(
        f"AccumulatingOptimizer(accum_steps={accum_steps}) counts one micro-step per step() call, but param {index} "
        f"got {count} gradients since the last step() (backward passes, or tensors added into .grad in place). If "
        "your loop or framework accumulates and calls step() once per window (e.g. the loss divided by N and step() "
        "every N-th batch), "
        "build the wrapper with accum_steps=None and keep the loop as it is; if you meant several backward passes "
        "per micro-step, sum their losses and call backward once"
    )

"""How gradients get into AccumulatingOptimizer's fp32 buffers. Two intakes:

``HookIntake`` ("hooks"): a hook per param takes its gradient as autograd
computes it (a pre-hook of the param's gradient accumulator, run after the
param's own tensor hooks and before autograd would add it into ``.grad``; not
run in ``torch.autograd.grad()``, which accumulates nothing;
FSDP2: a post-accumulate-grad hook, once FSDP2 handed the reduced shard over);
and returns no gradient, so autograd adds nothing into ``.grad``;
when a bucket's gradients are all there, one ``accumulate_`` call folds them
into the buffers (cast, loss-scale and inf check in the same pass; a param's
first gradient of a window overwrites its buffer, so nothing is ever zeroed).
Where the extension is built the hook is native (csrc/grad_inbox.cpp): the
common gradient is queued without Python, and a complete bucket is folded by
the inbox itself where ``ready_for_backward`` armed it (no loss scaler, the
native kernels, the bucket's params all new to the window or all in it), else
handed to Python (``_deliver``); every other gradient goes to the Python hook,
``_arrive``.
At most a bucket's worth of gradients lives beside the buffers.
Where a window is one micro-batch (accum_steps=1, one process: "lean",
``holds_buffers``) there is no flat buffer: each gradient is held as it
arrived until the step reads it.
``.grad`` holds a ``FoldedGrad`` marker (accumkernels.optim._folded) that
raises, naming what to use instead, wherever code tries to read it.

``GradIntake`` ("grad"): each param's ``.grad`` *is* its fp32 buffer view
(bf16/fp16 params get ``grad_dtype = None``: any dtype), and autograd adds each
new gradient into it in place; on one process ``.grad`` is None until the
param's first gradient, as torch.optim's (a pre-hook makes the zero buffer
``.grad`` just before autograd adds into it). Code that reads or edits
``.grad`` after backward (framework clipping, ``GradScaler.unscale_``, norm
logging) works on the window's true sum (with ``accum_steps=N`` the undivided
running sum, which code may edit only where the step does not divide it:
normalize="sum"). A marker hook per param records which params got a
gradient. With ``accum_steps=N`` the step clears the buffers
(``zero_buffers=True``); with ``accum_steps=None``, where step() is
torch.optim's, ``.grad`` keeps the gradient the step used until it is
cleared (``zero_grad()``, ``.grad = None``), as torch.optim's does: code
that reads it after step() (a logged norm) reads what torch would.

Both count the gradients each param receives between step() calls: with
``accum_steps=N`` a step() call is one micro-step, and a second backward
before it (a loop or framework that accumulates itself) is refused there.

A param is owned by one live intake at a time: a second wrapper over the same
params is refused until the first is closed.

What differs between the intakes is theirs to decide, through one interface
the wrapper calls at fixed points (``Intake``): how a GradScaler that calls
``step()`` is met (``meet_scaler``) and told the window's inf flags
(``report_micro_step``, ``report_window``), the check of an exposed window
(``end_window``), and where a clip coefficient goes (``clip``).

The per-gradient path is short: the arriving gradient is checked (dtype,
device, shape, layout: ``_check_arriving``) and queued; a full bucket is
folded by ``accumulate_`` through a ``Prepared`` backend, which checks no
tensor again (the buffers are the wrapper's own, checked when made).
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from .. import _native, ops
from .._validation import GRAD_DTYPES
from . import _amp
from ._folded import FoldedGrad
from ._fsdp import sharded_grad
from ._layout import Bucket, Layout, ParamRecord
from ._sync import Sync
from ._window import Window

INTAKES = ("hooks", "grad")

# Intake "hooks" queues gradients through the native inbox (csrc/grad_inbox.cpp)
# where the extension is built; False: through its Python pre-hooks only (as
# without the extension; the tests run both).
NATIVE_INBOX = True


def default_intake(intake: str | None, accum_steps: int | None) -> str:
    """The intake asked for, or the default: "grad" where frameworks count the
    window (accum_steps=None), else "hooks"."""
    return intake or ("grad" if accum_steps is None else "hooks")


# param -> weak reference to the intake that owns it
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _call_weak(ref, index, arg) -> None:
    """A post-accumulate-grad hook's call into its intake, held weakly (``arg``: the param)."""
    intake = ref()
    if intake is not None:
        intake._on_grad(index, arg)


def _refuse_after_reduction(accum_steps, sync) -> str:
    """The message for a gradient after the window's cross-rank reduction,
    which could not be reopened (see BucketSync.reopen)."""
    if accum_steps is not None:
        return (
            "AccumulatingOptimizer: a gradient arrived after this window's cross-rank reduction (a second "
            "backward in the window's last micro-step): sum the losses and call backward once per micro-step"
        )
    what = "AccumulatingOptimizer: a second backward after this window's cross-rank reduction, which "
    what += "wire_dtype=torch.bfloat16 makes once per window: "
    if sync.stage:
        return what + (
            "a pipeline stage's window is reduced when its schedule's backwards end, so run one schedule.step() "
            "per step() (the schedule's micro-batches are the window), or leave wire_dtype at torch.float32"
        )
    return what + (
        "pass accum_steps=N (the optimizer counts the window) or, with a DDP module, run the window's other "
        "backwards under its no_sync()"
    )


def _reduce_weak(ref) -> None:
    """A pipeline stage's call when its schedule's backwards end, held weakly."""
    intake = ref()
    if intake is not None:
        intake.reduce_once()


def _cleared_weak(ref, index) -> None:
    """A marker's call when ``.grad`` is zeroed in place, held weakly."""
    intake = ref()
    if intake is not None:
        intake.cleared_in_place(index)


def _scaled_weak(ref, index, factor, divide) -> None:
    """A marker's call when ``.grad`` is scaled in place by a number, held weakly."""
    intake = ref()
    if intake is not None:
        intake.scaled_in_place(index, factor, divide)


def _added_weak(ref, index, grad) -> None:
    """A marker's call when a gradient is added into ``.grad``, held weakly."""
    intake = ref()
    if intake is not None:
        intake.added(index, grad)


def _shard_weak(ref, index, param) -> None:
    """An FSDP2 param's post-accumulate-grad hook, held weakly."""
    intake = ref()
    if intake is not None:
        intake._on_shard(index)


def _deliver_weak(ref, bucket, taken) -> None:
    """The native inbox's call when a bucket's gradients are all queued (``taken``: [(index, grad)])."""
    intake = ref()
    if intake is not None:
        intake._deliver(bucket, taken)


def _folded_weak(ref, indices) -> None:
    """The native inbox's call when it folded a bucket itself (``indices``: its params that got a gradient)."""
    intake = ref()
    if intake is not None:
        intake._folded(indices)


class _InboxHandle:
    """What removing a native inbox hook means: the hook passes the param's
    gradients through from then on (autograd's hooks cannot be taken off a
    node from C++), so the param trains on as plain PyTorch."""

    __slots__ = ("inbox", "index")

    def __init__(self, inbox, index: int) -> None:
        self.inbox, self.index = inbox, index

    def remove(self) -> None:
        _native._C.inbox_release(self.inbox, self.index)


def _grad_accumulator(param: torch.Tensor):
    """The param's AccumulateGrad node, whose pre-hooks autograd runs only
    where it adds into ``.grad`` (torch holds it weakly: its caller keeps it)."""
    with torch.enable_grad():  # (step() runs under no_grad, and unfrozen params are hooked there)
        return param.view_as(param).grad_fn.next_functions[0][0]


class _HookPair:
    """Two hooks of one param, removed together."""

    __slots__ = ("first", "second")

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def remove(self) -> None:
        self.first.remove()
        self.second.remove()


def _attach_weak(ref, index, grads):
    """A pre-hook of a param's gradient accumulator (intake "grad"): before
    autograd adds the gradient into ``.grad``, a ``.grad`` of None becomes the
    param's zero buffer where the intake can tell it is zero (GradIntake._attach);
    the gradient passes on unchanged."""
    intake = ref()
    if intake is not None:
        intake._attach(index)


def _take_and_drop(ref, index, grads):
    """A pre-hook of a param's gradient accumulator (intake "hooks"): the
    intake takes the gradient, and autograd gets none back to add into
    ``.grad`` (AccumulateGrad skips an undefined gradient; the param's
    post-accumulate-grad hooks still run)."""
    intake = ref()
    if intake is None:
        return None
    intake._arrive(index, grads[0])
    return (None,)


# The calls that take a tensor assigned to .grad into the window before step() does.
_READS_WINDOW = "state_dict(), accumulated_grad(), clip_grad_norm_(), a copy"


# Why intake "grad" refuses a counted window's step() (GradIntake.refuse_lost_sums).
_SUMS_OVERWRITTEN = (
    "the window's sums were written over between two of its step() calls (e.g. "
    "model.zero_grad(set_to_none=False), p.grad.zero_() or a clip after a micro-step's step()): with "
    "accum_steps=N, .grad holds the window's running sum, which the window's last step() clears, so "
    "no clear is needed there (optimizer.zero_grad() and model.zero_grad() are harmless). Its earlier "
    "micro-steps are lost: call optimizer.zero_grad() to start the window over"
)
_SUMS_EDITED = (
    ".grad was written in place after this micro-step's backward (torch.nn.utils.clip_grad_norm_ or "
    "clip_grad_value_, p.grad.mul_() or add_()): with accum_steps={n} and intake='grad', .grad holds the "
    "window's running sum of the undivided micro-batch gradients, which its last step() divides by {by} "
    "(normalize='{normalize}'): a clip there clips that undivided sum, not the gradient the step uses. "
    "Clip with max_grad_norm= or opt.clip_grad_norm_(max_norm), which clip the gradient the step uses "
    "(opt.clip_grad_norm_(float('inf')) returns its norm for logging, unclipped); for "
    "torch's clip on .grad, pass normalize='sum' and divide the loss by the window's {by_loss}, as torch's "
    "loop does; to drop a param's sum, set p.grad = None. The window was not stepped: call "
    "optimizer.zero_grad() to start it over"
)


def _refuse_clearing_taken_in(index: int | None, how: str = "") -> None:
    """A tensor assigned to ``.grad`` that a call reading the window took in
    (_READS_WINDOW) is a gradient of the window's micro-step now, in its sums
    (and in a checkpoint saved since): cleared by ``zero_grad()`` (``index``
    None) or ``how`` param ``index``'s ``.grad`` was cleared or replaced
    before step(), where plain PyTorch would discard it. Both intakes refuse it."""
    what = (
        f"zero_grad() between a call that took in a tensor assigned to .grad ({_READS_WINDOW}) and step()"
        if index is None
        else f"param {index}'s .grad was {how} after a call that reads the window ({_READS_WINDOW}) took in the "
        "tensor assigned to it, before step()"
    )
    raise RuntimeError(
        f"{what}: that tensor is a gradient of the window now (in its sums, and in a checkpoint saved since), where "
        "plain PyTorch would discard it. Clear .grad before assigning to it, or after step()"
    )


def _refuse_gradient_with_a_graph(index: int) -> None:
    """``backward(create_graph=True)``: torch's ``.grad`` is then a tensor of
    the graph (autograd adds out of place), which a gradient penalty through
    ``.grad`` differentiates; the fp32 buffer cannot carry a graph (the
    penalty's backward failed in autograd, on the buffer's in-place writes).
    Refused in the backward, before the gradient is taken in."""
    raise RuntimeError(
        f"param {index} got a gradient that is part of a graph (backward(create_graph=True)): with intake='grad' "
        ".grad is the param's fp32 buffer, which cannot carry a graph, so a penalty computed from .grad would "
        "add nothing to the step. Compute the penalty's gradients with torch.autograd.grad(loss, params, "
        "create_graph=True) and call backward() without create_graph, or use torch.optim's optimizer"
    )


def _how_cleared(grad: torch.Tensor | None) -> str:
    return "set to None" if grad is None else "replaced"


def _nonzero(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds a value other than zero: one host sync for all."""
    return torch.stack([t.ne(0).any() for t in tensors]).tolist() if tensors else []


def _remove(handles, markers=None) -> None:
    """Remove the hooks; a param whose ``.grad`` still holds its FoldedGrad
    marker (intake "hooks") gets None back, so that it trains on as plain PyTorch."""
    for handle in handles.values():
        handle.remove()
    for param, marker in (markers or {}).values():
        if param.grad is marker:
            param.grad = None


class Intake:
    """The interface the wrapper calls, and what both intakes share: ownership
    of the params, the per-param hooks (through a weak reference, so a dropped
    wrapper is freed at once), and noticing params that start requiring
    gradients after wrapping."""

    name = ""  # for messages only: the wrapper never branches on it
    # The buffers are .grad: the step clears them, and a reduction across ranks
    # must leave them averaged over the ranks (as DDP's .grad is).
    exposes_buffers = False
    zero_buffers_at_step = False
    supports_amp_scaling = False  # a GradScaler calls step() directly, leaving unscaling and skipping to us

    def __init__(
        self,
        layout: Layout,
        window: Window,
        *,
        backend: ops.Prepared,
        skip_nonfinite: bool,
        loss_scale,
        accum_steps: int | None,
        sync: Sync,
    ) -> None:
        # loss_scale(): the factor that unscales this micro-step's gradients (1.0 or a tensor);
        # sync: the window's cross-rank part, told when a bucket's window sum is
        # final (during the backward of the window's last micro-step).
        # Nothing here refers to the wrapper: dropping it frees it (and its buffers) at once.
        self.layout = layout
        self.window = window
        self.backend = backend
        self.skip_nonfinite = skip_nonfinite
        self.loss_scale = loss_scale
        self.sync = sync
        self.accum_steps = accum_steps
        # One process with plain params (no cross-rank reduction, no FSDP2
        # shard): there .grad can be torch.optim's own, None until a param's
        # first gradient (GradIntake) and the gradient a step() used after
        # close() (HookIntake._kept_used); a reduced or sharded buffer is neither.
        self.one_process = not sync.reduces_buffers and all(r.local_of is None for r in layout)
        self.repeated: tuple[int, int] = (0, -1)  # (the most gradients one param got since step(), that param)
        # torch.distributed initialized after the wrapper was built: noticed at
        # the first gradient, before a DDP module's reducer could act on it.
        self._watch_late_init = not (dist.is_available() and dist.is_initialized())
        # param index -> backward gradients received since the last step(); 0:
        # none, but a tensor assigned to .grad was taken in (intake "hooks")
        self.arrivals: dict[int, int] = {}
        self._handles: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._markers: dict[int, tuple[torch.Tensor, FoldedGrad]] = {}  # param index -> (param, its .grad marker)
        self._claim()
        self._scaler_checks = _amp.marker_checks()  # a GradScaler's inf checks of the markers seen so far
        self._ref = weakref.ref(self)
        weakref.finalize(self, _remove, self._handles, self._markers)
        self._hook_trainable()

    def _claim(self) -> None:
        for r in self.layout:
            ref = _OWNERS.get(r.param)
            if ref is not None and ref() is not None:
                raise RuntimeError(
                    f"param {r.index} (shape {tuple(r.param.shape)}) already feeds another AccumulatingOptimizer that "
                    "is still alive: its hooks would take the gradients and this one would step with empty "
                    "buffers. Call .close() on the other wrapper first (or delete it)"
                )
        for r in self.layout:
            _OWNERS[r.param] = weakref.ref(self)

    def _hook_trainable(self) -> list[ParamRecord]:
        """Hook every param that requires grad and has no hook yet; returns them.
        The others are remembered, to be looked at again at every step()."""
        candidates = getattr(self, "_unhooked", self.layout.records)
        new = [r for r in candidates if r.param.requires_grad]
        for r in new:
            self._handles[r.index] = self._register(r)
        self._unhooked = [r for r in candidates if r.index not in self._handles]
        return new

    def _register(self, r: ParamRecord):
        """The hook that hands ``r``'s gradients to ``_on_grad`` (post-accumulate-grad by default)."""
        return r.param.register_post_accumulate_grad_hook(functools.partial(_call_weak, self._ref, r.index))

    def refresh(self) -> None:
        """At every step(): params unfrozen since the last call get their hook
        now, and a gradient they already received is taken in. (Only the
        params without a hook are looked at: a param frozen later keeps its
        hook, which never fires, and its bucket is folded at step() instead of
        during backward.)"""
        if self._unhooked_require_grad():
            self.layout.refresh_expected()
            self._expected_changed()
            for r in self._hook_trainable():
                if r.param.grad is not None and r.param.grad is not r.marker:  # (taken in while frozen)
                    self._take_late(r)

    def _unhooked_require_grad(self) -> bool:
        """Whether a param without a hook (frozen when the hooks were made)
        requires grad now: autograd adds its gradients into ``.grad`` before
        anything here hears of them, until refresh() hooks it at step()."""
        return any(r.param.requires_grad for r in self._unhooked)

    def start_micro_step(self) -> None:
        """A step() call took this micro-step's gradients: count afresh."""
        self.arrivals.clear()
        self.repeated = (0, -1)

    def ready_for_backward(self) -> None:
        """Nothing of the wrapper's runs before the next backward (the end of
        step(), of load_state_dict(), of the constructor)."""

    def _expected_changed(self) -> None:
        """The layout's buckets expect other counts of gradients (params unfrozen)."""

    def backwards_since_step(self) -> tuple[int, int]:
        """(the most gradients any param got since the last step(), that param's
        index): (0, -1) when none got more than one."""
        return self.repeated

    def micro_step_has_gradients(self) -> bool:
        """Whether a gradient arrived since the last step() call (the micro-step
        in progress counts in a mid-window normalization)."""
        return self.window.grads_since_step

    def take_in(self) -> None:
        """What ``.grad`` holds joins the window, a tensor assigned there
        included (check_grads, then flush): at step(), and before a call that
        reads the window (_READS_WINDOW), as step() would take it."""
        self.check_grads()
        self.flush()

    def close(self, keep_grads: bool = False) -> None:
        """Hooks, markers and claims given back (``keep_grads``: GradIntake's)."""
        _remove(self._handles, self._markers)
        self._handles.clear()
        for r in self.layout:
            if _OWNERS.get(r.param) is not None and _OWNERS[r.param]() is self:
                del _OWNERS[r.param]

    def _refuse_late_init(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                "torch.distributed was initialized after this AccumulatingOptimizer was built, so it cannot reduce "
                "across ranks (nor take a DistributedDataParallel module over): build it after "
                "init_process_group (with HF Trainer: after TrainingArguments; with Accelerate: after Accelerator())"
            )
        self._watch_late_init = dist.is_initialized() is False and self.window.windows == 0

    def _on_grad(self, index: int, arg) -> None:
        """A param's hook: its gradient is ready (``arg``: what the hook got)."""
        if self._watch_late_init:
            self._refuse_late_init()
        r = self.layout.records[index]
        count = self.arrivals.get(index, 0) + 1
        self.arrivals[index] = count
        if count > self.repeated[0]:
            self.repeated = (count, index)
        self._take(r, arg)

    @property
    def folds_unscaled(self) -> bool:
        """Whether the window's sums are unscaled as they are taken (intake
        "hooks" with a GradScaler it knows); else they are as autograd made
        them, loss-scaled under AMP, and unscaled at the window's end."""
        return False

    @property
    def check_inf(self) -> bool:
        """Check gradients for inf/NaN as they are folded: with a GradScaler
        (given, or adopted later) or skip_nonfinite."""
        return self.skip_nonfinite or self.loss_scale.scaler is not None

    def last_micro_step(self) -> bool:
        """The gradients arriving now belong to the window's last micro-step."""
        return self.accum_steps is None or self.window.micro_steps + 1 >= self.accum_steps

    @staticmethod
    def _converted(r: ParamRecord) -> bool:
        """The param's dtype or device is no longer the one it was wrapped with."""
        return r.param.dtype is not r.dtype or r.param.device != r.device

    @classmethod
    def _check_param(cls, r: ParamRecord) -> None:
        """The param is as it was wrapped: its buffer, master weights and state
        dtype were chosen for that dtype and device (``model.to(...)`` after
        wrapping would step it with stale ones)."""
        param = r.param
        if cls._converted(r):
            raise RuntimeError(
                f"param {r.index} was {r.dtype} on {r.device} when AccumulatingOptimizer was built and is now "
                f"{param.dtype} on {param.device} (model.to() after wrapping): convert or move the model first, "
                "then build the optimizer and the wrapper (call opt.close() on this one first)"
            )
        if param.stride() != r.stride:
            raise RuntimeError(r.relaid())

    def check_params(self) -> None:
        """Before a window's step: every param as it was wrapped (_check_param),
        converted since its last gradient too (``model.to()`` before step())."""
        for r in self.layout:
            self._check_param(r)

    @staticmethod
    def _check_shape(r: ParamRecord, grad: torch.Tensor) -> None:
        if grad.shape != (r.param.shape if r.local_of is None else r.local.shape):
            raise RuntimeError(
                f"AccumulatingOptimizer: a gradient of shape {tuple(grad.shape)} arrived for param {r.index} of "
                f"shape {tuple(r.local.shape)}"
            )

    @classmethod
    def _check_arriving(cls, r: ParamRecord, grad: torch.Tensor) -> None:
        """A gradient about to be folded (and its param, _check_param): dense,
        of a gradient dtype, on the param's device, of its (local) shape. The
        common case costs a few attribute reads; the fold checks nothing again."""
        cls._check_param(r)
        if grad.layout is not torch.strided:
            raise RuntimeError(
                f"AccumulatingOptimizer: param {r.index} got a sparse gradient; the 'hooks' intake takes dense "
                "gradients only (intake='grad' adds sparse gradients into the dense buffer)"
            )
        if grad.dtype not in GRAD_DTYPES or grad.device != r.device:
            raise RuntimeError(
                f"AccumulatingOptimizer: a {grad.dtype} gradient on {grad.device} arrived for param {r.index} "
                f"({r.dtype} on {r.device}); expected float32, bfloat16 or float16 on the param's device"
            )
        cls._check_shape(r, grad)

    # ---- what the wrapper calls at fixed points of step() and the window's end ----

    def meet_scaler(self, optimizer, ends_window: bool) -> None:
        """A GradScaler may be calling ``optimizer.step()``: handle it (see each intake)."""
        raise NotImplementedError

    def report_micro_step(self, optimizer, step_found_inf) -> None:
        """After each micro-step: tell the GradScaler what its update() should see."""

    def end_window(self, optimizer) -> None:
        """The window's last step() call, before the cross-rank part."""

    def report_window(self, optimizer, found_inf: torch.Tensor) -> None:
        """The window's global inf flag is known (after the cross-rank part)."""

    def clip(self, records: list[ParamRecord], coef: torch.Tensor) -> None:
        """Apply opt.clip_grad_norm_'s coefficient to the window."""
        raise NotImplementedError

    # ---- what the buffers hold (HookIntake without a flat buffer differs) ----

    def held_scale(self, scale):
        """The factor the step (and a norm) applies to what the buffers hold,
        given the window's ``scale``: the buffers hold unscaled sums, so ``scale``."""
        return scale

    def window_sum(self, r: ParamRecord) -> torch.Tensor:
        """``r``'s unscaled window sum so far (fp32; a view of its buffer where it has one)."""
        return r.buffer

    def unscale_window(self, inverse_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """A GradScaler adopted mid-window: unscale and check what the window holds."""
        _amp.unscale_and_check(
            [self.layout.records[i].buffer for i in sorted(self.window.touched)], inverse_scale, found_inf
        )

    def saved_sums(self) -> torch.Tensor:
        """The window's sums as a checkpoint keeps them: a copy of the flat buffer."""
        return self.layout.flat.clone()

    def before_restore(self) -> None:
        """A mid-window checkpoint is about to replace the window (GradIntake
        notes which ``.grad`` holds a gradient now)."""

    def shown_grads(self) -> dict[int, torch.Tensor]:
        """Copies of the gradients the last step() used that ``.grad`` shows,
        uncleared (window.unzeroed), by param index, for show_grads after the
        buffers are laid out anew: none where ``.grad`` is a marker, which
        shows no values (intake "hooks")."""
        return {}

    def show_grads(self, grads: dict[int, torch.Tensor]) -> None:
        """shown_grads' copies (renumbered) go into the new buffers."""

    def saved_arrivals(self) -> list[list[int]]:
        """The gradients each param got since the last step(), as a checkpoint
        keeps them: [index, count] pairs."""
        return [[i, count] for i, count in sorted(self.arrivals.items())]

    def restore_sums(self, sums: torch.Tensor, arrivals: list | None) -> None:
        """A mid-window checkpoint's flat buffer and ``arrivals``
        (saved_arrivals'), after the window's own state (``touched``) is
        loaded: the micro-step in progress is the checkpoint's, so that a
        ``.grad`` dropped or replaced after its backward, or a second backward
        of the micro-step (accum_steps=N), is seen at step() as without the
        resume. (A checkpoint without them, saved after a backward: each param
        with a sum counts as having one gradient of this micro-step.)"""
        self._write_sums(sums)
        if arrivals is not None:
            self.arrivals.clear()
            self.arrivals.update((i, count) for i, count in arrivals)
            most = max(self.arrivals.values(), default=0)
            self.repeated = (most, next(i for i, c in self.arrivals.items() if c == most)) if most > 1 else (0, -1)
        elif self.window.grads_since_step:
            for i in self.window.touched:
                self.arrivals.setdefault(i, 1)

    def _write_sums(self, sums: torch.Tensor) -> None:
        """The checkpoint's sums into the buffers. Intake "hooks" overwrites a
        buffer at a param's first gradient of a window, so a checkpoint it
        saved may hold old sums where the window has none: zeros there."""
        self.layout.flat.copy_(sums)
        self.layout.zero_views(r for r in self.layout if r.index not in self.window.touched)

    def adopt_left_grads(self, kept_zero: set[int], used: set[int]) -> None:
        """After a load: the checkpoint's optimizer held these params' ``.grad``
        as a zero kept by ``zero_grad(set_to_none=False)`` (``kept_zero``) or
        as the gradient its last step() used, uncleared (``used``), outside
        its window's sums: what its close() leaves an optimizer rebuilt over
        the params (intake "hooks": see its own)."""

    def uncleared(self, indices: set[int]) -> set[int]:
        """Of ``indices`` (params the last step updated with a gradient), those
        whose ``.grad`` nothing cleared since: a ``.grad`` dropped or replaced,
        and put back as a gradient arrived, was noted then (window.unzeroed)."""
        raise NotImplementedError

    def refuse_lost_sums(self) -> None:
        """At step(), before anything is counted: refuse a window whose sums
        other code overwrote (intake "grad": see its own)."""

    def refuse_lost_used(self, what: str) -> None:
        """Where the window is saved or read, after take_in()
        (AccumulatingOptimizer._take_in_refusing_lost): refuse a window that
        lost what torch.optim's ``.grad`` holds (intake "hooks": see its own)."""

    def after_step(self) -> None:
        """The window's update is done (or skipped)."""

    def before_zero_grad(self) -> None:
        """zero_grad(), before anything is cleared: what the intake must take
        in (or refuse) first."""

    def zero_grad(self, set_to_none: bool) -> None:
        """zero_grad(), after the window recorded it: the intake's own clear."""


class HookIntake(Intake):
    name = "hooks"
    supports_amp_scaling = True

    def __init__(self, *args, **kwargs) -> None:
        self._pending: dict[int, list[tuple[ParamRecord, torch.Tensor]]] = {}  # bucket -> (record, gradient)
        self._accumulators: dict[int, object] = {}  # param index -> its AccumulateGrad node
        # The native inbox (csrc/grad_inbox.cpp), made at the first hook: a C++
        # pre-hook per param queues the common gradient without Python (see
        # _arrive for what "common" is) and hands over a bucket at a time
        # (_deliver); every other gradient comes to _arrive. Not with FSDP2
        # params, whose shards arrive by post-accumulate-grad hooks.
        self._inbox = None
        self._native_inbox = NATIVE_INBOX and _native.is_loaded() and all(r.local_of is None for r in args[0])
        super().__init__(*args, **kwargs)
        # Tell the sync of each bucket of the window's last micro-step, to
        # reduce it during backward; not on a pipeline stage, whose schedule
        # runs a backward per micro-batch before each step(): reduced there.
        self._reduces = self.sync.reduces_buffers and not self.sync.pipeline
        # Lean (a layout without a flat buffer: accum_steps=1, one process): a
        # window of one micro-batch sums nothing, so each param's gradient is
        # held as it arrived (its own dtype) and the step reads it, times the
        # loss scale's factor at its arrival (_held_unscale). A window that
        # must sum after all (a param's second gradient, a gradient not of its
        # param's dtype, a checkpoint's sums) gets the flat buffer, until its step.
        self.lean = self.layout.flat is None
        self._held_unscale = 1.0
        self._one = torch.ones(1, device=self.layout.device)
        self._armed = None  # what ready_for_backward last armed the inbox for (its key)
        # The last window's opt.clip_grad_norm_() coefficient: torch's clip scales
        # .grad in place, so the gradient that window's step used is clipped (_kept_grads).
        self._used_clip = None
        self._start_inbox()
        self.ready_for_backward()

    def _register(self, r: ParamRecord):
        cleared = functools.partial(_cleared_weak, self._ref, r.index)
        scaled = functools.partial(_scaled_weak, self._ref, r.index)
        if r.local_of is not None:
            # FSDP2 assigns the reduced shard to a .grad it finds None, or adds
            # it into the one it finds (the marker's sink takes it as a
            # gradient), and runs the post-accumulate-grad hooks itself.
            sink = functools.partial(_call_weak, self._ref, r.index)
            r.marker = FoldedGrad(r.local, r.index, sink=sink, cleared=cleared, scaled=scaled)
            self._markers[r.index] = (r.param, sharded_grad(r.marker, r.param))
            return r.param.register_post_accumulate_grad_hook(functools.partial(_shard_weak, self._ref, r.index))
        self._plain_marker(r)  # (also r.marker, read by _arrive: one attribute instead of two lookups)
        # A pre-hook of the param's gradient accumulator (kept alive: torch holds
        # it weakly). Autograd runs it after every tensor hook on the param,
        # whenever registered (a user's mask sees the gradient first, as in plain
        # PyTorch), and only where it accumulates into .grad: never in
        # torch.autograd.grad(). It returns no gradient: nothing is added into .grad.
        node = self._accumulators[r.index] = _grad_accumulator(r.param)
        slow = functools.partial(_take_and_drop, self._ref, r.index)
        if not self._native_inbox:
            return node.register_prehook(slow)
        if self._inbox is None:
            self._inbox = _native._C.inbox_new(
                functools.partial(_deliver_weak, self._ref),
                functools.partial(_folded_weak, self._ref),
                [b.expected for b in self.layout.buckets],
                len(self.layout),
            )
        _native._C.inbox_hook(
            self._inbox, r.index, r.bucket.index, r.param, r.marker, r.contiguous, r.buffer_stride, slow
        )
        return _InboxHandle(self._inbox, r.index)

    @property
    def folds_unscaled(self) -> bool:
        return _amp.is_enabled(self.loss_scale.scaler)

    def _plain_marker(self, r: ParamRecord) -> FoldedGrad:
        """The marker of plain param ``r``, made at its hook, or earlier where
        a ``.grad`` was assigned to it while frozen (taken in at step(): torch.optim
        steps it), and kept when it is hooked later (unfrozen)."""
        if r.index not in self._markers:
            cleared = functools.partial(_cleared_weak, self._ref, r.index)
            scaled = functools.partial(_scaled_weak, self._ref, r.index)
            added = functools.partial(_added_weak, self._ref, r.index)
            marker = FoldedGrad(r.param, r.index, cleared=cleared, scaled=scaled, added=added)
            self._markers[r.index] = (r.param, marker)
        r.marker = self._markers[r.index][1]
        return r.marker

    def _start_inbox(self) -> None:
        """A micro-step starts: the inbox may queue, unless every gradient must
        be seen by Python (torch.distributed watched for, or a sync told of
        each bucket as it completes)."""
        if self._inbox is not None:
            _native._C.inbox_start(self._inbox, not (self._watch_late_init or self._reduces))

    def start_micro_step(self) -> None:
        super().start_micro_step()
        self._start_inbox()

    def ready_for_backward(self) -> None:
        """Arm the native inbox to fold each complete bucket itself in the next
        backward (no Python but its bookkeeping, _folded), where that is
        the fold _deliver would make: a flat buffer, the native kernels, no
        loss scaler (its scale is read at the first fold of a micro-step), and
        a bucket whose params are all new to the window (overwrite) or all in
        it (add); any other bucket is delivered as before. The modes hold for
        one micro-step: within it, a bucket completes in the inbox only if none
        of its gradients went to Python, so nothing else changes what the window
        holds of it. They are worked out again only when the window's touched
        set, the hooks or the buffers changed (touched only grows within a
        window, and each window, or a loaded checkpoint, has a new set)."""
        layout = self.layout
        if self._inbox is None:
            return
        armable = (
            layout.flat is not None
            and not _amp.is_enabled(self.loss_scale.scaler)
            and self.backend.runs_native(layout.device)
        )
        armed = self._armed
        if not armable:
            if armed is not None:  # the inbox must not keep a buffer alive (lean: released at each step)
                _native._C.inbox_buffers(self._inbox, None)
                self._armed = None
            return
        touched = self.window.touched
        modes = None
        if armed is None or armed[3] is not layout.flat:
            _native._C.inbox_buffers(self._inbox, [r.buffer for r in layout.records])
            armed = None
        if armed is None or armed[0] is not touched or armed[1] != len(touched) or armed[2] != len(self._handles):
            modes = [self._fold_mode(bucket, touched) for bucket in layout.buckets]
            self._armed = (touched, len(touched), len(self._handles), layout.flat)
        _native._C.inbox_arm(self._inbox, modes, self.window.step_found_inf if self.check_inf else None)

    def _fold_mode(self, bucket: Bucket, touched: set[int]) -> int:
        """How the inbox folds ``bucket`` when complete (csrc/grad_inbox.cpp's
        FoldMode): 1, overwrite, when none of its params is in the window; 2,
        add, when every one that has a hook is; else 0, delivered to _deliver,
        which sorts the two kinds."""
        indices = [r.index for r in bucket.records]
        if touched.isdisjoint(indices):
            return 1
        if touched.issuperset(i for i in indices if i in self._handles):
            return 2
        return 0

    def _folded(self, indices: list[int]) -> None:
        """The inbox folded a bucket's gradients (of the params ``indices``,
        each its first of the micro-step) as _deliver would have: count them."""
        self.window.touched.update(indices)
        self.arrivals.update(dict.fromkeys(indices, 1))
        self.window.grads_since_step = True

    def _expected_changed(self) -> None:
        if self._inbox is not None:
            _native._C.inbox_expect(self._inbox, [b.expected for b in self.layout.buckets])

    def _deliver(self, bucket: int, taken: list[tuple[int, torch.Tensor]]) -> None:
        """The inbox queued all of ``bucket``'s gradients (``taken``: [(index,
        grad)], each a param's first of the micro-step, checked there as
        _arrive checks): fold them."""
        arrivals, records = self.arrivals, self.layout.records
        pending = self._pending.setdefault(bucket, [])
        for index, grad in taken:
            arrivals[index] = 1
            pending.append((records[index], grad))
        self.window.grads_since_step = True
        self._fold(self.layout.buckets[bucket])

    def _drain(self) -> None:
        """Take over what the inbox queued for buckets not yet complete, before
        anything here reads the micro-step's gradients or counts."""
        if self._inbox is None:
            return
        moved = _native._C.inbox_drain(self._inbox)
        if not moved:
            return
        records = self.layout.records
        for bucket, taken in moved:
            for index, _ in taken:
                self.arrivals[index] = 1
            self._pending[bucket] = [(records[i], g) for i, g in taken] + self._pending.get(bucket, [])
        self.window.grads_since_step = True

    def added(self, index: int, grad: torch.Tensor) -> None:
        """A gradient added into param ``index``'s marker where no hook of ours
        saw it (``p.grad.add_(g)``; autograd's add after an unfreeze, before
        the param is hooked): taken as its hook takes one."""
        self._arrive(index, grad)
        self._taken_past_inbox()

    def _taken_past_inbox(self) -> None:
        """A gradient was taken in where the native inbox did not see it (added
        into ``.grad``, or a tensor assigned there that state_dict() took in):
        the rest of the micro-step goes through Python. The inbox would take
        the param's next gradient as its first and fold the bucket by the
        modes worked out before, over this one (it was lost)."""
        if self._inbox is not None:
            _native._C.inbox_start(self._inbox, False)

    def _arrive(self, index: int, grad: torch.Tensor) -> None:
        """A hooked (plain) param's gradient, from its accumulator's pre-hook:
        ``_on_grad`` and ``_take`` written out in one function, which runs for
        every param at every micro-step (or, with the native inbox, only for
        the gradients it does not queue itself: a param's second of the
        micro-step, a .grad that is not the marker, a gradient laid out unlike
        its buffer, a param no longer as wrapped, and all while
        torch.distributed is watched for or a sync is told of each bucket). A
        gradient the common case does not describe goes to
        ``_check_arriving``, which names what is wrong."""
        self._drain()
        if self._watch_late_init:
            self._refuse_late_init()
        r = self.layout.records[index]
        arrivals = self.arrivals
        param = r.param
        if param.grad is not r.marker:
            if index in arrivals:  # (a gradient of this micro-step is folded: a backward's, or one assigned)
                self._drop_or_refuse(r, _how_cleared(param.grad))  # (torch's .grad holds what comes since)
            self._install_marker(r)
        count = arrivals[index] = arrivals.get(index, 0) + 1
        if count > 1 and count > self.repeated[0]:
            self.repeated = (count, index)
        # Autograd checked the gradient against the param (shape, dtype, device)
        # before this hook; what is left to check is that the param is still
        # as wrapped, and the gradient dense.
        if param.dtype is not r.dtype or grad.layout is not torch.strided or grad.device != r.device:
            self._check_arriving(r, grad)
        self._pend(r, self._laid_out(r, grad))

    def _pend(self, r: ParamRecord, grad: torch.Tensor) -> None:
        """Queue a checked gradient, laid out like ``r``'s buffer, for its
        bucket; a complete bucket is folded and, on the window's last
        micro-step, handed to the sync."""
        bucket = r.bucket
        last = self._reduces and self.last_micro_step()
        if last and self.sync.bucket_launched(bucket):
            self._refuse_launched()
        pending = self._pending.setdefault(bucket.index, [])
        pending.append((r, grad))
        self.window.grads_since_step = True
        if len(pending) >= bucket.expected:
            self._fold(bucket)
            if last:
                self.sync.bucket_ready(bucket)

    @staticmethod
    def _refuse_launched() -> None:
        raise RuntimeError(
            "AccumulatingOptimizer: a gradient arrived for a bucket whose cross-rank reduction has already "
            "started (a second backward in the window's last micro-step): sum the losses and call backward "
            "once per micro-step"
        )

    def cleared_in_place(self, index: int) -> None:
        """Param ``index``'s ``.grad`` (its marker) was zeroed in place
        (``model.zero_grad(set_to_none=False)``, ``p.grad.zero_()``):
        torch.optim keeps a zero gradient there, which it steps (momentum,
        weight decay), so the window does too. Where the param has a gradient
        in the window, folded or waiting for its bucket, torch.optim discards
        it: so does the window where it drops one param's sum
        (_drops_per_param), and the param is stepped with a zero gradient;
        elsewhere that is refused."""
        self._drain()
        window = self.window
        if (index in window.touched or index in self.arrivals) and self._drops_per_param():
            self._drop_sum(self.layout.records[index])
            window.unzeroed.discard(index)
            window.zero_grads.add(index)
            return
        if index in window.touched or index in self.arrivals:
            raise RuntimeError(
                f"param {index}'s .grad was zeroed in place (model.zero_grad(set_to_none=False), p.grad.zero_()) "
                "after its gradient of this window was folded: torch.optim would discard that gradient, which "
                "intake='hooks' cannot take out of the window for one param. Clear after the window's step() (or "
                "before its first backward; with accum_steps=N the window's last step() clears the sums, so no "
                "clear is needed between), call optimizer.zero_grad(), or use intake='grad'"
            )
        window.unzeroed.discard(index)
        if index in window.had_grad:  # (else torch.optim's .grad is None there: the marker outlives a clear)
            window.zero_grads.add(index)

    @torch.no_grad()
    def scaled_in_place(self, index: int, factor, divide: bool) -> None:
        """Param ``index``'s ``.grad`` (its marker) was scaled in place by a
        number (``p.grad.div_(n)``: a pipeline schedule's ``scale_grads``;
        ``mul_(c)``): torch.optim's ``.grad``, the window's sum so far, would
        be scaled, so the param's buffer is. Its bucket's gradients still
        waiting are folded first (that bucket only: a schedule's scale_grads
        calls this once per param); a lean window's held gradients (their
        own dtype) go into the flat buffer first, where the scaling rounds
        once in fp32. A param with no gradient in the window has nothing to
        scale (zeros, or torch.optim's None), unless its buffer keeps the
        gradient the last step() used, uncleared (close() leaves it in
        ``.grad``: scaled, as torch's). Refused where the param's bucket is
        being reduced across ranks in place."""
        self._drain()
        r = self.layout.records[index]
        if self._pending.get(r.bucket.index):
            self._fold(r.bucket)
        if index in self.window.touched:
            if self._reduces and self.sync.bucket_launched(r.bucket):
                raise RuntimeError(
                    f"param {index}'s .grad was scaled in place while its bucket is being reduced across ranks (from "
                    "the window's last backward on): scale the loss instead, or use intake='grad', whose .grad is "
                    "the reduced window"
                )
            if self.layout.flat is None:
                self._materialize()
        elif index not in self._kept_used():
            return
        factor = factor.reshape(()) if isinstance(factor, torch.Tensor) else factor
        (r.buffer.div_ if divide else r.buffer.mul_)(factor)

    def _on_shard(self, index: int) -> None:
        """An FSDP2 param's post-accumulate-grad hook: the reduced shard FSDP2
        assigned to a ``.grad`` it found None, or added into a tensor assigned
        there. (Added into the marker, its sink gave it to ``_on_grad`` already.)"""
        r = self.layout.records[index]
        grad = r.local_grad()
        if grad is None or grad is r.marker:
            return
        if index in self.arrivals:  # .grad held the marker: cleared or replaced since
            self._refuse_discarded(index, "set to None or replaced", assigned=self.arrivals[index] == 0)
        self.window.unzeroed.discard(index)  # cleared or replaced, as in plain PyTorch
        self._on_grad(index, grad)

    def _take(self, r: ParamRecord, grad: torch.Tensor) -> None:
        """An FSDP2 param's reduced shard (from ``_on_shard`` or the marker's
        sink): ``.grad`` becomes its marker. (Plain params: ``_arrive``.)"""
        self._check_arriving(r, grad)
        r.param.grad = self._markers[r.index][1]
        self._pend(r, self._laid_out(r, grad))

    @staticmethod
    def _laid_out(r: ParamRecord, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` with its buffer's strides. Autograd hands a gradient over in
        the layout its last op made (a transposed matmul's, say), before
        AccumulateGrad would lay it out like the param: the fold takes it laid
        out like the buffer."""
        if (r.contiguous and grad.is_contiguous()) or grad.stride() == r.buffer_stride:
            return grad
        return torch.empty_strided(grad.shape, r.buffer_stride, dtype=grad.dtype, device=grad.device).copy_(grad)

    def _queue(self, r: ParamRecord, grad: torch.Tensor) -> None:
        """Check a gradient found in ``.grad`` (put there by other code) and
        queue it for ``r``'s bucket, to be folded with the rest."""
        self._check_arriving(r, grad)
        self._pending.setdefault(r.bucket.index, []).append((r, self._laid_out(r, grad)))

    @staticmethod
    def _refuse_discarded(index: int, how: str, assigned: bool) -> None:
        """A param's ``.grad`` was cleared or replaced after a gradient of this
        micro-step arrived, found at step() or at the param's next gradient
        (``model.zero_grad()`` between a backward and step(), or between two
        backwards; ``assigned``: the gradient was a tensor assigned to
        ``.grad`` that a call reading the window took in): plain PyTorch would
        have discarded that gradient, which is folded."""
        if assigned:
            _refuse_clearing_taken_in(index, how)
        raise RuntimeError(
            f"param {index}'s .grad was {how} after its backward, before step() (e.g. model.zero_grad() between a "
            "backward and opt.step(), or between two backwards): in plain PyTorch that discards the gradient, but "
            "intake='hooks' has folded it into the window already, and drops a window's sums only all together. "
            "Clear after step() (or before the backward); to drop the gradients since the last step() there, call "
            "optimizer.zero_grad(), which discards the window so far (on one process), or use intake='grad'"
        )

    def _drops_per_param(self) -> bool:
        """Whether a param's ``.grad`` dropped, replaced or zeroed in place after
        its gradient of the window arrived (``model.zero_grad()`` between a
        backward and step(), or between two backwards) drops that param's sum
        (_drop_sum), as torch's clear drops its ``.grad``: where a window is
        one step() call's (accum_steps=None: with accum_steps=N a param the
        micro-step's backward did not reach may have been cleared before that
        backward, harmless there, or after it, which drops its sum: not told
        apart), on one process (elsewhere the sums are reduced, or FSDP2's),
        and with no inf/NaN check (the window's flag is of every gradient,
        the dropped ones included). Elsewhere refused (_refuse_discarded)."""
        return self.accum_steps is None and self.one_process and not self.check_inf

    def _drop_or_refuse(self, r: ParamRecord, how: str) -> None:
        """Param ``r``'s ``.grad`` was dropped or replaced (``how``) since its
        last gradient arrived, found at its next gradient, at step() or as it
        is hooked late: torch's clear drops that gradient. So is its sum here
        where the window drops one param's (_drops_per_param); elsewhere a
        gradient of this micro-step is folded already, which is refused (one
        of an earlier micro-step of a counted window stays in the sum: the
        clear may have come before this micro-step's backward, harmless)."""
        if self._drops_per_param():
            if r.index in self.arrivals or r.index in self.window.touched:
                self._drop_sum(r)
        elif r.index in self.arrivals:
            self._refuse_discarded(r.index, how, assigned=self.arrivals[r.index] == 0)

    def _drop_sum(self, r: ParamRecord) -> None:
        """Param ``r``'s window so far is dropped (_drops_per_param): its
        gradients waiting for its bucket, its sum (zeros: a window of
        accum_steps=None has its flat buffer) and its count; its ``.grad`` is
        the caller's to handle."""
        pending = self._pending.get(r.bucket.index)
        if pending:
            self._pending[r.bucket.index] = [(q, g) for q, g in pending if q is not r]
        if r.index in self.window.touched:
            r.buffer.zero_()
            self.window.touched.discard(r.index)
        self.arrivals.pop(r.index, None)

    def _install_marker(self, r: ParamRecord) -> None:
        """``.grad`` becomes (or stays) the marker. A tensor found there instead
        was put there by other code since (a pipeline schedule's manual
        accumulation, an assignment): it is a gradient too, taken in."""
        marker = self._markers[r.index][1]
        existing = r.param.grad
        if existing is not marker:
            self.window.unzeroed.discard(r.index)  # dropped or replaced: cleared, as in plain PyTorch
            if existing is not None:
                self._queue(r, existing)
            r.param.grad = marker

    def _take_late(self, r: ParamRecord) -> None:
        # A param hooked only now (refresh(): unfrozen) whose gradient of the
        # window arrived before (a checkpoint's, loaded while it was frozen):
        # its .grad is not its marker, so the marker was dropped or replaced
        # since (.grad = None, then autograd's new tensor), which drops that
        # gradient in torch, as check_grads finds for a hooked param (whose
        # call, before this one, leaves nothing to drop here).
        self._drop_or_refuse(r, "replaced")
        self.window.unzeroed.discard(r.index)  # a .grad assigned by other code replaced the last one
        # a gradient of this micro-step (no backward's: counted 0), which a .grad
        # dropped or replaced before step() discards in torch, as a backward's
        self.arrivals.setdefault(r.index, 0)
        self._queue(r, r.local_grad())
        r.param.grad = self._markers[r.index][1]
        self.window.grads_since_step = True
        self._taken_past_inbox()

    def flush(self) -> None:
        """Fold the gradients still waiting in incomplete buckets (params that
        got no gradient this micro-step leave their bucket incomplete)."""
        self._drain()
        for bucket in self.layout.buckets:
            if self._pending.get(bucket.index):
                self._fold(bucket)

    def uncleared(self, indices: set[int]) -> set[int]:
        """Those still holding their marker, unless the native inbox put it
        back into a cleared ``.grad`` as a gradient arrived: a clear noted in
        window.unzeroed here, as the Python hook notes it (the inbox tells it
        once, so a second call, a state_dict() before step() or close(), must
        find it there)."""
        if self._inbox is not None:
            remarked = _native._C.inbox_remarked(self._inbox)
            indices = indices.difference(remarked)
            self.window.unzeroed.difference_update(remarked)
        markers = self._markers
        return {i for i in indices if i in markers and markers[i][0].grad is markers[i][1]}

    def check_grads(self) -> None:
        """At step(): every param that got a gradient since the last step()
        still holds its marker; one found with None or another tensor was
        dropped or replaced after backward (``model.zero_grad()`` before
        step()), which in plain PyTorch discards the gradient: its sum here,
        already folded, is dropped where the window drops one param's
        (_drops_per_param), else that is refused. A gradient assigned to
        ``.grad`` by other code is taken in."""
        # Only hooked params hold a marker (a param without a hook has
        # received nothing to fold).
        self._drain()
        markers = self._markers
        if self._inbox is not None:  # it knows which .grad is not its marker: the only ones to look at
            markers = {i: markers[i] for i in _native._C.inbox_stray(self._inbox)}
        # A frozen param's .grad assigned by other code (or left by a closed
        # optimizer) is a gradient torch.optim steps: it gets a marker too;
        # one holding a marker already is looked at as a hooked one (a
        # .grad = None since is torch's drop: the param is no longer stepped).
        frozen = [
            r for r in self._unhooked if r.local_of is None and (r.param.grad is not None or r.index in self._markers)
        ]
        if frozen:
            markers = {**markers, **{r.index: (r.param, self._plain_marker(r)) for r in frozen}}
        for index, (param, marker) in markers.items():
            grad = param.grad
            if grad is marker:
                continue
            self._drop_or_refuse(self.layout.records[index], _how_cleared(grad))  # (then as one before it)
            if grad is None:  # no gradient, as in plain PyTorch: not stepped (nor with a zero gradient)
                self.window.forget_grad(index)
                continue
            self._take_late(self.layout.records[index])  # (a frozen param's too: torch.optim steps it)

    @torch.no_grad()
    def _fold(self, bucket: Bucket) -> None:
        taken = self._pending.pop(bucket.index, [])
        if self.layout.flat is None:
            if self._hold(taken):
                return
            self._materialize()
        found_inf = self.window.step_found_inf if self.check_inf else None
        scale = self.loss_scale()
        touched = self.window.touched
        # A param's first gradient of the window overwrites its buffer; every
        # later one (a second gradient in the same bucket included) adds.
        first, more, seen = [], [], set()
        for r, g in taken:
            (more if r.index in touched or r.index in seen else first).append((r, g))
            seen.add(r.index)
        for overwrite, pairs in ((True, first), (False, more)):
            if pairs:
                ops.accumulate_(
                    [r.buffer for r, _ in pairs],
                    [g for _, g in pairs],
                    scale,
                    overwrite=overwrite,
                    found_inf=found_inf,
                    backend=self.backend,  # Prepared: the gradients were checked as they arrived
                )
        for r, _ in taken:
            touched.add(r.index)

    def _hold(self, taken: list[tuple[ParamRecord, torch.Tensor]]) -> bool:
        """Lean: hold the gradients as they are (checked for inf/NaN where
        asked), unless one would need summing or converting (then False)."""
        touched, seen = self.window.touched, set()
        for r, g in taken:
            if r.index in touched or r.index in seen or g.dtype != r.dtype:
                return False
            seen.add(r.index)
        if self.check_inf:
            _amp.unscale_and_check([g for _, g in taken], self._one, self.window.step_found_inf)
        self._held_unscale = self.loss_scale()  # the same for every gradient of the (one) micro-step
        for r, g in taken:
            r.buffer = g
            touched.add(r.index)
        return True

    def _materialize(self) -> None:
        """Lean, and the window must sum after all: make the flat buffer, and
        fold the gradients held so far into it."""
        held = [r for r in self.layout if r.buffer is not None]
        grads = [r.buffer for r in held]
        self.layout.allocate()
        if held:
            ops.accumulate_([r.buffer for r in held], grads, self._held_unscale, overwrite=True, backend=self.backend)
        self._held_unscale = 1.0

    def held_scale(self, scale):
        if self.layout.flat is None and not (isinstance(self._held_unscale, float) and self._held_unscale == 1.0):
            return scale * self._held_unscale
        return scale

    def window_sum(self, r: ParamRecord) -> torch.Tensor:
        if self.layout.flat is not None or r.buffer is None:
            return r.buffer
        unscale = self._held_unscale  # a 1-element tensor keeps a 0-dim param's shape
        return r.buffer.float() * (unscale.reshape(()) if isinstance(unscale, torch.Tensor) else unscale)

    def unscale_window(self, inverse_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        if self.layout.flat is not None:
            super().unscale_window(inverse_scale, found_inf)
            return
        # The held gradients are checked, and the step unscales them (in fp32).
        _amp.unscale_and_check(
            [self.layout.records[i].buffer for i in sorted(self.window.touched)], self._one, found_inf
        )
        self._held_unscale = inverse_scale

    def saved_sums(self) -> torch.Tensor:
        if self.layout.flat is not None:
            return super().saved_sums()
        return self.layout.flat_of({i: self.window_sum(self.layout.records[i]) for i in self.window.touched})

    def restore_sums(self, sums: torch.Tensor, arrivals: list | None) -> None:
        """As Intake's; each param with a sum holds its marker again, as when
        the checkpoint was saved: a ``.grad`` dropped after the resume is seen
        (and, after a backward, refused as without it). One assigned a tensor
        (the copy of the sum a closed optimizer's close() left, which the
        checkpoint holds too) gets the checkpoint's sum, as intake "grad"'s
        buffer does: else step() would take that tensor in on top of it (a
        plain param frozen when this intake was built has no marker yet: it
        gets one, as a .grad assigned while frozen does at step())."""
        if self.lean:  # a window with sums: held in the flat buffer
            self.layout.allocate()
            self._held_unscale = 1.0
        super().restore_sums(sums, arrivals)
        for i in self.window.touched:
            r = self.layout.records[i]
            param, marker = self._markers.get(i, (None, None))
            if marker is None and r.local_of is None:
                param, marker = r.param, self._plain_marker(r)
            if marker is not None and param.grad is not marker:
                param.grad = marker

    def adopt_left_grads(self, kept_zero: set[int], used: set[int]) -> None:
        """A ``.grad`` no hook took (assigned: what a closed optimizer's close()
        left) on a param the checkpoint's optimizer held so is taken as that,
        not as a new gradient, which check_grads would fold into the window
        (where a clear of it before step(), torch's clear, is refused): a
        kept zero (all zeros) is stepped as one; a used gradient goes into the
        param's buffer, which keeps it as the used one (_kept_used: one
        process, accum_steps=None), so that a step() on it uncleared is
        refused and a clear is one, as in the optimizer saved. Each param
        holds its marker."""
        window = self.window
        candidates = [r for r in self._assigned() if r.local_of is None and r.index not in window.touched]
        if not (self.accum_steps is None and self.layout.flat is not None and self.one_process):
            used = set()
        zeros = [r for r in candidates if r.index in kept_zero and r.index not in used]
        adopted = [r for r, held in zip(zeros, _nonzero([r.param.grad for r in zeros])) if not held]
        adopted += [r for r in candidates if r.index in used]
        for r in adopted:
            if r.index in used:
                r.buffer.copy_(r.param.grad)
                window.unzeroed.add(r.index)
            if r.index in kept_zero:  # (stepped with a zero gradient in a window it gets none, until a clear)
                window.zero_grads.add(r.index)
            window.had_grad.add(r.index)
            r.param.grad = self._plain_marker(r)

    def _write_sums(self, sums: torch.Tensor) -> None:
        """As Intake's, but a buffer that keeps the gradient the last step()
        used, uncleared (_kept_used), keeps it: a load leaves ``.grad`` as it
        was where the checkpoint's window has no sum, as torch.optim's does."""
        keep = self._kept_used() - self.window.touched
        if not keep:
            super()._write_sums(sums)
            return
        layout = self.layout
        for r in layout:
            if r.index in self.window.touched:
                r.buffer.copy_(layout.view(r, sums))
            elif r.index not in keep:
                r.buffer.zero_()

    def _lost_used(self) -> set[int]:
        """Params with a gradient in the window on top of the uncleared one the
        last step() used, which their first fold of the window overwrote:
        torch.optim's ``.grad`` holds the two added (its step() is refused)."""
        return self.window.touched & self.uncleared(self._kept_used())

    def refuse_lost_used(self, what: str) -> None:
        lost = self._lost_used()
        if lost:
            raise RuntimeError(
                f"{what} with param {min(lost)}'s gradient of this window added onto the one the last step() used, "
                "uncleared: torch.optim's .grad holds the two added (step() refuses it), but intake='hooks' "
                "folded the new one over the old. Call optimizer.zero_grad() after each step() (or before each "
                "backward), as torch.optim's loops do, or use intake='grad'"
            )

    def close(self, keep_grads: bool = False) -> None:
        """As Intake's. With ``keep_grads`` (the wrapper's close()), on one
        process, a param whose marker stands for a gradient torch.optim's
        ``.grad`` would hold gets it as a tensor (in the param's gradient
        dtype), so an optimizer built next steps on it: the window's sum (times
        the loss scale, as it was folded unscaled, and an ``opt.clip_grad_norm_()``
        coefficient still to apply: torch's ``.grad`` before its step), the
        gradient the last step() used where nothing cleared it (the buffer
        keeps it until the next window's first gradient overwrites it; clipped
        by that window's ``opt.clip_grad_norm_()``, not by ``max_grad_norm=``,
        as intake "grad"'s), or a
        zero kept by ``zero_grad(set_to_none=False)``. Across ranks or sharded,
        None (a reduced buffer holds the ranks' sum, not DDP's or FSDP2's
        ``.grad``). A param whose window sum lost the uncleared gradient under
        it (_lost_used) keeps its marker, told why: a use of it raises."""
        kept, lost = [], set()
        if keep_grads:
            self.flush()
            lost = self._lost_used()
            if not self.sync.reduces_buffers:
                kept = self._kept_grads(lost)
        super().close()
        for r, grad in kept:
            r.param.grad = grad
        for index in lost:
            param, marker = self._markers[index]
            param.grad = marker
            marker.lost = (
                f"param {index}'s .grad: its optimizer was closed (close()) with this window's gradient added onto "
                "the one the last step() used, uncleared; intake='hooks' folded the new one over the old, so "
                "torch.optim's .grad (the two added) is not known. Call optimizer.zero_grad() after each step() "
                "(or before each backward)"
            )

    def _kept_used(self) -> set[int]:
        """The params whose buffer keeps the gradient the last step() used and
        nothing cleared since, as torch.optim's ``.grad`` keeps it (one
        process, accum_steps=None: the next window's first gradient
        overwrites it; lean, it was dropped at the step)."""
        if self.accum_steps is None and self.layout.flat is not None and self.one_process:
            return self.window.unzeroed
        return set()

    def _kept_grads(self, lost: set[int]) -> list[tuple[ParamRecord, torch.Tensor]]:
        """(record, the ``.grad`` close() leaves it) for the params that hold
        their marker and a gradient torch.optim's ``.grad`` would hold (not
        those in ``lost``: _lost_used). After a flush."""
        window = self.window
        factor = self.loss_scale()  # 1 / the scale, or 1.0
        factor = 1.0 / factor if isinstance(factor, float) else factor.reciprocal()
        if window.clip_coef is not None:
            factor = factor * window.clip_coef
        used = self._kept_used()
        kept = []
        for index, (param, marker) in self._markers.items():
            r = self.layout.records[index]
            if param.grad is not marker or r.local_of is not None or index in lost:
                continue
            dtype = getattr(param, "grad_dtype", None) or param.dtype
            if index in window.touched:
                kept.append((r, (self.window_sum(r) * factor).to(dtype)))
            elif index in used:
                used_grad = r.buffer if self._used_clip is None else r.buffer * self._used_clip
                kept.append((r, used_grad.to(dtype, copy=True)))
            elif index in window.zero_grads:
                kept.append((r, torch.zeros_like(param, dtype=dtype)))
        return kept

    def after_step(self) -> None:
        """The inbox forgets which markers it put back (a clear counts for the
        window after it); lean: the window's gradients (or flat buffer) are dropped."""
        if self._inbox is not None:
            _native._C.inbox_remarked(self._inbox)
        if self.lean:
            self._release_held()

    def _release_held(self) -> None:
        """Lean: the window's gradients held (or the flat buffer it made) are let go."""
        self.layout.release()
        self._held_unscale = 1.0

    def before_zero_grad(self) -> None:
        """Harmless where it belongs, after step() (or before a backward).
        Between a backward and its step() it discards the window so far
        (zero_grad), as plain PyTorch's clear discards ``.grad``, where the
        buffers are this process's own (one process, FSDP2's shards, which
        FSDP2 reduced during the backward, a pipeline stage's); where the
        wrapper reduces its buffers across ranks (DDP, sharded=True) it is
        refused, before the window records it (each bucket's reduction may
        have started during the backward), as is a clear of a tensor
        assigned to ``.grad`` that a call took in, in a counted window's
        micro-step without a backward (as with intake "grad": torch's loop
        would drop that tensor only, not the window so far)."""
        self._drain()
        if not self.window.grads_since_step:
            return
        if self.accum_steps is not None and self.arrivals and not any(self.arrivals.values()):
            _refuse_clearing_taken_in(None)
        if self.sync.reduces_buffers:
            raise RuntimeError(
                "zero_grad() between a backward and step() across ranks: in plain PyTorch that discards the "
                "gradients since the last step(), but intake='hooks' has folded them into the window's sums and "
                "hands each bucket to the cross-rank reduction as it completes, so it cannot discard them. Call "
                "zero_grad() after step() (or before the backward); to drop gradients that way (e.g. after a "
                "backward that failed part-way, out of memory), build the optimizer with intake='grad', whose "
                "zero_grad() there discards the window so far, as torch's does"
            )
        # The gradients waiting for their bucket are folded first, so that the
        # window knows every param with a gradient: a set_to_none=False clear
        # keeps each one's as zeros (Window.zero_grad), as torch's does.
        self.flush()

    def zero_grad(self, set_to_none: bool) -> None:
        """After step() (or before a backward): folds what is waiting; the
        window goes on. Between a backward and its step() (where
        before_zero_grad lets it): the window so far is discarded (_discard_window).
        A .grad no hook took (left from before wrapping, or assigned) is a
        gradient, cleared as in plain PyTorch: dropped, or with
        set_to_none=False kept as a zero gradient (stepped: window.zero_grads),
        which the marker stands for (the step zeroes its buffer)."""
        if self.window.grads_since_step:
            self._discard_window()
        else:
            self.flush()
        for r in self._assigned():
            marker = (r.param, self._plain_marker(r)) if r.local_of is None else self._markers.get(r.index)
            if not set_to_none:
                self.window.had_grad.add(r.index)
                self.window.zero_grads.add(r.index)
            r.param.grad = marker[1] if marker is not None and not set_to_none else None
        if set_to_none and not self.sync.reduces_buffers:
            # One process: .grad is None, as torch.optim's, not a marker that
            # code filling in the .grad that are None (with zeros, which
            # torch.optim steps) would skip; the next gradient puts it back
            # (unless a counted window goes on with its sum: a harmless clear).
            records = self.layout.records
            for index, (param, marker) in self._markers.items():
                if param.grad is marker and index not in self.window.touched and records[index].local_of is None:
                    param.grad = None

    def _discard_window(self) -> None:
        """``zero_grad()`` between a backward and step() (before_zero_grad): torch's
        clear drops ``.grad``, the gradients since its last step() (a counted
        loop's window so far), so the window so far is dropped, as intake
        "grad" drops it: its sums (zeros; lean, the gradients held are let go),
        its inf/NaN flags, clip coefficient, items and count of step() calls
        (the next N step() calls make the window). The gradients that waited
        for their bucket were folded, and the zeros a ``set_to_none=False``
        clear keeps recorded, before (before_zero_grad, Window.zero_grad)."""
        if self.lean:
            self._release_held()
        else:
            self.layout.zero_all()
        self.window.clear()
        self.window.step_found_inf.zero_()  # (in place: the armed inbox checks into it)
        self.start_micro_step()  # the discarded gradients count as no backward
        self.ready_for_backward()

    def _assigned(self) -> list[ParamRecord]:
        """The plain params whose .grad is a tensor no hook took (left from
        before wrapping, or assigned). The inbox lists the hooked params whose
        .grad is not their marker; the params without a hook are looked at too."""
        candidates = self.layout.records
        if self._inbox is not None and self._handles:
            candidates = [*(candidates[i] for i in _native._C.inbox_stray(self._inbox)), *self._unhooked]
        return [
            r
            for r in candidates
            if r.param.grad is not None and r.param.grad is not self._markers.get(r.index, (0, 0))[1]
        ]

    def set_grad(self, r: ParamRecord, grad: torch.Tensor | None) -> None:
        """``.grad`` for the fallback optimizer's step, then back to the marker."""
        r.param.grad = grad if grad is not None else self._markers.get(r.index, (None, None))[1]

    def meet_scaler(self, optimizer, ends_window: bool) -> None:
        """The GradScaler calls step() directly (the wrapper unscales and skips
        itself): looked for on the call stack only when it left a sign
        (_amp.may_be_driving), then adopted or checked (_amp.adopt)."""
        if not _amp.may_be_driving(optimizer, self._scaler_checks):
            return
        self._scaler_checks = _amp.marker_checks()
        driver = _amp.scaler_driving(optimizer)
        if driver is not None and driver.is_enabled():
            _amp.refuse_no_grads(optimizer, self.window.touched or self.arrivals)
            _amp.adopt(driver, optimizer, self.loss_scale, self, self.layout.device)

    def report_micro_step(self, optimizer, step_found_inf) -> None:
        """The scaler's update() after this step() call backs off on what it is
        told here: the micro-step's own flag on one process; across ranks,
        nothing (every rank's scaler sees the window's global flag at its end)."""
        scaler = self.loss_scale.scaler
        if _amp.is_enabled(scaler):
            flag = torch.zeros(1, device=self.layout.device) if self.sync.spans_ranks else step_found_inf
            _amp.report_found_inf(scaler, optimizer, self.layout.device, flag)

    def report_window(self, optimizer, found_inf: torch.Tensor) -> None:
        scaler = self.loss_scale.scaler
        if self.sync.spans_ranks and _amp.is_enabled(scaler):
            _amp.report_found_inf(scaler, optimizer, self.layout.device, found_inf)

    def clip(self, records: list[ParamRecord], coef: torch.Tensor) -> None:
        """As intake "grad"'s, the window so far is clipped now (its sums scaled
        in place), so that a gradient arriving after the clip (a later
        backward of the window) is not, as torch's clip of ``.grad`` leaves
        it, and a norm read after it is the clipped window's. (Before
        2026-12-08 the coefficient waited for the step and clipped those
        too: 1.3e-2 off torch's loop, silently.) Lean: the held gradients go
        into the flat buffer first, where the scaling rounds once, in fp32."""
        if not records:  # no gradient in the window (its norm is 0), as torch's on no .grad
            return
        if self.layout.flat is None:
            self._materialize()
        torch._foreach_mul_([r.buffer for r in records], coef)

    def end_window(self, optimizer) -> None:
        self._used_clip = self.window.clip_coef  # (before max_grad_norm='s is combined: applied in the step)


class GradIntake(Intake):
    name = "grad"
    exposes_buffers = True

    def __init__(self, *args, **kwargs) -> None:
        self._grad_dtypes = {}  # (before anything close() gives back)
        # One process (one_process): a param's .grad is None until its first
        # gradient, as torch.optim's (no zero buffer that code filling in or
        # editing the .grad that are None / not None would see otherwise): a
        # pre-hook of its gradient accumulator (kept alive here: torch holds
        # it weakly) makes its zero buffer .grad just before autograd adds into
        # it (_attach). Where buffers are reduced across ranks or sharded
        # (FSDP2), every param that requires grad holds its buffer as .grad,
        # the reduction's output on a rank without a gradient of its own.
        self._accumulators: dict[int, object] = {}
        super().__init__(*args, **kwargs)
        self._reduction_queued = False
        # accum_steps=N: why the window's sums are refused (refuse_lost_sums),
        # None where they are not: other code wrote into the buffers between
        # two step() calls after the window's first gradients, or edited the
        # undivided running sum after a micro-step's backward (_note_edited_sums)
        self._lost_sums: str | None = None
        # Whether a call raised it (refuse_lost_sums, refuse_lost_used): only
        # then does zero_grad() between two step() calls start the window over
        # (until then it is the harmless clear, and the refusal stays to come).
        self._lost_sums_told = False
        # accum_steps=None: the buffers keep the gradients a step used (the
        # params in _used), as torch.optim's .grad does, until a clear.
        self.zero_buffers_at_step = self.accum_steps is not None
        self._used: set[int] = set()
        # One process, accum_steps=None: the next backward's first gradient
        # reads whether the buffers of window.unzeroed were zeroed (_find_cleared)
        self._unzeroed_unread = False
        # Held by one attribute, as a record holds its view: _let_go_of_held
        # counts a view's references against it (see there).
        self._one_reference = object()
        self._held_before_load: set[int] = set()  # (before_restore: until the load's restore_sums)
        low = [r for r in self.layout if r.param.dtype != torch.float32]
        if low and not hasattr(low[0].param, "grad_dtype"):
            raise RuntimeError(
                f"intake='grad' needs torch >= 2.13 for {low[0].param.dtype} params (param.grad_dtype lets them "
                f"hold an fp32 .grad); this is torch {torch.__version__}: use intake='hooks'"
            )
        for r in self.layout:
            grad = r.param.grad  # a gradient from before wrapping counts, unless zero_grad() drops it
            if r.param.dtype != torch.float32:
                self._grad_dtypes[r.index] = r.param.grad_dtype
                # Any dtype: the fp32 buffer, a gradient autograd makes where
                # .grad is None (the param's, copied into the buffer), or one
                # code assigns (torch.distributed.checkpoint's zeros_like(param)).
                r.param.grad = None  # (torch refuses a grad_dtype other than the dtype of the .grad held)
                r.param.grad_dtype = None
            if grad is not None:
                _copy_into(r.buffer, grad)
                self.window.touched.add(r.index)
                self.window.grads_since_step = True
            if grad is not None or (r.param.requires_grad and not self.one_process):
                r.param.grad = r.buffer
        # The flat buffer's version counter when the intake last accounted for
        # every write into it, and whether a write it did not make was seen (see _take_written).
        self._account_writes()
        if self.sync.ddp is not None:
            self.sync.ddp.reclaim = self.reclaim_grads
        if self.sync.reduces_buffers:
            self.sync.reduce_window = functools.partial(_reduce_weak, self._ref)

    def reclaim_grads(self, params) -> None:
        """DistributedDataParallel(gradient_as_bucket_view=True) built after the
        wrapper made ``.grad`` a view of its buckets, holding a copy of the
        buffer: the buffers become ``.grad`` again. (Left to DDP, a param no
        backward reached in a window would keep the view, which step() takes
        as a gradient assigned by hand: it would step on DDP's stale copy.) A
        ``.grad`` that holds other values was assigned by hand, and stays."""
        ids = {id(p) for p in params}
        for r in self.layout:
            grad = r.param.grad
            if id(r.param) not in ids or grad is None or grad is r.buffer:
                continue
            if grad.dtype == r.buffer.dtype and grad.shape == r.buffer.shape and torch.equal(grad, r.buffer):
                self.set_grad(r, r.buffer)
        self._account_writes()

    def _register(self, r: ParamRecord):
        handle = super()._register(r)
        if not self.one_process:
            return handle
        # (Autograd runs the pre-hook only where it accumulates into .grad: never in torch.autograd.grad().)
        node = self._accumulators[r.index] = _grad_accumulator(r.param)
        return _HookPair(handle, node.register_prehook(functools.partial(_attach_weak, self._ref, r.index)))

    def _attach(self, index: int) -> None:
        """A gradient is about to be added into param ``index``'s ``.grad``
        (one process): a ``.grad`` of None becomes its buffer, where that is
        known to hold zeros (no sum in the window, no gradient a step used, no
        write since the intake accounted for every one), so that autograd adds
        into it in place; it was cleared (window.unzeroed). Otherwise autograd
        makes a new ``.grad``, which _take copies or adds into the buffer."""
        if self._unzeroed_unread:
            self._find_cleared()
        r = self.layout.records[index]
        if (
            r.param.grad is None
            and index not in self.window.touched
            and index not in self._used
            and not self._written_unaccounted()
        ):
            self.window.unzeroed.discard(index)
            self.set_grad(r, r.buffer)

    def _find_cleared(self) -> None:
        """The first gradient after a step() that left ``window.unzeroed`` (the
        params whose ``.grad`` holds the gradient it used, with no clear seen
        since), before autograd adds it: a buffer now all zeros was cleared
        where the version counter does not see it (``p.grad.data.zero_()``,
        the clear of older loops), and holds a zero gradient, as torch.optim's
        ``.grad`` would, so the next step() is no step on the old gradient
        (were those zeros the old gradient, both sums are the same). One host
        sync, only in a window that follows no clear seen otherwise."""
        self._unzeroed_unread = False
        records = [self.layout.records[i] for i in sorted(self.window.unzeroed)]
        records = [r for r in records if r.param.grad is r.buffer]
        for r, held in zip(records, _nonzero([r.buffer for r in records])):
            if not held:
                self.window.unzeroed.discard(r.index)
                self._used.discard(r.index)

    def _window_ends_with_this_backward(self) -> bool:
        """Whether ``.grad`` must hold the reduced window when this backward
        returns: the window's last micro-step (accum_steps=N); with
        accum_steps=None, where code may read ``.grad`` after any backward (a
        clip, a logged norm), what a DDP module says (no_sync() or not), and
        without one every backward (sync.each_backward: as DDP's without
        no_sync()), except on a pipeline stage, whose schedule reduces the
        window when its backwards end (_pipeline.reduce_when_backwards_end)."""
        if self.accum_steps is not None:
            return self.last_micro_step()
        intent = self.window.sync_intent
        return self.sync.each_backward if intent is None else intent

    def _at_window_start(self) -> bool:
        """A counted window (accum_steps=N) with nothing in it yet: no step()
        call and no gradient since the last window's step() (or since a
        zero_grad() discarded it)."""
        return self.accum_steps is not None and not self.window.micro_steps and not self.window.grads_since_step

    def _take_cleared(self, arriving: ParamRecord | None = None) -> None:
        """At a counted window's start, other code wrote into the buffers,
        which the last window's step() left zero. Still all zero (but
        ``arriving``'s, into which autograd just added its gradient), that was
        an in-place clear of ``.grad`` (``model.zero_grad(set_to_none=False)``,
        ``p.grad.zero_()``) where torch.optim's loop clears after its step():
        as there, the params with a gradient since the last
        ``zero_grad(set_to_none=True)`` keep a zero ``.grad`` and are stepped
        (momentum, weight decay). Values written are taken as gradients at
        step() (_take_written). Another write that leaves zeros there (torch's
        clip_grad_norm_ multiplying the zeroed buffers) counts as the clear
        too: neither the version counter nor the values tell them apart."""
        if not any(_nonzero([r.buffer for r in self.layout if r is not arriving])):
            self.window.zero_grad(set_to_none=False)
            self._account_writes()

    def _between_micro_steps(self) -> bool:
        """A counted window (accum_steps=N) holds sums of earlier micro-steps,
        and no gradient arrived since the last step(): a clear of ``.grad``
        here follows a micro-step's step(), where optimizer.zero_grad() is
        harmless (docs/optimizers.md)."""
        if self.accum_steps is None or not self.window.micro_steps:
            return False
        return not self.window.grads_since_step and bool(self.window.touched)

    def _take(self, r: ParamRecord, arg=None) -> None:
        self._check_param(r)
        grad = r.param.grad
        if grad is not None and grad.requires_grad:
            _refuse_gradient_with_a_graph(r.index)
        # Other code wrote into the buffers (autograd's add into .grad bumps
        # the version once): at a counted window's start, .grad may have been
        # cleared in place; between its micro-steps, the earlier micro-steps'
        # sums were overwritten; after this micro-step's earlier gradients, an
        # edit (torch's clip), noted now, before this gradient accounts for the
        # version counter. The last two are not told where the writes may be
        # autograd's adds of this backward into the buffers of params without
        # a hook that hold theirs as .grad (one each): those are their
        # gradients, which refresh() takes in at step(). (Before, any param
        # without a hook that required grad let every write through unnoted:
        # a torch clip of a backward's sums was stepped, silently.)
        unaccounted = self.layout.flat._version - self._seen_version - (grad is r.buffer)
        if unaccounted > 0:
            if self._at_window_start():
                self._take_cleared(r)
            elif unaccounted <= sum(q.param.requires_grad and q.param.grad is q.buffer for q in self._unhooked):
                pass
            elif self._between_micro_steps():
                self._note_overwritten_sums()
            elif self.window.grads_since_step:
                self._note_edited_sums()
        starts = not self.window.grads_since_step and self._micro_step_starts()  # (once a micro-step: no calls after)
        sync = self.sync
        if sync.reduces_buffers and not self._reduction_queued:
            if sync.started and not (self.accum_steps is None and sync.reopen()):
                raise RuntimeError(_refuse_after_reduction(self.accum_steps, sync))
            if self._window_ends_with_this_backward():
                # .grad must hold the reduced window when backward returns (the
                # framework clips and logs it next): reduce at the end of this backward.
                self._reduction_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._reduce)
        if grad is not r.buffer and grad is not None:
            # .grad was dropped (model.zero_grad()) or replaced: autograd made a
            # new one; it starts this param's sum over, as it would in plain
            # PyTorch, except where a counted window's micro-step starts with
            # it: the clear followed a step(), where it is as harmless as
            # optimizer.zero_grad() (and intake "hooks"'): it adds to the sum.
            self.window.unzeroed.discard(r.index)
            self._check_shape(r, grad)
            if starts and r.index in self.window.touched:
                r.buffer.add_(grad)
            else:
                self._let_go_of_held(r)
                _copy_into(r.buffer, grad)
                self.arrivals[r.index] = 1  # (this micro-step's earlier gradients were dropped with .grad)
            r.param.grad = r.buffer
        elif not self.layout.aliased(r):
            self._reattach(r)
        self.window.touched.add(r.index)
        self.window.grads_since_step = True
        # This gradient bumped the flat buffer's version once (autograd's add, or the copy above).
        version = self.layout.flat._version
        self._unseen_write |= version > self._seen_version + 1
        self._seen_version = version

    def backwards_since_step(self) -> tuple[int, int]:
        """As Intake's, of the gradients ``.grad`` still holds: a ``.grad``
        dropped or replaced after them dropped them, as in torch (flush()
        drops the sums), so a second backward before that clear is none of
        the micro-step's. (A scan only where some param got more than one.)"""
        if self.repeated[0] <= 1:
            return (0, -1)
        records = self.layout.records
        held = [(c, i) for i, c in self.arrivals.items() if c > 1 and records[i].param.grad is records[i].buffer]
        return max(held, key=lambda pair: pair[0], default=(0, -1))

    def _micro_step_starts(self) -> bool:
        """Whether a counted window's micro-step starts now, with its first
        gradient after a step(): a clear since that step() was harmless, so
        each param it dropped that holds a sum gets its buffer as ``.grad``
        again (_keep_cleared_sums). A ``.grad`` found dropped or replaced later
        in the micro-step was cleared after a gradient of it (between a
        backward and its step(), or between two backwards), which in torch
        dropped the sum too: its sum starts over (_take), or is dropped (flush()).
        A tensor taken in and dropped or replaced since (_taken_in) is refused first."""
        self._refuse_taken_in_dropped()
        if not self._between_micro_steps():
            return False
        self._keep_cleared_sums()
        return True

    def _keep_cleared_sums(self) -> None:
        """A clear after a counted window's step() (``model.zero_grad()``), seen
        at this micro-step's first gradient, was harmless: every param it
        dropped that holds a sum and got no gradient yet has its buffer as
        ``.grad`` again (frozen or unused ones too), so that a clear after this
        gradient is told apart from it (flush()). A tensor assigned to such a
        param's ``.grad`` there is a gradient added to the window, as flush()
        takes one at a step() (and intake "hooks" at either): it is added into
        the buffer, which becomes ``.grad`` again. (Before, only the param of
        the micro-step's first gradient added it: any other took it as a
        replacement, dropping the window's earlier micro-steps.) Once per
        micro-step (one pass over the params): those swept here take their
        gradients into their buffers in place."""
        version = self.layout.flat._version
        for r in self.layout:
            grad = r.param.grad
            if grad is r.buffer or r.index not in self.window.touched or r.index in self.arrivals:
                continue
            if grad is not None:
                self._check_shape(r, grad)
                r.buffer.add_(grad)
                self.window.unzeroed.discard(r.index)
                self._used.discard(r.index)
            self.set_grad(r, r.buffer)
        self._seen_version += self.layout.flat._version - version  # (the adds above are the intake's own)

    def _reattach(self, r: ParamRecord) -> None:
        """``r.buffer`` (still ``.grad``) was moved out of the flat buffer: its
        values go back into a new view, which becomes ``.grad`` again."""
        self._check_param(r)  # (model.to() moves the views out too, converted)
        detached = r.buffer
        r.buffer = self.layout.view(r)
        r.buffer.copy_(detached)
        self.set_grad(r, r.buffer)

    def _reduce(self) -> None:
        """The end of a backward whose window is reduced now: a gradient other
        code wrote into ``.grad`` joins first (the reduction zeroes the views
        of params without one); the reduction's own writes are accounted for."""
        self._reduction_queued = False
        self._take_written()
        self.sync.reduce_now()
        self._account_writes()

    def reduce_once(self) -> None:
        """A pipeline stage's schedule ran a step's backwards: reduce the window
        now, unless it holds no gradient since the last step() (an eval
        schedule), is reduced (the schedule may call this twice), or this
        intake was closed (its sync's reduce_window is cleared then)."""
        sync = self.sync
        if self.window.grads_since_step and not sync.finished and sync.reduce_window is not None:
            self._reduce()

    def _take_late(self, r: ParamRecord) -> None:
        """A param hooked only now (unfrozen since) holding a gradient: one
        autograd made (``.grad`` was None) is taken as if its hook had fired;
        one autograd added into its buffer (``.grad``) is a write _take_written
        finds by its values (a zero buffer there is no gradient: the param was
        unfrozen after a clear gave it its buffer back)."""
        if r.param.grad is not r.buffer:
            self._on_grad(r.index, r.param)

    def check_grads(self) -> None:
        """At step(): ``.grad`` dropped or replaced since backward is handled by flush()."""

    def flush(self, drop_assigned: bool = False) -> None:
        """Take what was written into the buffers in place (_take_written), then
        re-attach every view whose ``.grad`` was dropped or replaced since
        (``drop_assigned``: a tensor assigned there is dropped, only its having
        been a gradient kept: before_zero_grad)."""
        self._refuse_taken_in_dropped()
        self._take_written()
        # A counted window's micro-step with no gradient yet: a clear since its
        # step() was harmless (_micro_step_starts), and the sums stay. After its
        # first gradient, a .grad dropped was dropped after it (model.zero_grad()
        # between a backward and step()): as in torch, its sum is dropped, those
        # of params without a gradient in this micro-step (frozen, unused) too.
        harmless = self._between_micro_steps()
        # A tensor assigned to .grad there is a gradient of the micro-step, taken
        # in (arrivals 0) but no backward (grads_since_step): see _taken_in.
        assigned_is_taken_in = self._no_gradient_yet()
        # A tensor assigned to .grad, taken in below, is the first gradient since
        # the step(): a clear through .data before it is read then, as _attach
        # reads it before autograd's first (else a write after this take-in,
        # which counts as one after the window's gradient, would hide the
        # zeros), and again there (a clear through .data may come between).
        unread = self._unzeroed_unread
        for r in self.layout:
            grad = r.param.grad
            if drop_assigned and grad is not None and grad is not r.buffer:
                self.window.had_grad.add(r.index)
                r.param.grad = grad = r.buffer
            if grad is r.buffer and not self.layout.aliased(r):
                self._reattach(r)
                continue
            if grad is r.buffer:
                continue
            # A frozen param (requires_grad=False) holds no buffer as .grad; one
            # dropped after it had a gradient (model.zero_grad() after freezing
            # it) is forgotten below, but stays None: torch.optim skips it.
            frozen = grad is None and not r.param.requires_grad
            if frozen and not self._holds_grad(r.index):
                continue
            # cleared or assigned after a counted window's step(), before a gradient: see _take
            kept = harmless and r.index in self.window.touched
            if grad is None and kept:
                pass  # harmless
            elif grad is None:
                if r.index in self.window.touched or r.index in self._used:  # dropped: its sum is discarded
                    self._let_go_of_held(r)
                    r.buffer.zero_()
                    self.window.touched.discard(r.index)
                    self._used.discard(r.index)
                self.window.forget_grad(r.index)  # no gradient, as in plain PyTorch: not stepped
                self.arrivals.pop(r.index, None)  # (nor those of this micro-step: backwards_since_step)
            else:
                if unread:  # (earlier iterations kept what it reads: a view re-attached holds its values)
                    unread = False
                    self._find_cleared()
                    self._unzeroed_unread = bool(self.window.unzeroed)
                self._check_shape(r, grad)
                if kept:
                    r.buffer.add_(grad)  # a gradient too
                else:
                    self._let_go_of_held(r)
                    _copy_into(r.buffer, grad)
                    self.arrivals.pop(r.index, None)
                if assigned_is_taken_in:
                    self.arrivals.setdefault(r.index, 0)
                else:
                    self.window.grads_since_step = True
                self.window.touched.add(r.index)
                self._used.discard(r.index)
            self.window.unzeroed.discard(r.index)  # dropped or replaced: cleared, as in plain PyTorch
            # (a .grad dropped stays None, its buffer zero, until a gradient: _attach)
            if grad is not None or kept or not (frozen or self.one_process):
                self.set_grad(r, r.buffer)
        self._account_writes()  # (the writes above are the intake's own)

    def _holds_grad(self, index: int) -> bool:
        """Whether torch.optim's ``.grad`` of param ``index`` would be a tensor
        here: a sum in the window, a zero one kept by
        ``zero_grad(set_to_none=False)``, and with accum_steps=None, where
        step() is torch.optim's, any gradient that no ``.grad = None`` or
        ``zero_grad(set_to_none=True)`` dropped since (torch's loop for a
        counted window clears after the step() that ends it)."""
        window = self.window
        if index in window.touched or index in window.zero_grads:
            return True
        return self.accum_steps is None and any(index in s for s in (self._used, window.had_grad, window.unzeroed))

    def refuse_lost_sums(self) -> None:
        """A counted window (accum_steps=N) whose buffers other code wrote into
        between two step() calls, after its first micro-step
        (``model.zero_grad(set_to_none=False)``, ``p.grad.zero_()``): ``.grad``
        holds the window's running sum, so its earlier micro-steps are lost,
        where optimizer.zero_grad() and ``model.zero_grad()`` are harmless (and
        intake "hooks" refuses the write); or whose undivided running sum
        other code edited after a micro-step's backward (_note_edited_sums).
        Refused at every step() of the window, before anything is counted,
        until zero_grad() starts it over."""
        if self._between_micro_steps() and self._written_unaccounted():
            self._note_overwritten_sums()
        self._note_edited_sums()
        if self._lost_sums is not None:
            self._lost_sums_told = True
            raise RuntimeError(self._lost_sums)

    def refuse_lost_used(self, what: str) -> None:
        """Where the window is saved or read, after take_in(): a window that
        step() refuses (refuse_lost_sums) is not saved either, where a resumed
        run would step on its sums, nor read (accumulated_grad(), our clip)."""
        if self._lost_sums is not None:
            self._lost_sums_told = True
            raise RuntimeError(f"{what}: {self._lost_sums}")

    def _note_overwritten_sums(self) -> None:
        """Other code wrote into the buffers between two step() calls of a
        counted window, after its first micro-step: its earlier micro-steps'
        sums are lost (refuse_lost_sums). Noted wherever the intake accounts
        for a write, before it does (a backward, step(), and what takes the
        window in: zero_grad(), state_dict(), a copy), so that nothing after
        the write makes the window's sums look whole again."""
        if self._lost_sums is None:
            self._lost_sums = _SUMS_OVERWRITTEN
            self._lost_sums_told = False

    def _note_edited_sums(self) -> None:
        """A window that divides its sum at its step (normalize "mean" with
        accum_steps=N > 1; "items", whatever accum_steps, a window of one step()
        call too): other code wrote into the buffers after this micro-step's
        gradients (torch's ``clip_grad_norm_`` or ``clip_grad_value_``,
        ``p.grad.mul_(c)``). ``.grad`` holds the running sum of the undivided
        micro-batch gradients, N times what torch's loop holds with its loss
        divided by N ("mean"; "items": the items' count times): a clip there
        acts on that undivided sum, not on the gradient the step uses, so the
        window is refused (refuse_lost_sums) until zero_grad() starts it over.
        (Before 2026-12-08 a window of one step() under "items" was let
        through, as under "mean", whose divisor is 1 there: a clip stepped
        silently on a gradient clipped before its division.) A clear in place
        of every sum (``model.zero_grad(set_to_none=False)``) is torch's
        loop's clear, and stays harmless. Only after such a write: one host
        sync (are the sums all zero?)."""
        window = self.window
        divides = window.normalize == "items" or (window.normalize == "mean" and (self.accum_steps or 1) > 1)
        if (
            self._lost_sums is not None
            or not divides
            or not window.grads_since_step
            or self.layout.flat._version == self._seen_version  # (a write _take saw was noted there)
        ):
            return
        held = [r.buffer for r in self.layout if r.index in window.touched and r.param.grad is r.buffer]
        if any(_nonzero(held)):
            self._lost_sums = _SUMS_EDITED.format(
                n=self.accum_steps,
                by={"mean": "its micro-steps", "items": "its items"}[window.normalize],
                normalize=window.normalize,
                by_loss={"mean": "micro-batches", "items": "items (num_items)"}[window.normalize],
            )
            self._lost_sums_told = False

    def uncleared(self, indices: set[int]) -> set[int]:
        """Those whose ``.grad`` is still their buffer, unless something but
        autograd wrote into the buffers before this window's gradients or, in
        a window without any, since the last step (a write in place,
        ``model.zero_grad(set_to_none=False)``'s say, may have cleared any).
        Writes after the window's backward (GradScaler's unscale, a clip)
        clear nothing, unless they left the buffer all zeros: zeroed in place
        (a clear after the backward that added onto the old gradient, through
        ``.data`` too, which the version counter does not see), where
        torch.optim's step() steps zeros (one host sync, only where this
        would find any uncleared)."""
        if self._unzeroed_unread:  # (no gradient since the last step(): see _find_cleared)
            self._find_cleared()
            indices = indices & self.window.unzeroed
        if self._unseen_write:
            return set()
        if not self.window.grads_since_step and self.layout.flat._version != self._seen_version:
            return set()
        records = [self.layout.records[i] for i in sorted(indices)]
        records = [r for r in records if r.param.grad is r.buffer]
        # (only a buffer that held the used gradient, or the window's sum over
        # it: after add_param_group it is a zero buffer that stands for it, uncarried)
        holding = [r for r in records if r.index in self._used or r.index in self.window.touched]
        zeroed = {r.index for r, held in zip(holding, _nonzero([r.buffer for r in holding])) if not held}
        records = [r for r in records if r.index not in zeroed]
        return {r.index for r in records}

    def _take_written(self) -> None:
        """A gradient written into ``.grad`` in place, not by autograd
        (``p.grad.add_(g)``, ``p.grad.copy_(g)``, where torch.optim's user would
        have made ``.grad`` first), on a param with no gradient yet this window:
        torch.optim would step it, so it joins the window; where that ``.grad``
        was dropped since (``model.zero_grad()``), it is discarded, as in torch.
        The flat buffer's version counter tells whether anything wrote into it
        since the intake last accounted for every write (each gradient autograd
        adds bumps it once); only then, and only for the params without a
        gradient yet, are the values read (one host sync): a buffer no longer
        all zeros was written. (A param written in place with exact zeros stays
        without a gradient: torch.optim would step it with a zero gradient.)"""
        flat = self.layout.flat
        if not self._written_unaccounted():
            return
        if self._at_window_start():
            self._take_cleared()
            if flat._version == self._seen_version:  # (accounted for: a clear)
                return
        if self._between_micro_steps():
            self._note_overwritten_sums()
        self._note_edited_sums()
        if self.window.unzeroed:  # (a clear of the gradient the last step() used is told by these writes)
            self.window.unzeroed = self.uncleared(self.window.unzeroed)
        waiting = [
            r
            for r in self.layout
            if r.index not in self.window.touched and (r.param.grad is r.buffer or r.param.grad is None)
        ]
        for r, written in zip(waiting, _nonzero([r.buffer for r in waiting])):
            if not written:
                continue
            if r.param.grad is None:
                r.buffer.zero_()
            else:
                self._micro_step_starts()  # (this write may be its first gradient)
                self.window.touched.add(r.index)
                self.window.grads_since_step = True
        self._account_writes()

    def _written_unaccounted(self) -> bool:
        """Whether other code wrote into the flat buffer since the intake last
        accounted for every write: its version counter moved since, or moved
        by more than autograd's add at a gradient taken since (_take: such a
        gradient accounts for the counter, and _unseen_write keeps the
        write)."""
        return self.layout.flat._version != self._seen_version or self._unseen_write

    def _account_writes(self) -> None:
        """Every write into the flat buffer so far is accounted for."""
        self._seen_version, self._unseen_write = self.layout.flat._version, False

    def after_step(self) -> None:
        """The window's own writes into the buffers (unscaling, zeroing) are
        accounted for; unless the step cleared them, its params' buffers hold
        the gradient it used."""
        if not self.zero_buffers_at_step:
            self._used |= self.window.touched
            self._unzeroed_unread = self.one_process
        self._lost_sums = None
        self._account_writes()

    def shown_grads(self) -> dict[int, torch.Tensor]:
        records = [self.layout.records[i] for i in sorted(self.window.unzeroed)]
        return {r.index: r.buffer.clone() for r in records if r.param.grad is r.buffer}

    def show_grads(self, grads: dict[int, torch.Tensor]) -> None:
        """As Intake's: each buffer (``.grad``) holds the gradient the last
        step() used again, as torch.optim's ``.grad`` does until a clear (a
        clear through ``.data`` since is read at the next gradient or step(),
        as before: _find_cleared)."""
        for i, grad in grads.items():
            r = self.layout.records[i]
            if r.param.grad is r.buffer:
                r.buffer.copy_(grad)
                self._used.add(i)
        if grads:
            self._unzeroed_unread = self.one_process
            self._account_writes()  # (the intake's own writes)

    def restore_sums(self, sums: torch.Tensor, arrivals: list | None) -> None:
        self._used -= self.window.touched  # (their buffers are written, by the intake itself)
        super().restore_sums(sums, arrivals)
        self._lost_sums = None
        self._account_writes()

    def before_restore(self) -> None:
        self.flush()
        self._held_before_load = (self.window.touched | self._used) if self.accum_steps is None else set()

    def _write_sums(self, sums: torch.Tensor) -> None:
        """The checkpoint's sums go into the buffers of the params it holds sums
        for, and the others are zeros, but where step() is torch.optim's
        (accum_steps=None) a ``.grad`` that held a gradient before the load (the
        one the last step() used, or one taken when the optimizer was built
        over params holding gradients: a rebuilt optimizer) is left as it was,
        as torch.optim's load leaves ``.grad``, as a gradient already used: a
        step() with it uncleared is refused, as before the load; one of zeros
        (cleared in place before the rebuild) is a kept zero, stepped as
        torch.optim steps it."""
        held, self._held_before_load = self._held_before_load - self.window.touched, set()
        kept = [self.layout.records[i] for i in sorted(held)]
        for r, used in zip(kept, _nonzero([r.buffer for r in kept])):
            if used:
                self._used.add(r.index)
                self.window.unzeroed.add(r.index)
                self._unzeroed_unread = self.one_process  # (a clear through .data: see _find_cleared)
            else:
                self.window.had_grad.add(r.index)
                self.window.zero_grads.add(r.index)
        for r in self.layout:
            if r.index in self.window.touched:
                r.buffer.copy_(self.layout.view(r, sums))
            elif r.index not in held:
                r.buffer.zero_()
            # .grad is a tensor where the loaded window says torch.optim's would be (its sums, kept zeros)
            if r.param.grad is None and self._holds_grad(r.index):
                self.set_grad(r, r.buffer)
            elif r.param.grad is r.buffer and self.one_process and not self._holds_grad(r.index):
                r.param.grad = None

    def before_zero_grad(self) -> None:
        """What other code put into ``.grad`` since (written in place,
        assigned) joins the window first, so that the clear counts it
        (``set_to_none=False`` keeps it as a zero gradient). Except a tensor
        assigned to ``.grad`` in a counted window's micro-step without a
        gradient yet: there the clear is harmless (torch's loop for the window
        has none: the window's sums and its count of step() calls stay) and
        drops the tensor, as torch's clear would, keeping only that the param
        had a gradient. (Joined first, it made the clear one after a gradient,
        which discarded the window and started its count over: the next N
        step() calls stepped nothing, silently.)"""
        drop_assigned = self._no_gradient_yet()
        if drop_assigned and self._taken_in():
            _refuse_clearing_taken_in(None)
        self.flush(drop_assigned)

    def _no_gradient_yet(self) -> bool:
        """A counted window's micro-step without a gradient since its step()
        (a tensor taken in counts as none: _taken_in): a clear here is
        harmless, and a tensor assigned to ``.grad`` here is one to take in."""
        return self.accum_steps is not None and not self.window.grads_since_step

    def _taken_in(self) -> list[int]:
        """The params whose tensor assigned to ``.grad`` in a counted window's
        micro-step without a gradient yet was taken into the window since its
        step() by something other than step() or a backward (a state_dict():
        the checkpoint holds it): arrivals 0, no gradient counted. As with
        intake "hooks", it is the micro-step's gradient now: a clear of it
        before step() is refused (_refuse_clearing_taken_in), where torch's
        would drop it, and so is a tensor assigned over it; (before, zero_grad()
        there discarded the window and started its count over, .grad = None
        dropped every sum at step(), and in the window's first micro-step a
        tensor assigned over it replaced it, silently)."""
        return [i for i, count in self.arrivals.items() if count == 0]

    def micro_step_has_gradients(self) -> bool:
        return self.window.grads_since_step or bool(self._taken_in())

    def _refuse_taken_in_dropped(self) -> None:
        """Before anything changes (at a flush, at a micro-step's first
        gradient): a param whose ``.grad`` was taken in (_taken_in) and is no
        longer its buffer (set to None, or another tensor assigned over it)."""
        if not self._no_gradient_yet():
            return
        records = self.layout.records
        for i in self._taken_in():
            if records[i].param.grad is not records[i].buffer:
                _refuse_clearing_taken_in(i, _how_cleared(records[i].param.grad))

    def zero_grad(self, set_to_none: bool) -> None:
        """As ``optimizer.zero_grad()`` in plain PyTorch: the gradients the last
        step used, and those that no ``step()`` took yet (e.g. of a window a
        GradScaler skipped), are discarded (those written into ``.grad`` in
        place or assigned too: before_zero_grad()): every buffer holds zeros
        after it (``set_to_none`` is the window's to record)."""
        # The window so far is discarded (and so, after refuse_lost_sums told
        # it, is the rest of a window whose sums other code wrote over or
        # edited; a clear before that is the harmless one between two step()
        # calls, and the window stays refused: its sums are still lost).
        discard = self.window.grads_since_step or (self._lost_sums is not None and self._lost_sums_told)
        if set_to_none and self.one_process:
            for r in self.layout.records:
                if discard or r.index not in self.window.touched:  # (.grad becomes None below)
                    self._let_go_of_held(r)
        if discard or self._used:
            self.layout.zero_all()
            self._used.clear()
            if discard:
                self.window.clear()
                self.start_micro_step()  # the discarded gradients count as no backward
                self._lost_sums = None
            self._account_writes()
        if set_to_none:
            # .grad is None, as torch.optim's, not a zero buffer that code
            # filling in or editing .grad would see (unless a counted window
            # goes on with its sum: a harmless clear); on several ranks only
            # a frozen param's, which gets no gradient from autograd.
            records = self.layout.records
            if not self.one_process:
                records = [r for r in records if not r.param.requires_grad]
            for r in records:
                if r.param.grad is r.buffer and r.index not in self.window.touched:
                    r.param.grad = None

    def _let_go_of_held(self, r: ParamRecord) -> None:
        """``.grad`` was dropped (set to None, or replaced) and its buffer is
        about to be cleared or overwritten. torch.optim's clear drops the
        tensor, so a reference other code kept to ``.grad`` (a gradient logged
        or compared after the next window) keeps its values; here ``.grad`` was
        the buffer's view, which the clear zeroes and the next window adds
        into. Where such a reference is held (Python references to the view
        beyond the record's and ``.grad``'s), it gets a tensor of its own
        holding its values (swapped in: its own version counter too, so its
        edits are no writes into the buffers; where its TensorImpl is held
        beyond Python, as by an autograd graph that saved it, its data only),
        and the record a new view. (A view of ``.grad`` made by other code,
        such as ``p.grad.flatten()``, is not seen: docs/optimizers.md.)"""
        # The view's references beyond the record's and .grad's, counted
        # against an object held by one attribute and loaded alike: what the
        # interpreter's own references add (this frame's, the call's; fewer
        # where Python 3.14 borrows a local for a call) cancels.
        held, calibrated = r.buffer, self._one_reference
        beyond = sys.getrefcount(held) - sys.getrefcount(calibrated) - (r.param.grad is held)
        if not self.one_process or beyond <= 0:
            return  # (across ranks .grad stays the buffer)
        if r.param.grad is held:
            r.param.grad = None
        r.buffer, own = self.layout.view(r), held.detach().clone()
        try:
            torch.utils.swap_tensors(held, own)  # (its version counter too: edits of it are no writes here)
        except RuntimeError:
            held.data = own

    def set_grad(self, r: ParamRecord, grad: torch.Tensor | None) -> None:
        """Set ``.grad`` to a tensor of the param's own dtype (the fallback
        optimizer's input) or back to the fp32 view (None)."""
        r.param.grad = r.buffer if grad is None else grad

    def meet_scaler(self, optimizer, ends_window: bool) -> None:
        """The scaler unscales ``.grad`` (the buffers) and skips step() on inf
        itself: it must do that once per window. Looked for on the call stack
        only where that could be wrong (a step() that does not end the window)
        or a scaler was given (which must be the one stepping)."""
        if ends_window and self.loss_scale.scaler is None:
            return
        driver = _amp.scaler_driving(optimizer)
        if driver is not None and driver.is_enabled():
            _amp.refuse_unscaling_running_sum(driver, self.loss_scale, ends_window)

    def end_window(self, optimizer) -> None:
        """The inf/NaN check of the exposed buffers and, for a GradScaler that
        did not unscale this window (step() called directly), their unscaling,
        in one pass (_amp.check_exposed_window)."""
        if self.check_inf:
            buffers = [r.buffer for r in self.layout.records_of(self.window.touched)]
            _amp.check_exposed_window(
                optimizer, self.loss_scale.scaler, buffers, self.window.found_inf, self.layout.device
            )

    def clip(self, records: list[ParamRecord], coef: torch.Tensor) -> None:
        """``.grad`` is the buffers: clipped now, as torch's clip_grad_norm_ would.
        The write is the intake's own (where every earlier one was accounted
        for: one by other code stays to be looked at)."""
        if not records:  # no gradient in the window (its norm is 0), as torch's on no .grad
            return
        own = not self._written_unaccounted()
        torch._foreach_mul_([r.buffer for r in records], coef)
        if own:
            self._account_writes()

    def close(self, keep_grads: bool = False) -> None:
        """The buffers leave ``.grad``; a 16-bit param gets its own grad_dtype
        back, and a gradient assigned to its ``.grad`` by hand (fp32: the
        grad_dtype this intake gave it) is converted to that dtype, which
        torch requires of it from then on. With ``keep_grads`` (the wrapper's
        close()), a param whose ``.grad`` torch.optim would hold as a tensor
        keeps a copy of its buffer there (the gradient the user saw, converted
        alike), as after torch.optim's optimizer is dropped; the others get None.
        A param converted since it was wrapped (``model.to()`` after wrapping,
        which the step refuses) keeps what torch's conversion made of its
        ``.grad`` (the window's sum in its new dtype) and its new dtype's
        grad_dtype: nothing is taken in, so that close() still lets it go."""
        converted = {r.index for r in self.layout if self._converted(r)}
        if keep_grads and not converted:
            self.flush()  # (what was written into .grad or assigned since counts)
        super().close()
        if self.sync.reduces_buffers:
            self.sync.reduce_window = None  # a pipeline stage's schedule calls this intake no more
        for r in self.layout:
            if r.param.grad is r.buffer:
                r.param.grad = r.buffer.clone() if keep_grads and self._holds_grad(r.index) else None
            if r.index in self._grad_dtypes:
                grad, r.param.grad = r.param.grad, None
                dtype = self._grad_dtypes[r.index] if r.index not in converted else r.param.dtype
                r.param.grad_dtype = dtype
                if grad is not None:
                    r.param.grad = grad.to(r.param.dtype if dtype is None else dtype)


def _copy_into(buffer: torch.Tensor, grad: torch.Tensor) -> None:
    """buffer = grad, for a dense or sparse gradient."""
    if grad.layout == torch.strided:
        buffer.copy_(grad)
    else:
        buffer.zero_().add_(grad)


INTAKE_CLASSES = {"hooks": HookIntake, "grad": GradIntake}


def holds_buffers(intake: str, accum_steps: int | None, world_size: int, fsdp: bool) -> bool:
    """Whether the wrapper keeps its fp32 flat buffer between windows: not
    where a window is one micro-batch on one process with intake "hooks",
    whose gradients are held as they arrive (HookIntake: lean)."""
    return not (intake == "hooks" and accum_steps == 1 and world_size == 1 and not fsdp)


def make_intake(name: str, *args, **kwargs) -> Intake:
    """The intake ``name``. One that fails half-built gives back what it took
    (hooks, claims, ``.grad``) before its error goes on."""
    cls = INTAKE_CLASSES[name]
    intake = cls.__new__(cls)
    try:
        intake.__init__(*args, **kwargs)
    except BaseException:
        intake.close()
        raise
    return intake

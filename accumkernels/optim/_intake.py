"""How gradients get into AccumulatingOptimizer's fp32 buffers. Two intakes:

``HookIntake`` ("hooks"): a hook per param takes its gradient as autograd
computes it (a pre-hook of the param's gradient accumulator, run after the
param's own tensor hooks and before autograd would add it into ``.grad``; not
run in ``torch.autograd.grad()``, which accumulates nothing;
FSDP2: a post-accumulate-grad hook, once FSDP2 handed the reduced shard over);
when a bucket's gradients are all there, one ``accumulate_`` call folds them
into the buffers (cast, loss-scale and inf check in the same pass; a param's
first gradient of a window overwrites its buffer, so nothing is ever zeroed).
At most a bucket's worth of gradients lives beside the buffers.
``.grad`` holds a ``FoldedGrad`` marker (accumkernels.optim._folded) that
raises, naming what to use instead, wherever code tries to read it.

``GradIntake`` ("grad"): each param's ``.grad`` *is* its fp32 buffer view
(bf16/fp16 params get ``grad_dtype = torch.float32``), and autograd adds each
new gradient into it in place. Code that reads or edits ``.grad`` after
backward (framework clipping, ``GradScaler.unscale_``, norm logging) works on
the window's true sum. A marker hook per param records which params got a
gradient. The step clears the buffers (``zero_buffers=True``).

Both count the gradients each param receives between step() calls: with
``accum_steps=N`` a step() call is one micro-step, and a second backward
before it (a loop or framework that accumulates itself) is refused there.

A param is owned by one live intake at a time: a second wrapper over the same
params is refused until the first is closed.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from .. import ops
from ._folded import FoldedGrad
from ._layout import Bucket, Layout, ParamRecord
from ._window import Window

INTAKES = ("hooks", "grad")

# param -> weak reference to the intake that owns it
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _call_weak(ref, name, index, arg) -> None:
    """A hook's call into its intake, held weakly; ``arg`` is what the hook was
    given (the param for post-accumulate-grad hooks, the gradient for tensor hooks)."""
    intake = ref()
    if intake is not None:
        getattr(intake, name)(index, arg)


def _remove(handles, markers=None) -> None:
    """Remove the hooks; a param whose ``.grad`` still holds its FoldedGrad
    marker (intake "hooks") gets None back, so that it trains on as plain PyTorch."""
    for handle in handles.values():
        handle.remove()
    for param, marker in (markers or {}).values():
        if param.grad is marker:
            param.grad = None


class Intake:
    """What both intakes share: ownership of the params, the per-param hooks
    (through a weak reference, so a dropped wrapper is freed at once), and
    noticing params that start requiring gradients after wrapping."""

    name = ""
    zero_buffers_at_step = False

    def __init__(
        self,
        layout: Layout,
        window: Window,
        *,
        backend: str | None,
        skip_nonfinite: bool,
        loss_scale,
        accum_steps: int | None,
        bucket_done=None,
    ) -> None:
        # loss_scale(): the factor that unscales this micro-step's gradients (1.0 or a tensor);
        # bucket_done(bucket): called when this rank's window sum of a bucket is final
        # (distributed runs), during the backward of the window's last micro-step.
        # Nothing here refers to the wrapper: dropping it frees it (and its buffers) at once.
        self.layout = layout
        self.window = window
        self.backend = backend
        self.skip_nonfinite = skip_nonfinite
        self.loss_scale = loss_scale
        self.bucket_done = bucket_done
        self.accum_steps = accum_steps
        # torch.distributed initialized after the wrapper was built: noticed at
        # the first gradient, before a DDP module's reducer could act on it.
        self._watch_late_init = not (dist.is_available() and dist.is_initialized())
        self.arrivals: dict[int, int] = {}  # param index -> gradients received since the last step()
        self._claim()
        self._handles: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._markers: dict[int, tuple[torch.Tensor, FoldedGrad]] = {}  # param index -> (param, its .grad marker)
        self._hook = functools.partial(_call_weak, weakref.ref(self), "_on_grad")
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
            self._handles[r.index] = self._register(r, functools.partial(self._hook, r.index))
        self._unhooked = [r for r in candidates if r.index not in self._handles]
        return new

    def _register(self, r: ParamRecord, hook):
        """The hook that hands ``r``'s gradients to ``_on_grad`` (post-accumulate-grad by default)."""
        return r.param.register_post_accumulate_grad_hook(hook)

    def refresh(self) -> None:
        """At every step(): params unfrozen since the last call get their hook
        now, and a gradient they already received is taken in. (Only the
        params without a hook are looked at: a param frozen later keeps its
        hook, which never fires, and its bucket is folded at step() instead of
        during backward.)"""
        if self._unhooked and any(r.param.requires_grad for r in self._unhooked):
            self.layout.refresh_expected()
            for r in self._hook_trainable():
                if r.param.grad is not None:
                    self._take_late(r)

    def start_micro_step(self) -> None:
        """A step() call took this micro-step's gradients: count afresh."""
        self.arrivals.clear()

    def backwards_since_step(self) -> tuple[int, int]:
        """(the most gradients any param got since the last step(), that param's index)."""
        if not self.arrivals:
            return 0, -1
        index = max(self.arrivals, key=self.arrivals.get)
        return self.arrivals[index], index

    def close(self) -> None:
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
        self.arrivals[index] = self.arrivals.get(index, 0) + 1
        self._check_param(r)
        self._take(r, arg)

    @property
    def check_inf(self) -> bool:
        """Check gradients for inf/NaN as they are folded: with a GradScaler
        (given, or adopted later) or skip_nonfinite."""
        return self.skip_nonfinite or self.loss_scale.scaler is not None

    def last_micro_step(self) -> bool:
        """The gradients arriving now belong to the window's last micro-step."""
        return self.accum_steps is None or self.window.micro_steps + 1 >= self.accum_steps

    @staticmethod
    def _check_param(r: ParamRecord) -> None:
        """The param is as it was wrapped: its buffer, master weights and state
        dtype were chosen for that dtype and device (``model.to(...)`` after
        wrapping would step it with stale ones)."""
        if r.param.dtype != r.dtype or r.param.device != r.device:
            raise RuntimeError(
                f"param {r.index} was {r.dtype} on {r.device} when AccumulatingOptimizer was built and is now "
                f"{r.param.dtype} on {r.param.device} (model.to() after wrapping): convert or move the model first, "
                "then build the optimizer and the wrapper"
            )

    def _check_shape(self, r: ParamRecord, grad: torch.Tensor) -> None:
        if grad.shape != (r.param.shape if r.local_of is None else r.local.shape):
            raise RuntimeError(
                f"AccumulatingOptimizer: a gradient of shape {tuple(grad.shape)} arrived for param {r.index} of "
                f"shape {tuple(r.local.shape)}"
            )


class HookIntake(Intake):
    name = "hooks"

    def __init__(self, *args, **kwargs) -> None:
        self._pending: dict[int, list[tuple[ParamRecord, torch.Tensor]]] = {}  # bucket -> (record, gradient)
        self._accumulators: dict[int, object] = {}  # param index -> its AccumulateGrad node
        super().__init__(*args, **kwargs)

    def _register(self, r: ParamRecord, hook):
        if r.local_of is not None:  # FSDP2 assigns the reduced shard to .grad and runs these hooks itself
            return r.param.register_post_accumulate_grad_hook(hook)
        self._markers[r.index] = (r.param, FoldedGrad(r.param, r.index))
        # A pre-hook of the param's gradient accumulator (kept alive: torch holds
        # it weakly). Autograd runs it after every tensor hook on the param,
        # whenever registered (a user's mask sees the gradient first, as in plain
        # PyTorch), and only where it accumulates into .grad: never in
        # torch.autograd.grad().
        with torch.enable_grad():  # (step() runs under no_grad, and unfrozen params are hooked there)
            node = r.param.view_as(r.param).grad_fn.next_functions[0][0]
        self._accumulators[r.index] = node
        return node.register_prehook(lambda grads: hook(grads[0]))

    def _take(self, r: ParamRecord, arg) -> None:
        if r.local_of is not None:
            grad = r.local_grad()
            if grad is None:
                return
        else:
            grad = arg
            self._install_marker(r)
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"AccumulatingOptimizer: param {r.index} got a sparse gradient; the 'hooks' intake takes dense "
                "gradients only (intake='grad' adds sparse gradients into the dense buffer)"
            )
        self._check_shape(r, grad)
        if grad.stride() != r.buffer.stride() and not (grad.is_contiguous() and r.buffer.is_contiguous()):
            # Autograd hands a gradient over in the layout its last op made
            # (a transposed matmul's, say), before AccumulateGrad would lay it
            # out like the param: the fold takes it laid out like the buffer.
            grad = torch.empty_like(r.buffer, dtype=grad.dtype).copy_(grad)
        bucket = r.bucket
        last = self.bucket_done is not None and self.last_micro_step()
        if last and self.bucket_done.launched(bucket):
            raise RuntimeError(
                "AccumulatingOptimizer: a gradient arrived for a bucket whose cross-rank reduction has already "
                "started (a second backward in the window's last micro-step): sum the losses and call backward "
                "once per micro-step"
            )
        pending = self._pending.setdefault(bucket.index, [])
        pending.append((r, grad))
        self.window.grads_since_step = True
        if len(pending) >= bucket.expected:
            self._fold(bucket)
            if last:
                self.bucket_done(bucket)

    def _install_marker(self, r: ParamRecord) -> None:
        """Before autograd adds the gradient the hook just took into ``.grad``:
        ``.grad`` becomes (or stays) the marker, which absorbs that addition. A
        tensor found there instead was put there by other code since (a
        pipeline schedule's manual accumulation, an assignment): it is a
        gradient too, taken in."""
        marker = self._markers[r.index][1]
        existing = r.param.grad
        if existing is not marker:
            if existing is not None:
                self._pending.setdefault(r.bucket.index, []).append((r, existing))
            r.param.grad = marker
        marker.expect = True

    def _take_late(self, r: ParamRecord) -> None:
        self._pending.setdefault(r.bucket.index, []).append((r, r.local_grad()))
        if r.local_of is None:
            r.param.grad = self._markers[r.index][1]
        self.window.grads_since_step = True

    def flush(self) -> None:
        """Fold the gradients still waiting in incomplete buckets (params that
        got no gradient this micro-step leave their bucket incomplete)."""
        for bucket in self.layout.buckets:
            if self._pending.get(bucket.index):
                self._fold(bucket)

    def check_grads(self) -> None:
        """At step(): every param that got a gradient since the last step()
        still holds its marker; one found with None was dropped after backward
        (``model.zero_grad()`` before step()), which in plain PyTorch discards
        the gradient: its sum here is already folded, so that is refused. A
        gradient assigned to ``.grad`` by other code is taken in."""
        for r in self.layout:
            if r.local_of is not None:
                continue
            grad = r.param.grad
            marker = self._markers.get(r.index, (None, None))[1]
            if grad is marker or grad is None and r.index not in self.arrivals:
                continue
            if grad is None:
                raise RuntimeError(
                    f"param {r.index}'s .grad was set to None between its backward and step() (e.g. "
                    "model.zero_grad() before opt.step()): in plain PyTorch that discards the gradient, but "
                    "intake='hooks' has folded it into the window already. Call zero_grad() after step() (or before "
                    "the backward), or use intake='grad'"
                )
            if r.index in self._markers and r.param.requires_grad:
                self._take_late(r)

    @torch.no_grad()
    def _fold(self, bucket: Bucket) -> None:
        taken = self._pending.pop(bucket.index, [])
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
                    backend=self.backend,
                )
        for r, _ in taken:
            touched.add(r.index)
            if r.local_of is not None:
                r.param.grad = None

    def zero_grad(self) -> None:
        """Harmless where it belongs, after step() (or before a backward):
        folds what is waiting, the window goes on. Between a backward and its
        step() it is refused: plain PyTorch would discard that gradient, which
        this intake has folded already."""
        if self.window.grads_since_step:
            raise RuntimeError(
                "zero_grad() between a backward and step(): in plain PyTorch that discards the gradient, but "
                "intake='hooks' has folded it into the window already. Call zero_grad() after step() (or before the "
                "backward), or use intake='grad'"
            )
        self.flush()
        for (
            r
        ) in self.layout:  # a .grad no hook took (left from before wrapping, or assigned): dropped, as in plain PyTorch
            if (
                r.local_of is None
                and r.param.grad is not None
                and r.param.grad is not self._markers.get(r.index, (0, 0))[1]
            ):
                r.param.grad = None

    def set_grad(self, r: ParamRecord, grad: torch.Tensor | None) -> None:
        """``.grad`` for the fallback optimizer's step, then back to the marker (None under FSDP2)."""
        r.param.grad = (
            grad if grad is not None or r.local_of is not None else self._markers.get(r.index, (None, None))[1]
        )


class GradIntake(Intake):
    name = "grad"
    zero_buffers_at_step = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reduction_queued = False
        self._grad_dtypes = {}
        for r in self.layout:
            if r.param.dtype != torch.float32:
                if not hasattr(r.param, "grad_dtype"):
                    raise RuntimeError(
                        f"intake='grad' needs torch >= 2.13 for {r.param.dtype} params (param.grad_dtype lets them "
                        f"hold an fp32 .grad); this is torch {torch.__version__}: use intake='hooks'"
                    )
                self._grad_dtypes[r.index] = r.param.grad_dtype
                r.param.grad_dtype = torch.float32
            if r.param.grad is not None:  # a gradient from before wrapping counts, unless zero_grad() drops it
                _copy_into(r.buffer, r.param.grad)
                self.window.touched.add(r.index)
                self.window.grads_since_step = True
            if r.param.requires_grad:
                r.param.grad = r.buffer

    def _window_ends_with_this_backward(self) -> bool:
        if self.accum_steps is not None:
            return self.last_micro_step()
        return bool(self.window.sync_intent)  # a DDP module said so; else the reduction waits for step()

    def _take(self, r: ParamRecord, arg=None) -> None:
        grad = r.param.grad
        reducer = self.bucket_done
        if reducer is not None and not self._reduction_queued:
            if reducer.started:
                raise RuntimeError(
                    "AccumulatingOptimizer: a gradient arrived after this window's cross-rank reduction (a second "
                    "backward in the window's last micro-step): sum the losses and call backward once per micro-step"
                )
            if self._window_ends_with_this_backward():
                # .grad must hold the reduced window when backward returns (the
                # framework clips and logs it next): reduce at the end of this backward.
                self._reduction_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._reduce)
        if grad is not r.buffer and grad is not None:
            # .grad was dropped (model.zero_grad()) or replaced: autograd made a
            # new one; it starts this param's sum over, as it would in plain PyTorch.
            self._check_shape(r, grad)
            _copy_into(r.buffer, grad)
            r.param.grad = r.buffer
        elif not self.layout.aliased(r):
            self._reattach(r)
        self.window.touched.add(r.index)
        self.window.grads_since_step = True

    def _reattach(self, r: ParamRecord) -> None:
        """``r.buffer`` (still ``.grad``) was moved out of the flat buffer: its
        values go back into a new view, which becomes ``.grad`` again."""
        detached = r.buffer
        r.buffer = self.layout.view(r)
        r.buffer.copy_(detached)
        self.set_grad(r, r.buffer)

    def _reduce(self) -> None:
        self._reduction_queued = False
        self.bucket_done.reduce_now()

    def _take_late(self, r: ParamRecord) -> None:
        self._on_grad(r.index, r.param)

    def check_grads(self) -> None:
        """At step(): ``.grad`` dropped or replaced since backward is handled by flush()."""

    def flush(self) -> None:
        """Re-attach every view whose ``.grad`` was dropped or replaced since."""
        for r in self.layout:
            grad = r.param.grad
            if grad is r.buffer and not self.layout.aliased(r):
                self._reattach(r)
                continue
            if grad is r.buffer or (grad is None and not r.param.requires_grad):
                continue
            if grad is None:
                if r.index in self.window.touched:  # dropped mid-window: its sum is discarded
                    r.buffer.zero_()
                    self.window.touched.discard(r.index)
            else:
                self._check_shape(r, grad)
                _copy_into(r.buffer, grad)
                self.window.touched.add(r.index)
            self.set_grad(r, r.buffer)

    def zero_grad(self) -> None:
        """As ``optimizer.zero_grad()`` in plain PyTorch: gradients that no
        ``step()`` took yet (e.g. of a window a GradScaler skipped) are
        discarded; right after a step there is nothing to discard."""
        if self.window.grads_since_step:
            self.layout.zero_views(self.layout.records[i] for i in self.window.touched)
            self.window.clear()
        self.flush()

    def set_grad(self, r: ParamRecord, grad: torch.Tensor | None) -> None:
        """Set ``.grad`` to a tensor of the param's own dtype (the fallback
        optimizer's input) or back to the fp32 view."""
        if grad is None or grad is r.buffer:
            if r.index in self._grad_dtypes:
                r.param.grad_dtype = torch.float32
            r.param.grad = r.buffer
        else:
            r.param.grad = None
            if r.index in self._grad_dtypes:
                r.param.grad_dtype = self._grad_dtypes[r.index]
            r.param.grad = grad

    def close(self) -> None:
        super().close()
        for r in self.layout:
            if r.param.grad is r.buffer:
                r.param.grad = None
            if r.index in self._grad_dtypes:
                r.param.grad_dtype = self._grad_dtypes[r.index]


def _copy_into(buffer: torch.Tensor, grad: torch.Tensor) -> None:
    """buffer = grad, for a dense or sparse gradient."""
    if grad.layout == torch.strided:
        buffer.copy_(grad)
    else:
        buffer.zero_().add_(grad)


def make_intake(name: str, *args, **kwargs) -> Intake:
    return {"hooks": HookIntake, "grad": GradIntake}[name](*args, **kwargs)

"""AccumulatingOptimizer: gradient accumulation into fp32 buffers, one fused step per window.

The class holds the arguments, the ``torch.optim.Optimizer`` surface, the
orchestration of ``step()`` and the assembly of state dicts. ``step()`` and
the window's end are a fixed sequence of calls on three parts, whatever the
setup: the intake (``_intake.Intake``: how gradients get into the buffers,
GradScaler, clipping in place or at the step), the sync (``_sync.Sync``: the
window's cross-rank part: none, buckets reduced across ranks, FSDP2) and the
updater (``_update.Updater``: the fused and fallback steps, master weights,
norms). The other concerns: ``_layout`` (the flat buffer, buckets, a record
per param), ``_window`` (what the window has seen, normalization),
``_checkpoint`` (loading safely), ``_guards`` (the mistakes refused).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from itertools import chain
from typing import Any

import torch
from torch._C._profiler import _RecordFunctionFast
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .. import ops
from . import _checkpoint, _fsdp, _guards
from ._amp import LossScale
from ._intake import INTAKE_CLASSES, INTAKES, holds_buffers, make_intake
from ._layout import Layout, param_signature
from ._options import check_groups, check_options
from ._sync import make_sync
from ._update import Updater, clip_coefficient
from ._window import Window, run_seed

# The wrapper's arguments check_options validates (all but grad_scaler,
# skip_nonfinite and backend, checked where they are used).
_CHECKED_ARGUMENTS = (
    "normalize",
    "max_grad_norm",
    "master_weights",
    "stochastic_rounding",
    "state_dtype",
    "seed",
    "intake",
    "bucket_cap_mb",
    "process_group",
    "sharded",
    "wire_dtype",
)


def _checked_options(optimizer, arguments: dict):
    """check_options for ``optimizer`` as it is now, with the wrapper's ``arguments``."""
    return check_options(optimizer, arguments["accum_steps"], **{k: arguments[k] for k in _CHECKED_ARGUMENTS})


class AccumulatingOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim`` optimizer to accumulate gradients exactly and step once per window.

    ::

        opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                                    accum_steps=8, max_grad_norm=1.0)
        for x, y in loader:
            loss_fn(model(x), y).backward()   # no division by accum_steps
            opt.step()                        # steps the weights once every 8 calls
            opt.zero_grad()                   # harmless

    The window's gradient of a param is ``grad_scale * sum(micro-batch gradients)`` with::

        grad_scale = c / D           c = min(1, max_norm / (norm + 1e-6)) if clipping, else 1
        D = window length (normalize="mean"), 1 ("sum"), or the window's total
            of step(num_items=...) ("items"), over every rank's micro-batches

    SGD, Adam and AdamW step with the fused step-and-zero kernel, their
    hyperparameters read from ``param_groups`` at every window (LR schedulers
    work); any other optimizer gets the window's gradient as ``.grad``. A param
    with no gradient in a window is skipped, as ``torch.optim`` skips ``grad is None``.

    **Many processes.** With ``torch.distributed`` initialized, W ranks of N
    micro-steps equal one process with W*N micro-batches: the buffers are summed
    across ranks once per window, and one small all-reduce of the window's
    flags, counts and which params got a gradient ends it (the only host sync
    of a distributed window). A ``DistributedDataParallel`` model is taken over
    (DDP sends nothing); an FSDP2 (``fully_shard``) model keeps fp32 buffers for
    this rank's shards only. Every rank calls ``step()`` the same number of times.

    Args:
        optimizer: the optimizer to wrap (groups added later go through the
            wrapper's ``add_param_group``, between windows).
        accum_steps: micro-steps per window (or a ``WindowPlan`` from ``plan_window``);
            ``None``: every ``step()`` call ends a window (frameworks, which count the
            window and scale the loss themselves). ``1`` on one process (intake
            ``"hooks"``): no fp32 buffer is held, the step reads each gradient as
            it arrived (in its param's dtype), as nothing is summed.
        normalize: ``"mean"``, ``"sum"`` or ``"items"`` (see above).
        max_grad_norm: clip the window's gradient to this global L2 norm.
        master_weights: ``True``: keep fp32 master weights of bf16/fp16 params
            (4 bytes per param); ``"remainders"``: keep the low 16 bits of bf16
            params' fp32 masters (2 bytes; param and remainder are the fp32
            master bit for bit).
        stochastic_rounding: round updated bf16 params stochastically
            (unbiased; no extra memory). Default (None): on for bf16 params
            without master weights; ``False``: round to nearest even.
        state_dtype: the dtype of the optimizer state (momentum, Adam's
            moments): ``torch.float32``, ``torch.bfloat16`` (rounded
            stochastically) or ``"8bit"`` (SGD, Adam and AdamW: uint8 codes
            with a scale per block of 256, encoded stochastically; the format is
            accumkernels._state8's; no amsgrad; its
            state_dict holds the codes and scales, and
            ``accumkernels.optim.dequantized_state_dict`` turns it into one
            torch.optim.AdamW loads). Default (None): bf16 for bf16 params
            without master weights, else fp32.
        seed: the stochastic-rounding seed of the run (default: drawn from torch's
            CPU generator without advancing it, as torch.optim leaves it);
            saved in ``state_dict()``.
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss, if any (one
            that calls ``step()`` is found without it); a window with an inf or NaN
            is skipped whole and the scaler backs off.
        skip_nonfinite: skip a window with an inf or NaN gradient (no scaler needed).
        intake: ``"hooks"`` (fold gradients into the buffers during backward and
            free ``.grad``) or ``"grad"`` (``.grad`` *is* the fp32 buffer, for code
            that reads it after backward); default ``"grad"`` when ``accum_steps`` is
            None, else ``"hooks"``. See ``accumkernels.optim._intake``.
        bucket_cap_mb: size of the buckets gradients are folded and reduced in.
        backend: the accumkernels backend (default: the fastest available).
        process_group: the group to reduce over (default: the world).
        sharded: ZeRO-1: each rank steps 1/W of every bucket (state and master
            weights for it only), then the params are all-gathered. Hooks intake.
        wire_dtype: ``torch.float32`` (exact) or ``torch.bfloat16`` on the wire.
    """

    INTAKES = INTAKES

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accum_steps: int | None = None,
        *,
        normalize: str = "mean",
        max_grad_norm: float | None = None,
        master_weights: bool | str = False,
        stochastic_rounding: bool | None = None,
        state_dtype: torch.dtype | None = None,
        seed: int | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        skip_nonfinite: bool = False,
        intake: str | None = None,
        bucket_cap_mb: float = 25.0,
        backend: str | None = None,
        process_group: Any = None,
        sharded: bool = False,
        wire_dtype: torch.dtype = torch.float32,
    ) -> None:
        if isinstance(optimizer, AccumulatingOptimizer):
            raise TypeError("optimizer is already an AccumulatingOptimizer")
        arguments = dict(
            accum_steps=accum_steps,
            normalize=normalize,
            max_grad_norm=max_grad_norm,
            master_weights=master_weights,
            stochastic_rounding=stochastic_rounding,
            state_dtype=state_dtype,
            seed=seed,
            grad_scaler=grad_scaler,
            skip_nonfinite=skip_nonfinite,
            intake=intake,
            bucket_cap_mb=bucket_cap_mb,
            backend=backend,
            process_group=process_group,
            sharded=sharded,
            wire_dtype=wire_dtype,
        )
        o = _checked_options(optimizer, arguments)
        accum_steps, intake, mesh = o.accum_steps, o.intake, o.mesh
        # What a copy (copy.deepcopy, pickle) is rebuilt from: see __getstate__.
        self._arguments = dict(arguments, accum_steps=accum_steps, intake=intake)
        # torch.optim.Optimizer's machinery (hooks, step patching), sharing the
        # wrapped optimizer's param_groups and state rather than copying them.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        for name in (
            "step_pre",
            "step_post",
            "state_dict_pre",
            "state_dict_post",
            "load_state_dict_pre",
            "load_state_dict_post",
        ):
            setattr(self, f"_optimizer_{name}_hooks", OrderedDict())
        self._patch_step_function()

        self.accum_steps, self.normalize, self.max_grad_norm = accum_steps, normalize, max_grad_norm
        self.backend, self.intake = backend, intake
        self.device = o.device
        self.process_group, self.world_size, self.rank = o.process_group, o.world_size, o.rank
        self.sharded = sharded and self.world_size > 1
        self._fsdp = mesh is not None
        self._window = Window(normalize, self.device, run_seed(seed, self.device, self.process_group, self.world_size))
        self._loss_scale = LossScale(grad_scaler, self.device)
        self._caller_checked = False  # whether the first step() call looked for a framework calling it
        self._closed = False  # close() gave the params back
        # the refusal close() found for the window (_take_in_refusing_lost)
        self._refused_at_close: RuntimeError | None = None
        self._lay_out(o)

    def _lay_out(self, o, masters: dict[int, torch.Tensor] | None = None) -> None:
        """Build the parts laid out for the wrapped optimizer's params (``o``:
        check_options' result for them): the flat buffer and a record per param
        (``_layout``), the window's cross-rank part (``_sync``), the updater with
        the master weights (``masters``' by param index where given, else made from
        the params) and the intake, which takes the params' gradients from here on."""
        a = self._arguments
        self._signature = param_signature(self.optimizer.param_groups)
        self._group_sizes = [len(ids) for ids in self._signature]  # (the micro-steps' cheaper check)
        self._layout = Layout(
            o.params,
            o.groups,
            self.device,
            a["bucket_cap_mb"],
            self.world_size if self.sharded else 1,
            local=_fsdp.local_tensor if o.mesh is not None else None,
            unit_of=_fsdp.unit_of(o.params) if o.mesh is not None else None,
            hold=holds_buffers(o.intake, o.accum_steps, self.world_size, fsdp=o.mesh is not None),
        )
        # The window's cross-rank part (accumkernels.optim._sync): none, buckets
        # reduced across data-parallel ranks, or FSDP2's mesh.
        self._sync = make_sync(
            o,
            self._layout,
            self._window,
            sharded=self.sharded,
            wire_dtype=a["wire_dtype"],
            average=INTAKE_CLASSES[o.intake].exposes_buffers,
        )
        # The ops get the wrapper's own tensors, checked when it made them
        # (gradients: as they arrive): a Prepared backend skips their checks.
        prepared = ops.Prepared(a["backend"])
        self._updater = Updater(
            self.optimizer,
            self._layout,
            master_weights=a["master_weights"],
            stochastic_rounding=a["stochastic_rounding"],
            state_dtype=a["state_dtype"],
            backend=prepared,
            sync=self._sync,
        )
        self._updater.make_masters(masters or {})
        self._intake = make_intake(
            o.intake,
            self._layout,
            self._window,
            backend=prepared,
            skip_nonfinite=a["skip_nonfinite"],
            loss_scale=self._loss_scale,
            accum_steps=o.accum_steps,
            sync=self._sync,
        )

    # ---- torch.optim.Optimizer interface -----------------------------------

    param_groups = property(lambda self: self.optimizer.param_groups, lambda self, value: self._set_param_groups(value))
    state = property(lambda self: self.optimizer.state, lambda self, value: setattr(self.optimizer, "state", value))

    @staticmethod
    def profile_hook_step(func):
        """torch.optim.Optimizer.profile_hook_step, which ``_patch_step_function``
        wraps ``step`` with: the global and own step pre-hooks (a pre-hook may
        return new ``(args, kwargs)``), ``_optimizer_step_code``, the post-hooks,
        all inside the profiler range ``Optimizer.step#<class>.step``. The range
        is opened by torch's C++ RecordFunction guard, not torch's
        ``record_function`` op: ``step()`` runs at every micro-step, where that
        op's Python dispatch cost 125 µs (median, right after a backward, which
        leaves caches cold) against the guard's nothing unless a profiler or
        observer listens, and then the same range (docs/benchmarks.md)."""

        @functools.wraps(func)
        def wrapper(self, *args, **kwargs):
            with _RecordFunctionFast(f"Optimizer.step#{type(self).__name__}.step"):
                for pre_hook in chain(_global_optimizer_pre_hooks.values(), self._optimizer_step_pre_hooks.values()):
                    result = pre_hook(self, args, kwargs)
                    if result is not None:
                        if not (isinstance(result, tuple) and len(result) == 2):
                            raise RuntimeError(
                                f"{func} must return None or a tuple of (new_args, new_kwargs), but got {result}."
                            )
                        args, kwargs = result
                out = func(self, *args, **kwargs)
                self._optimizer_step_code()
                for post_hook in chain(self._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
                    post_hook(self, args, kwargs)
                return out

        return wrapper

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """GradScaler calls step() directly (no unscale_, no skip of its own)
        when the wrapper unscales and skips itself: the hooks intake."""
        return self._intake.supports_amp_scaling

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.optimizer!r}, accum_steps={self.accum_steps}, "
            f"normalize={self.normalize!r}, max_grad_norm={self.max_grad_norm}, intake={self.intake!r})"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch.optim's (fine-tuning that trains more layers as it goes):
        the group joins the wrapped optimizer, with its defaults filled in, and
        the buffers are laid out anew (``_lay_out_anew``). The new params come
        after those held, whose stochastic-rounding streams stay theirs: training
        goes on bit for bit as if the group had been there from the start with
        no gradient. Between windows; across ranks, by every rank at the same
        window boundary (all-reduce mode)."""
        optimizer = self.optimizer
        self._lay_out_anew(
            "add_param_group", lambda: optimizer.add_param_group(param_group), lambda: optimizer.param_groups.pop()
        )

    def _set_param_groups(self, groups: list[dict[str, Any]]) -> None:
        """``param_groups`` is an attribute torch.optim lets one assign
        (Lightning's BaseFinetuning restores its groups so when resuming): groups
        over the params held are set as they are, groups over other params lay
        the buffers out anew, as add_param_group does."""
        optimizer, before = self.optimizer, self.optimizer.param_groups
        if param_signature(groups) == self._signature:
            optimizer.param_groups = groups
            return
        self._lay_out_anew(
            "assigning param_groups over other params",
            lambda: setattr(optimizer, "param_groups", groups),
            lambda: setattr(optimizer, "param_groups", before),
        )

    def _lay_out_anew(self, what: str, change, undo) -> None:
        """``change()`` edits the wrapped optimizer's groups (``undo()`` reverts it)
        and the buffers, records, updater and intake are made anew for its params.
        The params held before keep their state (the optimizer's), their master
        weights and their window flags (a zero .grad kept by
        ``zero_grad(set_to_none=False)``). Between windows only (the window's sums
        are laid out for the params held); across ranks every rank does it at the
        same window boundary (the new buckets are checked alike on every rank, as
        at construction), in all-reduce mode (not with sharded=True or FSDP2,
        whose state lies in shards of the layout). Refused, and the groups checked
        as at construction, before anything is changed."""
        self._refuse_closed(what)
        if self.sharded or self._fsdp:
            raise RuntimeError(
                f"{what} on {type(self).__name__} with sharded=True (ZeRO-1) or on FSDP2 params is not supported: "
                "each rank's state is laid out in its shards of the buckets; pass every param group when building "
                "it (frozen params included: they are skipped while they get no gradient)"
            )
        self._intake.flush()
        window = self._window
        if window.micro_steps or window.touched:
            raise RuntimeError(
                f"{what} mid-window: this window's sums ({window.micro_steps} micro-steps, {len(window.touched)} "
                "params with a gradient) are laid out for the params held now; do it after the step() that ends "
                "the window (opt.window_stepped), before the next backward"
            )
        change()
        try:
            options = _checked_options(self.optimizer, self._arguments)
        except Exception:
            undo()
            raise
        before = {id(r.param): r for r in self._layout}
        after = {id(p): i for i, p in enumerate(options.params)}
        renumbered = {r.index: after[key] for key, r in before.items() if key in after}
        masters = {r.index: r.master for r in before.values() if r.master is not None}
        shown = self._intake.shown_grads()  # (copies, only where a step's gradient is uncleared)
        self._intake.close()  # its hooks, and .grad given back
        self._layout.release()  # (before the new buffer is made: one flat buffer at a time)
        try:
            self._lay_out(options, {renumbered[i]: m for i, m in masters.items() if i in renumbered})
        except Exception:  # e.g. out of memory for a larger buffer: the wrapper as it was
            undo()
            self._lay_out(_checked_options(self.optimizer, self._arguments), masters)
            raise
        window.renumber(renumbered)
        # A param whose .grad torch.optim still holds as a tensor (a gradient
        # since the last zero_grad(set_to_none=True), one zero_grad(set_to_none=False)
        # kept as zeros, which it steps) has its buffer (intake "grad") or marker
        # ("hooks") as .grad again, which the closed intake took back: so a
        # step() on the last step's gradients uncleared is refused, and a kept
        # zero stepped, as before the change; intake "grad"'s buffer shows the
        # values of the gradient the last step() used again (a norm logged).
        for r in self._layout.records_of(window.had_grad | window.zero_grads | window.unzeroed):
            if r.param.grad is None:
                self._intake.set_grad(r, None)
        self._intake.show_grads({renumbered[i]: grad for i, grad in shown.items() if i in renumbered})

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As in plain PyTorch, ``.grad`` is cleared: the gradients the last
        step used (accum_steps=None) and those no ``step()`` took yet (between
        a backward and step(), the window so far, and with accum_steps=N its
        count of step() calls; intake "hooks" refuses that across ranks, where
        its buckets' reductions may have started). After step() with
        accum_steps=N it is harmless: the window goes on. ``set_to_none=False``
        has torch.optim's meaning with both intakes: the params that had a
        gradient keep a zero one, and the following windows step them
        (momentum and weight decay go on) until ``zero_grad()`` sets it to None."""
        self._refuse_closed("zero_grad()")
        self._intake.before_zero_grad()  # (takes in what was put into .grad since, or refuses)
        self._window.zero_grad(set_to_none)
        self._intake.zero_grad(set_to_none)

    # torch.compile(opt.step) (torch's recipe for compiling an optimizer) runs
    # this step as it is: its work is fused kernels already, and Dynamo cannot
    # trace param_groups here (torch 2.14 fakeifies a bf16 param holding an
    # fp32 .grad under param.grad_dtype without that grad_dtype, and raises).
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None, *, num_items: float | torch.Tensor | None = None):
        """End a micro-step; on the window's last one, update the params.

        Args:
            closure: as in ``torch.optim`` (re-evaluates the model, returns the loss).
            num_items: with ``normalize="items"``, the number of items (e.g. target
                tokens) this micro-batch's sum-reduced loss covers; a number or a
                1-element tensor on the params' device.
        """
        self._refuse_closed("step()")
        # DCP steps an optimizer only to create its state, so only while it has none.
        if not self.optimizer.state and _checkpoint.dcp_initializing_state():
            self._updater.init_state(self._intake)
            return None
        if self.accum_steps is not None and not self._caller_checked:
            # Before the closure: a framework's closure clips .grad, which intake "hooks" refuses less helpfully.
            _guards.refuse_framework_counting(self.accum_steps)
            self._caller_checked = True
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        window = self._window
        ends_window = self.accum_steps is None or window.micro_steps + 1 >= self.accum_steps
        self._check_param_groups(every_param=ends_window)
        if ends_window:
            self._intake.check_params()
        self._refuse_several_backwards()
        if window.unzeroed:
            self._refuse_uncleared_grads()
        intake = self._intake
        intake.meet_scaler(self, ends_window)  # (may refuse: before the items are counted)
        intake.refuse_lost_sums()  # (after the scaler's refusal: its unscale_ edits the sums too)
        window.count_items(num_items, ends_window)
        intake.refresh()
        intake.take_in()
        intake.start_micro_step()
        step_found_inf = window.end_micro_step(self._check_inf)
        self._loss_scale.next_micro_step()
        intake.report_micro_step(self, step_found_inf)
        window.stepped = ends_window
        if ends_window:
            self._end_window()
        intake.ready_for_backward()
        return loss

    # ---- public helpers ----------------------------------------------------

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler the wrapper unscales for: the one given, or one found calling step()."""
        return self._loss_scale.scaler

    @property
    def micro_steps(self) -> int:
        """step() calls completed in the current window."""
        return self._window.micro_steps

    @property
    def window_stepped(self) -> bool:
        """True right after the step() call that ended a window."""
        return self._window.stepped

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The global norm of the last window clipped with max_grad_norm (0-dim fp32)."""
        return self._window.last_grad_norm

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor:
        """A new fp32 tensor: the gradient the step would apply to ``param`` (this
        rank's elements of it) if the window ended now, normalization applied,
        before clipping. Zeros for a param with no gradient yet. In distributed
        runs: this rank's own contribution, before the reduction."""
        r = self._layout.record(param)
        if r is None:
            raise ValueError("param is not one of the wrapped optimizer's params")
        self._refuse_closed("accumulated_grad()")
        self._refuse_during_reduction("accumulated_grad()")
        self._take_in_refusing_lost("accumulated_grad()")
        if r.index not in self._window.touched:
            return torch.zeros_like(r.buffer_like(), dtype=torch.float32)
        return self._intake.window_sum(r) * self._normalization_so_far()

    def _normalization_so_far(self):
        """A / D if the window ended now: the micro-step in progress counts where it has gradients."""
        return self._window.normalization(pending=self._intake.micro_step_has_gradients())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the window's gradient so far to ``max_norm`` and return its
        global L2 norm (0-dim fp32 on the device, no host sync), as torch's
        ``clip_grad_norm_`` on plain ``.grad``: the window's sums are scaled
        now, with both intakes, so a gradient of a later backward is not
        clipped, and a norm read after it is the clipped one. Across ranks only
        once the window is reduced (intake "grad", after its last backward);
        else pass ``max_grad_norm=``. ``max_norm=float("inf")`` clips nothing:
        the norm for logging, as torch's."""
        self._refuse_closed("clip_grad_norm_()")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0; got {max_norm!r}")
        if not self._sync.reduced:
            raise RuntimeError(
                "clip_grad_norm_() needs the window's global gradient, which exists only after its "
                "cross-rank reduction: pass max_grad_norm= to the wrapper instead"
            )
        self._take_in_refusing_lost("clip_grad_norm_()")
        records = self._sync.norm_records()
        norm = self._updater.norm(records, self._intake.held_scale(self._normalization_so_far()))
        if max_norm != math.inf:  # (inf: the norm to log, which clips nothing: no write, a lean window stays lean)
            self._intake.clip(records, clip_coefficient(max_norm, norm))
        return norm

    def close(self) -> None:
        """Release the params (hooks, ``.grad`` views), so another wrapper may
        take them. Each param's ``.grad`` holds what torch.optim's would (a
        copy of the window's sum, in the param's gradient dtype, or a kept
        zero; None where cleared), so an optimizer built next steps on it as
        torch.optim's would (intake "hooks" across ranks or sharded: None,
        HookIntake.close). A closed wrapper saves its state (``state_dict()``),
        but not a window that state_dict() would have refused at the close,
        and refuses what would use the params."""
        if not self._closed:
            try:  # (close() itself refuses nothing: its state_dict() and copies will)
                self._take_in_refusing_lost("close()")
            except RuntimeError as refusal:
                self._refused_at_close = refusal
            self._intake.close(keep_grads=True)
            self._closed = True

    def _refuse_closed(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"{what} on an AccumulatingOptimizer that was closed (opt.close()): it no longer holds its params, "
                "so it would take no gradient. Build a new optimizer over them (loading this one's state_dict())"
            )

    # ---- state dict --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (loadable by the plain optimizer),
        plus an ``"accumkernels"`` entry with the in-window state: buffers
        (None at a window boundary, where they hold nothing), counts, inf
        flags, master weights, seed. Per rank in distributed runs. The hooks
        registered on the wrapper run as torch.optim runs them: the pre-hooks
        first, then the post-hooks, whose non-None return replaces the dict."""
        dcp = _checkpoint.dcp_saving()  # (a walk up the stack: once)
        self._refuse_saving("state_dict()", dcp)
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._take_in_refusing_lost("state_dict()")
        if dcp and not self.optimizer.state:
            # DCP creates a plain optimizer's state before it saves or loads
            # (its template must hold the keys it loads), but only where every
            # .grad is None: with intake "grad" .grad is the buffer, never None.
            self._updater.init_state(self._intake)
        sd = self.optimizer.state_dict()
        if dcp:  # DCP keeps only 'state' and 'param_groups'
            sd = _checkpoint.carried_through_dcp(self, sd)
        sd["accumkernels"] = self._window_entry()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _refuse_saving(self, what: str, dcp: bool) -> None:
        """Refuses to save while a reduction is in flight, or (``dcp``: for
        torch.distributed.checkpoint) what DCP would save wrong."""
        self._refuse_during_reduction(what)
        if dcp:
            _checkpoint.refuse_dcp(self)

    def _window_entry(self) -> dict[str, Any]:
        """state_dict()'s ``"accumkernels"`` entry (the intake flushed)."""
        empty = not self._window.micro_steps and not self._window.touched  # at a window boundary: nothing to keep
        return {
            "flat_buffer": None if empty else self._intake.saved_sums(),
            "arrivals": self._intake.saved_arrivals(),  # (the micro-step in progress: one backward per step() call)
            "sums_unscaled": self._intake.folds_unscaled,  # (_checkpoint._check_sums_scale)
            **self._window.state_dict(),
            "master_weights": {r.index: r.master.clone() for r in self._layout if r.master is not None},
            "world_size": self.world_size,
            "rank": self.rank,
            "sharded": self.sharded,
            "accum_steps": self.accum_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a checkpoint of this wrapper, or of the plain wrapped optimizer
        (the window then starts empty). Everything is checked before anything is
        written: a refused checkpoint leaves the wrapper as it was. Distributed:
        every rank loads its own, with the same world size. As torch.optim: the
        pre-hooks get a shallow copy (a non-None return replaces it), the
        post-hooks run once it is loaded."""
        self._refuse_closed("load_state_dict()")
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        _checkpoint.load(self, state_dict)
        self._intake.flush()
        self._intake.ready_for_backward()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ---- copies -------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """copy.deepcopy and pickle, as for torch.optim: the copy is rebuilt over
        the copied optimizer (and so over the copied params, when the model is
        copied with it) with the same arguments, then given this window's state
        (buffers, counts, master weights, seed): it trains on as this one would."""
        if self.world_size > 1 or self._arguments["process_group"] is not None:
            raise TypeError(
                "a distributed AccumulatingOptimizer cannot be copied or pickled (it holds a process "
                "group): save opt.state_dict() on every rank and load it into a new one"
            )
        # The window's entry without the state-dict hooks registered on this
        # wrapper: a copy runs none and keeps none, as torch.optim's.
        self._refuse_saving("copying", _checkpoint.dcp_saving())
        self._take_in_refusing_lost("copying")
        return {"optimizer": self.optimizer, "arguments": self._arguments, "window": self._window_entry()}

    def _take_in_refusing_lost(self, what: str) -> None:
        """Before the window is saved or read (``what``: state_dict(), a copy,
        accumulated_grad(), clip_grad_norm_()): what ``.grad`` holds joins it,
        a tensor assigned there included, as step() would take it; a window
        that lost what torch.optim's ``.grad`` holds (intake "hooks":
        gradients that ``.grad = None`` dropped after backward) or that step()
        refuses (intake "grad": its sums written over or edited) is refused
        here too, not saved for a resume or a copy to step on, nor read as a
        gradient or norm no step will use. (Closed: the window as close() left
        it, the params no longer looked at; a window close() found refused
        stays refused: an optimizer that loaded it would step on it.)"""
        if self._closed:
            if self._refused_at_close is not None:  # (its advice is for an open optimizer: this one steps no more)
                raise RuntimeError(
                    f"{what} of an optimizer closed with a window that step() refuses (build the next one "
                    f"without it): {self._refused_at_close}"
                )
            return
        self._intake.take_in()
        self._intake.refuse_lost_used(what)

    def __setstate__(self, state: dict[str, Any]) -> None:
        AccumulatingOptimizer.__init__(self, state["optimizer"], **state["arguments"])
        self.load_state_dict({**self.optimizer.state_dict(), "accumkernels": state["window"]})

    # ---- internals -----------------------------------------------------------

    @property
    def _check_inf(self) -> bool:
        """Inf/NaN gradients skip the window: with a GradScaler (given or found) or skip_nonfinite."""
        return self._intake.check_inf

    def _refuse_several_backwards(self) -> None:
        """accum_steps=N: one backward per step() call (accumkernels.optim._guards)."""
        if self.accum_steps is None:
            return
        count, index = self._intake.backwards_since_step()
        if count > 1:
            _guards.refuse_several_backwards(self.accum_steps, count, index)

    def _check_param_groups(self, every_param: bool) -> None:
        """The wrapped optimizer's param groups are those it was wrapped with:
        at every step() their count and lists (add_param_group on the wrapped
        optimizer, a group's list replaced or grown), before a window's step every param, and that no
        group of 8-bit state has had amsgrad switched on."""
        groups = self.optimizer.param_groups
        if every_param:
            changed = param_signature(groups) != self._signature
        else:
            changed = [len(g["params"]) for g in groups] != self._group_sizes
        if changed:
            raise RuntimeError(
                "the wrapped optimizer's params changed after wrapping (a group's list edited in place, or a "
                "group added to the optimizer it wraps): change the groups through the wrapper, between windows "
                "(its add_param_group, or assign its param_groups)"
            )
        if every_param:
            check_groups(self.optimizer, self._arguments["state_dtype"])

    def _refuse_uncleared_grads(self) -> None:
        """accum_steps=None, where step() is torch.optim's: torch.optim steps on
        whatever ``.grad`` holds, which keeps adding up until it is cleared, so
        with nothing cleared since the last step() (no ``zero_grad()`` of the
        optimizer or the model, no ``.grad = None``) it would step on the last
        window's gradients again, added to this one's. Intake "hooks" folds a
        window's first gradient over the one used, and a loop seldom means to
        step twice on one gradient: refused, before anything is counted or touched."""
        window = self._window
        window.unzeroed = self._intake.uncleared(window.unzeroed)
        if window.unzeroed:
            first, more = min(window.unzeroed), len(window.unzeroed) - 1
            raise RuntimeError(
                f"step() again with nothing cleared since the last step(): param {first}"
                f"{f' (and {more} more)' if more else ''} still has the gradient the last step() used (no "
                "optimizer.zero_grad(), model.zero_grad() or .grad = None since). torch.optim would step on it "
                "again, added to any new one, which a loop seldom means: this optimizer refuses it. Call "
                "optimizer.zero_grad() after each step() (or before each backward), as torch.optim's loops do "
                "(across ranks, intake='grad' does not see a clear through .data, p.grad.data.zero_(): use "
                "p.grad.zero_())"
            )

    def _refuse_during_reduction(self, what: str) -> None:
        """Where the buffers are being reduced across ranks in place, or hold
        the reduced window (a backward that ends it: the last micro-step's, a
        DDP module's outside no_sync(), and with accum_steps=None and no DDP
        module each one), they no longer hold this rank's own sums."""
        if self._sync.started:
            raise RuntimeError(
                f"{what} between the window's last backward and step(): the buffers are being reduced "
                "across ranks in place (with accum_steps=None and no DDP module every backward is reduced, "
                "as DDP's is); call it before that backward or after step()"
            )

    def _end_window(self) -> None:
        window = self._window
        self._intake.end_window(self)
        found_inf, grad_scale = self._sync.end_window(self._check_inf)  # touched: over every rank
        grad_scale = self._intake.held_scale(grad_scale)
        self._intake.report_window(self, found_inf)
        # Params whose .grad zero_grad(set_to_none=False) kept as zeros are
        # stepped too, with a zero gradient (intake "hooks" overwrites a buffer
        # at its first gradient, so an untouched one may hold an old sum). Where
        # step() is torch.optim's, so is every param whose .grad torch would
        # hold as a tensor: a gradient since the last zero_grad(set_to_none=True)
        # and no .grad = None since (cleared in place, model.zero_grad(set_to_none=False)).
        steps_as_torch = self.accum_steps is None
        if steps_as_torch:
            window.zero_grads |= window.had_grad
        self._layout.zero_views(self._layout.records_of(window.zero_grads - window.touched))
        records = self._layout.records_of(window.stepped_params())
        window.had_grad |= window.touched
        if self.max_grad_norm is not None:
            window.last_grad_norm = self._updater.norm(records, grad_scale)
            window.combine_clip(clip_coefficient(self.max_grad_norm, window.last_grad_norm))
        if window.clip_coef is not None:
            grad_scale = window.clip_coef * grad_scale
        if isinstance(grad_scale, torch.Tensor):
            grad_scale = grad_scale.reshape(1).to(torch.float32)
        self._updater.step(
            records, grad_scale, found_inf if self._check_inf else None, window.window_seed(), self._intake
        )
        # An LR scheduler built on the wrapped optimizer tracks its step() calls
        # (torch.optim.lr_scheduler's _opt_called), which the fused step makes none of.
        self.optimizer._opt_called = True
        self._intake.after_step()
        self._sync.after_step()
        self._updater.note_params(records)
        if steps_as_torch:
            window.unzeroed = set(window.touched)
        window.windows += 1
        window.clear()

"""AccumulatingOptimizer: gradient accumulation into fp32 buffers, one fused step per window.

The class holds the arguments, the ``torch.optim.Optimizer`` surface, the
orchestration of ``step()`` and the assembly of state dicts; each concern has
its own module: ``_layout`` (the flat buffer, buckets, one record per param),
``_intake`` (how gradients get into the buffers), ``_window`` (what the window
has seen, normalization), ``_amp`` (GradScaler), ``_update`` (the fused and
fallback steps, master weights, norms) and ``_distributed`` (the reduction
across ranks).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

from . import _amp, _distributed
from ._checkpoint import check_loadable, load_fp32_state
from ._intake import INTAKES, make_intake
from ._layout import Layout
from ._update import Updater, optimizer_kind
from ._window import NORMALIZE, Window


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

    For SGD, Adam and AdamW the update is the fused step-and-zero kernel with
    the hyperparameters read from ``param_groups`` at every window (LR
    schedulers and per-group settings work); any other optimizer receives the
    window's gradient as ``.grad`` and steps itself. A param that got no
    gradient in a window is skipped, as ``torch.optim`` skips ``grad is None``.

    **Distributed.** With ``torch.distributed`` initialized (or a ``process_group``
    given), W ranks of N micro-steps equal one process with W*N micro-batches.
    The buffers are summed across ranks once per window, bucket by bucket
    during the last backward; ``step()`` waits for them and for one small
    all-reduce of the window's flags, counts and which params got a gradient
    (read on the host: the only host sync of a distributed window). Any rank's
    inf/NaN skips the window everywhere; clipping uses the global norm. Every
    rank calls ``step()`` the same number of times. A model wrapped in
    ``DistributedDataParallel`` is refused (its reducer would all-reduce every
    micro-batch's ``.grad``).

    Args:
        optimizer: the optimizer to wrap, with all its param groups already added.
        accum_steps: micro-steps per window; ``None``: every ``step()`` call ends a
            window (for frameworks that count the window and scale the loss themselves).
        normalize: ``"mean"``, ``"sum"`` or ``"items"`` (see above).
        max_grad_norm: clip the window's gradient to this global L2 norm.
        master_weights: keep fp32 master weights for bf16/fp16 params (the params
            become their rounded copies).
        stochastic_rounding: round the updated bf16 params stochastically instead
            (unbiased, so updates far below a bf16 ulp are not lost); the
            alternative to master weights that costs no memory.
        seed: the stochastic rounding seed of the run (default: drawn from
            torch's generator; rank 0's in distributed runs); every window and
            every param draws its own bits from it. Saved in ``state_dict()``.
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss, if any: each
            micro-batch is unscaled as it is accumulated, and a window with an inf
            or NaN is skipped whole (params and state untouched) and the scaler backs off.
        skip_nonfinite: skip a window with an inf or NaN gradient (implied by
            ``grad_scaler``); checked in the accumulation pass, no host sync.
        intake: ``"hooks"`` (fold each bucket into the buffers during backward and
            free ``.grad``) or ``"grad"`` (``.grad`` is the fp32 buffer itself, for
            code that reads it after backward); default: ``"grad"`` when
            ``accum_steps`` is None (frameworks), else ``"hooks"``. See ``_intake``.
        bucket_cap_mb: size of the buckets the gradients are folded (and reduced) in.
        backend: the accumkernels backend to use (default: fastest available).
        process_group: the ``torch.distributed`` group to reduce over (default: the
            world group if ``torch.distributed`` is initialized).
        sharded: ZeRO-1: reduce-scatter each bucket, step only this rank's shard
            (optimizer state and master weights exist for it only, 1/W of the
            memory), then all-gather the updated params. SGD, Adam and AdamW only.
        wire_dtype: ``torch.float32`` (default, exact) or ``torch.bfloat16``: send
            bf16 and sum the ranks' contributions in fp32 on arrival.
    """

    INTAKES = INTAKES

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accum_steps: int | None = None,
        *,
        normalize: str = "mean",
        max_grad_norm: float | None = None,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
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
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        if isinstance(optimizer, AccumulatingOptimizer):
            raise TypeError("optimizer is already an AccumulatingOptimizer")
        if accum_steps is not None and (isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1):
            raise ValueError(f"accum_steps must be None or an int >= 1; got {accum_steps!r}")
        if normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {NORMALIZE}; got {normalize!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0; got {max_grad_norm!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0; got {bucket_cap_mb!r}")
        if wire_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"wire_dtype must be torch.float32 or torch.bfloat16; got {wire_dtype!r}")
        intake = intake or ("grad" if accum_steps is None else "hooks")
        if intake not in INTAKES:
            raise ValueError(f"intake must be None or one of {INTAKES}; got {intake!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
            raise ValueError(f"seed must be None or an int in [0, 2**32); got {seed!r}")
        kind = optimizer_kind(optimizer)
        for flag, name in ((master_weights, "master_weights"), (stochastic_rounding, "stochastic_rounding"),
                           (sharded, "sharded=True")):  # fmt: skip
            if flag and kind == "fallback":
                raise ValueError(f"{name} needs SGD, Adam or AdamW (the fused step); got {type(optimizer).__name__}")
        if master_weights and stochastic_rounding:
            raise ValueError("master_weights and stochastic_rounding exclude each other: choose one")
        initialized = dist.is_available() and dist.is_initialized()
        if process_group is not None and not initialized:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        if not initialized and (sharded or wire_dtype != torch.float32):
            raise ValueError("sharded=True and wire_dtype need torch.distributed: initialize it or pass process_group")
        if sharded and intake == "grad":
            raise ValueError(
                "sharded=True needs intake='hooks': after a reduce-scatter each rank holds only its shard of the "
                "window's gradient, so .grad could not show it whole"
            )
        params, groups = self._collect_params(optimizer)
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"params on several devices ({sorted(map(str, devices))}) are not supported yet")

        # torch.optim.Optimizer's machinery (hooks, step patching), sharing the
        # wrapped optimizer's param_groups and state rather than copying them.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        for name in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                     "load_state_dict_post"):  # fmt: skip
            setattr(self, f"_optimizer_{name}_hooks", OrderedDict())
        self._patch_step_function()

        self.accum_steps = accum_steps
        self.normalize = normalize
        self.max_grad_norm = max_grad_norm
        self.backend = backend
        self.stochastic_rounding = stochastic_rounding
        self.intake = intake
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        # None means the default group, looked up at each call (the wrapper
        # does not keep the world group alive past destroy_process_group()).
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if initialized else 1
        self.rank = dist.get_rank(process_group) if initialized else 0
        self.sharded = sharded and self.world_size > 1
        self._signature = self._param_signature()
        self._skip_nonfinite = skip_nonfinite
        self._layout = Layout(params, groups, self.device, bucket_cap_mb, self.world_size if self.sharded else 1)
        self._window = Window(normalize, self.device, self._run_seed(seed))
        self._loss_scale = _amp.LossScale(grad_scaler, self.device)
        self._ddp_watch = _distributed.DDPWatch(params, self._window) if initialized else None
        self._reducer = None
        if self.world_size > 1:
            self._reducer = _distributed.BucketReducer(process_group, self._layout, self._window, self.sharded,
                                                       wire_dtype)  # fmt: skip
            if self.sharded:
                self._layout.set_shards(lambda b: self._reducer.shard(b.index))
        self._updater = Updater(optimizer, self._layout, master_weights=master_weights,
                                stochastic_rounding=stochastic_rounding, backend=backend)  # fmt: skip
        self._updater.make_masters()
        self._intake = make_intake(
            intake, self._layout, self._window, backend=backend, skip_nonfinite=skip_nonfinite, loss_scale=self._loss_scale,
            accum_steps=accum_steps, bucket_done=self._reducer,
        )  # fmt: skip

    @property
    def _check_inf(self) -> bool:
        """Whether inf/NaN gradients skip the window: with a GradScaler (given or
        adopted) or skip_nonfinite."""
        return self._skip_nonfinite or self._loss_scale.scaler is not None

    # ---- torch.optim.Optimizer interface -----------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """GradScaler calls step() directly (no unscale_, no skip of its own)
        when the wrapper unscales and skips itself: the hooks intake."""
        return self.intake == "hooks"

    def __repr__(self) -> str:
        return (
            f"AccumulatingOptimizer({self.optimizer!r}, accum_steps={self.accum_steps}, "
            f"normalize={self.normalize!r}, max_grad_norm={self.max_grad_norm}, intake={self.intake!r})"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "AccumulatingOptimizer owns buffers for the params it was built with: add every param group "
            "to the optimizer before wrapping it"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """With intake "hooks", harmless: gradients are folded as they arrive and
        the window goes on (``set_to_none`` is ignored: there is no ``.grad`` to
        keep). With intake "grad", as in plain PyTorch: gradients no ``step()``
        has taken yet are discarded (nothing, right after a step)."""
        self._intake.zero_grad()

    @torch.no_grad()
    def step(self, closure=None, *, num_items: float | torch.Tensor | None = None):
        """End a micro-step; on the window's last one, update the params.

        Args:
            closure: as in ``torch.optim`` (re-evaluates the model, returns the loss).
            num_items: with ``normalize="items"``, the number of items (e.g.
                target tokens) this micro-batch's sum-reduced loss covers; a
                Python number or a 1-element tensor on the params' device.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._param_signature() != self._signature:
            raise RuntimeError(
                "the wrapped optimizer's params changed after wrapping (a param group was added or edited); "
                "add every param group before wrapping it"
            )
        window = self._window
        window.count_items(num_items)
        ends_window = self.accum_steps is None or window.micro_steps + 1 >= self.accum_steps
        self._meet_the_scaler(ends_window)
        self._intake.refresh()
        self._intake.flush()
        step_found_inf = window.end_micro_step(self._check_inf)
        self._loss_scale.next_micro_step()
        scaler = self._loss_scale.scaler
        if self.intake == "hooks" and _amp.is_enabled(scaler):
            # Its update() after this call backs off on what it is told. Distributed:
            # every rank's scaler sees the window's global flag at its end and none before.
            local = self._reducer is None
            _amp.report_found_inf(scaler, self, self.device, step_found_inf if local else torch.zeros(1, device=self.device))
        window.stepped = self.accum_steps is None or window.micro_steps >= self.accum_steps
        if window.stepped:
            self._end_window()
        return loss

    # ---- public helpers ----------------------------------------------------

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler the wrapper unscales for: the one given, or the one
        found calling step() (see _meet_the_scaler)."""
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
        """The global norm of the last clipped window (0-dim fp32 on the device)."""
        return self._window.last_grad_norm

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor:
        """A new fp32 tensor: the gradient the step would apply to ``param`` if
        the window ended now, normalization applied, before clipping (a
        micro-step in progress counts in ``"mean"`` mode; ``"items"`` divides by
        the items counted so far). Zeros for a param with no gradient yet. In
        distributed runs: this rank's own contribution, before the reduction."""
        r = self._layout.record(param)
        if r is None:
            raise ValueError("param is not one of the wrapped optimizer's params")
        self._refuse_during_reduction("accumulated_grad()")
        self._intake.flush()
        if r.index not in self._window.touched:
            return torch.zeros_like(r.buffer)
        return r.buffer * self._window.normalization(pending=True)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the window's gradient to ``max_norm`` and return its global L2
        norm (normalization applied, a 0-dim fp32 tensor on the device, no host
        sync), as ``torch.nn.utils.clip_grad_norm_`` does on plain ``.grad``:
        with intake "grad" ``.grad`` is clipped now; with "hooks" the
        coefficient is applied by the next window step. In distributed runs
        only where ``.grad`` holds the reduced window (intake "grad", after the
        window's last backward); else use ``max_grad_norm=``."""
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0; got {max_norm!r}")
        if self._reducer is not None and not (self.intake == "grad" and self._reducer.finished):
            raise RuntimeError(
                "clip_grad_norm_() needs the window's global gradient, which exists only after its cross-rank "
                "reduction: pass max_grad_norm= to the wrapper instead"
            )
        self._intake.flush()
        window = self._window
        # Reduced: params another rank touched hold gradient too (the others hold zeros).
        records = list(self._layout) if self._reducer is not None else None
        norm = self._norm(window.normalization(pending=True), records)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if self.intake == "grad":
            torch._foreach_mul_([r.buffer for r in records or self._touched_records()], coef)
        else:
            window.clip_coef = coef
        return norm

    def close(self) -> None:
        """Release the params: remove the hooks (and, with intake "grad", the
        ``.grad`` views), so that another wrapper may take them."""
        self._intake.close()

    # ---- state dict --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (loadable by the plain optimizer),
        plus an ``"accumkernels"`` entry with the in-window state: buffers,
        micro-step and item counts, inf flags, master weights, seed."""
        self._refuse_during_reduction("state_dict()")
        self._intake.flush()
        sd = self.optimizer.state_dict()
        sd["accumkernels"] = {
            "flat_buffer": self._layout.flat.clone(),
            **self._window.state_dict(),
            "master_weights": {r.index: r.master.clone() for r in self._layout if r.master is not None},
            "world_size": self.world_size,
            "rank": self.rank,
            "sharded": self.sharded,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a checkpoint of this wrapper, or of the plain wrapped optimizer
        (the window then starts empty). Everything is checked before anything
        is written: a refused checkpoint leaves the wrapper as it was. In
        distributed runs every rank loads its own, with the same world size."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("accumkernels", None)
        check_loadable(self, state_dict, extra)
        self.optimizer.load_state_dict(state_dict)
        load_fp32_state(self, state_dict)
        window = self._window
        window.clear()
        if extra is None:
            for r in self._layout:  # master weights follow the (already loaded) params
                if r.master is not None:
                    r.master.copy_(r.param_view())
            self._intake.flush()
            return
        self._layout.flat.copy_(extra["flat_buffer"])
        window.load_state_dict(extra)
        for r in self._layout:
            if r.master is not None:
                r.master.copy_(extra["master_weights"][r.index])
        self._intake.flush()

    # ---- internals -----------------------------------------------------------

    @staticmethod
    def _collect_params(optimizer) -> tuple[list[torch.Tensor], list[int]]:
        params, groups, seen = [], [], set()
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError(f"a param appears in more than one param group (again in group {g})")
                if p.layout != torch.strided:
                    raise TypeError(f"param group {g} holds a {p.layout} param; only dense params are supported")
                seen.add(id(p))
                params.append(p)
                groups.append(g)
        return params, groups

    def _param_signature(self):
        return tuple(tuple(id(p) for p in group["params"]) for group in self.param_groups)

    def _run_seed(self, seed: int | None) -> int:
        if seed is None:
            seed = int(torch.randint(0, 2**32, (), dtype=torch.int64))
            if self.world_size > 1:  # every rank rounds the same params: one seed for all
                shared = torch.tensor([seed], dtype=torch.int64, device=self.device)
                dist.broadcast(shared, src=dist.get_global_rank(self.process_group or dist.group.WORLD, 0),
                               group=self.process_group)  # fmt: skip
                seed = int(shared.item())
        return seed

    def _meet_the_scaler(self, ends_window: bool) -> None:
        """A GradScaler calling step() through its standard protocol, given to
        the wrapper or not (frameworks make their own):

        - intake "hooks": the scaler calls step() directly (this wrapper handles
          scaling). One it was not given is adopted at its first call: the window's
          sum so far is unscaled and checked in place, later micro-batches as they
          are folded. ``scaler.unscale_(opt)`` before is refused: there is no
          ``.grad`` for it (clip with max_grad_norm= or clip_grad_norm_()).
        - intake "grad": the scaler unscales ``.grad`` (the buffers) and skips
          step() on inf itself, so it must do so once per window."""
        driver = _amp.scaler_driving(self)
        if driver is None or not driver.is_enabled():
            return
        given = self._loss_scale.scaler
        if given is not None and given is not driver:
            raise RuntimeError("step() is called by another GradScaler than the one given as grad_scaler=")
        if self.intake == "grad":
            if not ends_window:
                raise RuntimeError(
                    "with intake='grad' a GradScaler unscales .grad, which holds the window's running sum: call "
                    "scaler.step(opt) and scaler.update() once per window (accum_steps=None), or use intake='hooks'"
                )
            return
        if _amp.was_unscaled(driver, self):
            raise RuntimeError(
                "scaler.unscale_(opt) found no .grad: with intake='hooks' gradients are folded into the wrapper's "
                "fp32 buffers during backward. Clip with max_grad_norm= or opt.clip_grad_norm_(), or use intake='grad'"
            )
        if given is None:
            self._intake.flush()
            views = [r.buffer for r in self._touched_records()]
            _amp.unscale_and_check(views, _amp.inverse_scale(driver, self.device), self._window.step_found_inf)
            self._loss_scale.scaler = driver

    def _refuse_during_reduction(self, what: str) -> None:
        if self._reducer is not None and self._reducer.started:
            raise RuntimeError(
                f"{what} between the window's last backward and step(): the buffers are being reduced across "
                "ranks in place; call it before that backward or after step()"
            )

    def _touched_records(self):
        return [self._layout.records[i] for i in sorted(self._window.touched)]

    def _norm(self, scale, records=None) -> torch.Tensor:
        """Global L2 norm of the window's gradient (in ``records``, default the
        touched ones) times ``|scale|``."""
        squared = self._updater.local_squared_norm(records if records is not None else self._touched_records())
        if self.sharded:
            squared = self._reducer.global_squared_norm(squared)
        return (squared.sqrt() * (scale.abs() if isinstance(scale, torch.Tensor) else abs(scale))).reshape(())

    def _end_window(self) -> None:
        window = self._window
        if self._ddp_watch is not None and window.windows == 0:
            self._ddp_watch.end_first_window()
        scaler = self._loss_scale.scaler
        if self.intake == "grad" and self._check_inf:
            self._check_grad_window(scaler)
        if self._reducer is not None:
            if self.intake == "grad" and not self._reducer.finished:
                self._reducer.reduce_now()
            found_inf, items, micro_steps = self._reducer.sync_window(self._check_inf)
            if self.intake == "hooks" and _amp.is_enabled(scaler):
                _amp.report_found_inf(scaler, self, self.device, found_inf)
            total = {"sum": None, "mean": micro_steps, "items": items}[self.normalize]
            grad_scale = window.divisor if total is None else (window.divisor / total).to(torch.float32)
            found_inf = found_inf if self._check_inf else None
        else:
            grad_scale = window.normalization()
            found_inf = window.found_inf if self._check_inf else None
        if self.max_grad_norm is not None:
            window.last_grad_norm = self._norm(grad_scale)
            window.combine_clip(torch.clamp(self.max_grad_norm / (window.last_grad_norm + 1e-6), max=1.0))
        if window.clip_coef is not None:
            grad_scale = window.clip_coef * grad_scale
        if isinstance(grad_scale, torch.Tensor):
            grad_scale = grad_scale.reshape(1).to(torch.float32)
        self._updater.step(self._touched_records(), grad_scale, found_inf, window.window_seed(), self._intake)
        if self.sharded:
            self._reducer.gather_params()
        if self._reducer is not None:
            self._reducer.reset()
        window.windows += 1
        window.clear()

    def _check_grad_window(self, scaler) -> None:
        """Intake "grad": the inf/NaN check (and, for a GradScaler that did not
        unscale this window, the unscaling) of the window's buffers, in one pass."""
        window = self._window
        views = [r.buffer for r in self._touched_records()]
        if _amp.is_enabled(scaler):
            if _amp.was_unscaled(scaler, self):
                return  # the scaler unscaled .grad, checked it, and calls step() only when finite
            _amp.unscale_and_check(views, _amp.inverse_scale(scaler, self.device), window.found_inf)
            _amp.report_found_inf(scaler, self, self.device, window.found_inf)
        else:
            _amp.unscale_and_check(views, torch.ones(1, device=self.device), window.found_inf)

"""AccumulatingOptimizer: gradient accumulation into fp32 buffers, one fused step per window.

The wrapper owns one flat fp32 buffer per device (one aligned view per param,
grouped into buckets of contiguous views). During backward a
``register_post_accumulate_grad_hook`` folds each gradient into its buffer with
``accumulate_`` (one call per bucket, loss-scale folded in, first contribution
of a window overwrites) and frees ``.grad``. ``step()`` counts micro-steps; on
the window's last one it runs the wrapped optimizer's update with the fused
step-and-zero op, with normalization, loss-scale skip and clipping folded into
``grad_scale`` and ``found_inf`` on the device: no host sync inside a window.
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

from . import ops
from ._distributed import BucketReducer

_NORMALIZE = ("mean", "sum", "items")
_ALIGN_ELEMENTS = 16  # 64-byte alignment of every param's view in the flat buffer


class _Bucket:
    """Params whose buffer views are contiguous in the flat buffer: one
    accumulate_ call folds them all once their gradients have arrived, and one
    collective reduces ``flat[start:end]`` across ranks."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self.index = index
        self.params = params
        self.expected = sum(p.requires_grad for p in params)  # gradients that complete it
        self.pending: dict[int, torch.Tensor] = {}  # id(param) -> param, gradient waiting
        self.start = self.end = 0
        dtypes = {p.dtype for p in params}
        # sharded mode all-gathers updated params in their own dtype when they share one
        self.gather_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32


def _on_grad_weak(ref, param: torch.Tensor) -> None:
    wrapper = ref()
    if wrapper is not None:
        wrapper._on_grad(param)


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


def _flat_view(p: torch.Tensor) -> torch.Tensor:
    """The elements of a dense param in storage order, as its buffer view lays them out."""
    return p.detach().as_strided((p.numel(),), (1,), p.storage_offset())


def _ddp_modules_holding(params) -> list:
    from torch.nn.parallel import DistributedDataParallel

    ids = {id(p) for p in params}
    return [
        obj
        for obj in gc.get_objects()
        # type(), not isinstance(): the latter reads __class__, which warns on
        # deprecated proxies such as torch.distributed.reduce_op
        if issubclass(type(obj), DistributedDataParallel) and any(id(p) in ids for p in obj.module.parameters())
    ]


class AccumulatingOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim`` optimizer to accumulate gradients exactly and step once per window.

    The first gradient of a window overwrites a param's buffer, so the step
    never needs to clear the buffers (it runs with ``zero_buffers=False``,
    saving 4 bytes per element), and a param that received no gradient in a
    window is skipped as ``torch.optim`` skips ``grad is None``.

    ::

        opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                                    accum_steps=8, max_grad_norm=1.0)
        for x, y in loader:
            loss_fn(model(x), y).backward()   # no division by accum_steps
            opt.step()                        # steps the weights once every 8 calls
            opt.zero_grad()                   # harmless

    For SGD, Adam and AdamW the update is the fused step-and-zero kernel with
    the hyperparameters read from ``param_groups`` at every window (LR
    schedulers and per-group settings work); any other optimizer receives the
    accumulated gradient as ``.grad`` and steps itself.

    The window's gradient of a param is ``grad_scale * sum(micro-batch gradients)`` with::

        grad_scale = c / D           c = min(1, max_norm / (norm + 1e-6)) if clipping, else 1
        D = window length (normalize="mean"), 1 ("sum"), or the window's total
            of step(num_items=...) ("items")

    **Distributed.** With ``torch.distributed`` initialized (or a ``process_group``
    given) the sums, window lengths and item counts above run over every rank's
    micro-batches: W ranks of N micro-steps equal one process with W*N. The
    buffers are summed across ranks once per window: during the backward of the
    window's last micro-step each bucket's collective is launched asynchronously
    as soon as it (and every bucket before it) is complete; ``step()`` waits for
    them and for one small all-reduce of the window's inf flag, item and
    micro-step counts and which params got a gradient (read on the host: the
    only host sync of a distributed window). Any rank's inf/NaN skips the window
    everywhere; clipping uses the global norm. Every rank must call ``step()``
    the same number of times. Do not wrap the model in ``DistributedDataParallel``
    (its reducer would all-reduce every micro-batch's ``.grad``): refused.

    Args:
        optimizer: the optimizer to wrap, with all its param groups already added.
        accum_steps: micro-steps per window; ``None``: every ``step()`` call ends a
            window (for frameworks that count the window and scale the loss themselves).
        normalize: ``"mean"``, ``"sum"`` or ``"items"`` (see above).
        max_grad_norm: clip the window's gradient to this global L2 norm.
        master_weights: keep fp32 master weights for bf16/fp16 params (the params
            become their rounded copies).
        stochastic_rounding: round the updated bf16 params stochastically instead
            (unbiased, so updates far below a bf16 ulp are not lost), with a new
            seed every window; the alternative to master weights that costs no memory.
        grad_scaler: the ``torch.amp.GradScaler`` scaling the loss, if any: each
            micro-batch is unscaled as it is accumulated, and a window with an inf
            or NaN is skipped whole (params and state untouched, buffers cleared),
            and the scaler backs off.
        skip_nonfinite: skip a window with an inf or NaN gradient (implied by
            ``grad_scaler``); checked in the accumulation pass, no host sync.
        bucket_cap_mb: size of the buckets the gradients are folded (and reduced) in.
        backend: the accumkernels backend to use (default: fastest available).
        process_group: the ``torch.distributed`` group to reduce over (default: the
            world group if ``torch.distributed`` is initialized; a group of one
            process means no communication).
        sharded: ZeRO-1: reduce-scatter each bucket, step only this rank's shard
            of every bucket (optimizer state and master weights exist for that
            shard only, 1/W of the memory), then all-gather the updated params.
            SGD, Adam and AdamW only.
        wire_dtype: ``torch.float32`` (default, exact) or ``torch.bfloat16``: send
            bf16 on the wire and sum the ranks' contributions in fp32 on arrival
            (see ``accumkernels._distributed``).
    """

    _step_supports_amp_scaling = True  # GradScaler: we unscale and skip ourselves

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accum_steps: int | None = None,
        *,
        normalize: str = "mean",
        max_grad_norm: float | None = None,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        skip_nonfinite: bool = False,
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
        if normalize not in _NORMALIZE:
            raise ValueError(f"normalize must be one of {_NORMALIZE}; got {normalize!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0; got {max_grad_norm!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0; got {bucket_cap_mb!r}")
        if wire_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"wire_dtype must be torch.float32 or torch.bfloat16; got {wire_dtype!r}")
        distributed = self._distributed(process_group)
        if not distributed and (sharded or wire_dtype != torch.float32):
            raise ValueError(
                "sharded=True and wire_dtype need torch.distributed: initialize it or pass process_group"
            )

        # torch.optim.Optimizer's machinery (hooks, step patching), sharing the
        # wrapped optimizer's param_groups and state rather than copying them.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

        self.accum_steps = accum_steps
        self.normalize = normalize
        self.max_grad_norm = max_grad_norm
        self.grad_scaler = grad_scaler
        self.backend = backend
        self._kind = self._optimizer_kind(optimizer)
        for flag, name in ((master_weights, "master_weights"), (stochastic_rounding, "stochastic_rounding")):
            if flag and self._kind == "fallback":
                raise ValueError(f"{name} needs SGD, Adam or AdamW (the fused step); got {type(optimizer).__name__}")
        if master_weights and stochastic_rounding:
            raise ValueError("master_weights and stochastic_rounding exclude each other: choose one")
        if sharded and self._kind == "fallback":
            raise ValueError(f"sharded=True needs SGD, Adam or AdamW (the fused step); got {type(optimizer).__name__}")
        self.stochastic_rounding = stochastic_rounding
        self._check_inf = grad_scaler is not None or skip_nonfinite

        self._params = self._collect_params()
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(f"params on several devices ({sorted(map(str, devices))}) are not supported yet")
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self._index = {id(p): i for i, p in enumerate(self._params)}

        # Distributed: the group, and this rank's share of every bucket.
        # None means the default group, looked up at each call (the wrapper
        # does not keep the world group alive past destroy_process_group()).
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.sharded = sharded and self.world_size > 1
        if distributed:
            self._refuse_ddp()
        self._buffers, self._flat, self._buckets, self._bucket_of, self._offset = self._make_buffers(bucket_cap_mb)
        self._reducer = None
        self._shard: dict[int, tuple[int, int]] = {}  # id(param) -> [lo, hi) of its elements this rank steps
        if self.world_size > 1:
            self._reducer = BucketReducer(
                process_group, self._flat, [(b.start, b.end) for b in self._buckets], self.sharded, wire_dtype
            )
            if self.sharded:
                for b in self._buckets:
                    lo, hi = self._reducer.shard(b.index)
                    for p in b.params:
                        start = self._offset[id(p)]
                        a, z = max(lo, start), min(hi, start + p.numel())
                        if a < z:
                            self._shard[id(p)] = (a - start, z - start)
        self._masters = {
            id(p): self._param_view(p).float().clone()
            for p in self._params
            if master_weights and p.dtype in (torch.bfloat16, torch.float16) and self._steps_here(p)
        }

        # Window state, all on the host except the device flags and item count.
        self._touched: set[int] = set()  # params with a gradient in this window
        self._micro_steps = 0  # completed step() calls in this window
        self._grads_since_step = False  # a gradient arrived since the last step() call
        self._items: float | torch.Tensor = 0.0
        self._window_found_inf = torch.zeros(1, device=self.device)
        self._step_found_inf = torch.zeros(1, device=self.device)
        self._micro_inv_scale: torch.Tensor | None = None
        self._windows = 0  # windows ended so far: the stochastic rounding seed
        self._clip_coef: torch.Tensor | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.window_stepped = False  # True right after the step() call that ended a window

        # The hooks reach the wrapper through a weak reference: no cycle through
        # the params, so a dropped wrapper (and its buffers) is freed at once.
        hook = functools.partial(_on_grad_weak, weakref.ref(self))
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self._params if p.requires_grad]
        weakref.finalize(self, _remove_hooks, self._hooks)

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

    def __repr__(self) -> str:
        return (
            f"AccumulatingOptimizer({self.optimizer!r}, accum_steps={self.accum_steps}, "
            f"normalize={self.normalize!r}, max_grad_norm={self.max_grad_norm})"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "AccumulatingOptimizer owns buffers for the params it was built with: add every param group "
            "to the optimizer before wrapping it"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Harmless: gradients are folded into the buffers as they arrive. Folds
        any gradient still waiting for its bucket, then drops ``.grad``."""
        self._flush()
        for p in self._params:
            p.grad = None

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
        self._check_params_unchanged()
        self._count_items(num_items)
        self._flush()
        self._micro_steps += 1
        self._grads_since_step = False
        self._micro_inv_scale = None
        if self._check_inf:
            torch.maximum(self._window_found_inf, self._step_found_inf, out=self._window_found_inf)
            if self.grad_scaler is not None:
                # Distributed: every rank's scaler must see the same flags, so
                # they see the window's global flag at its end and none before.
                local = self._reducer is None
                self._report_to_scaler(self._step_found_inf if local else torch.zeros(1, device=self.device))
            self._step_found_inf = torch.zeros(1, device=self.device)
        self.window_stepped = self.accum_steps is None or self._micro_steps >= self.accum_steps
        if self.window_stepped:
            self._end_window()
        return loss

    # ---- public helpers ----------------------------------------------------

    @property
    def micro_steps(self) -> int:
        """step() calls completed in the current window."""
        return self._micro_steps

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor:
        """A new fp32 tensor: the gradient the step would apply to ``param`` if
        the window ended now, normalization applied, before clipping (a
        micro-step in progress counts in ``"mean"`` mode; ``"items"`` divides by
        the items counted so far). Zeros for a param with no gradient yet. In
        distributed runs: this rank's own contribution, before the reduction."""
        i = self._index.get(id(param))
        if i is None:
            raise ValueError("param is not one of the wrapped optimizer's params")
        self._refuse_during_reduction("accumulated_grad()")
        self._flush()
        if id(param) not in self._touched:
            return torch.zeros_like(param, dtype=torch.float32)
        return self._buffers[i] * self._normalization(pending=True)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the window's gradient to ``max_norm`` at the next window step and
        return its global L2 norm (normalization applied, a 0-dim fp32 tensor on
        the device, no host sync). ``torch.nn.utils.clip_grad_norm_`` on the
        model's params cannot do this: their ``.grad`` is freed into the buffers.
        Not in distributed runs, where the norm exists only after the window's
        reduction: use ``max_grad_norm=``."""
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0; got {max_norm!r}")
        if self._reducer is not None:
            raise RuntimeError(
                "clip_grad_norm_() is not available in distributed runs: the global norm exists only after the "
                "window's cross-rank reduction inside step(); pass max_grad_norm= to the wrapper instead"
            )
        self._flush()
        norm = self._grad_norm(self._normalization(pending=True))
        self._clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return norm

    # ---- state dict --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (loadable by the plain optimizer),
        plus an ``"accumkernels"`` entry with the in-window state: buffers,
        micro-step and item counts, inf flags, master weights."""
        self._refuse_during_reduction("state_dict()")
        self._flush()
        sd = self.optimizer.state_dict()
        sd["accumkernels"] = {
            "flat_buffer": self._flat.clone(),
            "touched": sorted(self._index[i] for i in self._touched),
            "micro_steps": self._micro_steps,
            "items": self._items.clone() if isinstance(self._items, torch.Tensor) else self._items,
            "window_found_inf": self._window_found_inf.clone(),
            "step_found_inf": self._step_found_inf.clone(),
            "clip_coef": None if self._clip_coef is None else self._clip_coef.clone(),
            "master_weights": {self._index[k]: v.clone() for k, v in self._masters.items()},
            "windows": self._windows,
            "world_size": self.world_size,
            "rank": self.rank,
            "sharded": self.sharded,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a checkpoint of this wrapper, or of the plain wrapped optimizer
        (the window then starts empty). In distributed runs every rank saves and
        loads its own (the buffers hold that rank's contributions; in sharded
        mode the optimizer state holds its shards), with the same world size."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("accumkernels", None)
        if extra is not None:
            saved = (extra.get("world_size", 1), extra.get("rank", 0), extra.get("sharded", False))
            if saved != (self.world_size, self.rank, self.sharded):
                raise ValueError(
                    f"checkpoint is of rank {saved[1]} of {saved[0]} (sharded={saved[2]}); this wrapper is rank "
                    f"{self.rank} of {self.world_size} (sharded={self.sharded}): each rank loads its own checkpoint"
                )
        elif self.sharded:
            raise ValueError("sharded=True loads only its own state dicts (a plain optimizer's holds whole params)")
        self.optimizer.load_state_dict(state_dict)
        # The plain optimizer casts state to the param dtype (bf16 for bf16
        # params): take the checkpoint's own values, in fp32, instead.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for saved_id, p in zip(saved_ids, self._params_in_group_order()):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if torch.is_tensor(value) and key != "step" and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
        self._clear_window()
        if extra is None:
            return
        if extra["flat_buffer"].shape != self._flat.shape:
            raise ValueError(
                f"checkpoint buffer has {extra['flat_buffer'].numel()} elements; this wrapper's has {self._flat.numel()}"
            )
        self._flat.copy_(extra["flat_buffer"])
        self._touched = {id(self._params[i]) for i in extra["touched"]}
        self._micro_steps = extra["micro_steps"]
        items = extra["items"]
        self._items = items.to(self.device) if isinstance(items, torch.Tensor) else items
        self._window_found_inf.copy_(extra["window_found_inf"])
        self._step_found_inf.copy_(extra["step_found_inf"])
        self._clip_coef = None if extra["clip_coef"] is None else extra["clip_coef"].to(self.device)
        for i, master in extra["master_weights"].items():
            self._masters[id(self._params[i])].copy_(master)
        self._windows = extra.get("windows", 0)

    # ---- internals: set-up -------------------------------------------------

    @staticmethod
    def _distributed(process_group) -> bool:
        """Whether to reduce across processes: torch.distributed is initialized
        (the default group) or a group was given."""
        initialized = dist.is_available() and dist.is_initialized()
        if process_group is not None and not initialized:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        return initialized

    def _refuse_ddp(self) -> None:
        if _ddp_modules_holding(self._params):
            raise RuntimeError(
                "AccumulatingOptimizer reduces the gradients across ranks itself, once per window; a "
                "DistributedDataParallel module holds these params and its reducer would all-reduce every "
                "micro-batch's .grad (and owns .grad). Pass the plain module (model.module) to the model call and "
                "let the wrapper do the reduction"
            )

    def _steps_here(self, p: torch.Tensor) -> bool:
        """Whether this rank updates (part of) ``p``: always, unless sharded."""
        return not self.sharded or id(p) in self._shard

    def _param_view(self, p: torch.Tensor) -> torch.Tensor:
        """What this rank steps of ``p``: the param, or (sharded) its elements in this rank's shard."""
        if not self.sharded:
            return p
        lo, hi = self._shard[id(p)]
        return _flat_view(p)[lo:hi]

    def _buffer_view(self, p: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return self._buffers[self._index[id(p)]]
        lo, hi = self._shard[id(p)]
        start = self._offset[id(p)]
        return self._flat[start + lo : start + hi]

    @staticmethod
    def _optimizer_kind(optimizer) -> str:
        if type(optimizer) is torch.optim.SGD:
            return "sgd"
        if type(optimizer) is torch.optim.AdamW:
            return "adamw"
        if type(optimizer) is torch.optim.Adam:
            return "adam"
        return "fallback"

    def _collect_params(self) -> list[torch.Tensor]:
        params, seen = [], set()
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError(f"a param appears in more than one param group (again in group {g})")
                seen.add(id(p))
                if p.layout != torch.strided:
                    raise TypeError(f"param group {g} holds a {p.layout} param; only dense params are supported")
                params.append(p)
        self._signature = self._param_signature()
        return params

    def _params_in_group_order(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _param_signature(self):
        return tuple(tuple(id(p) for p in group["params"]) for group in self.param_groups)

    def _check_params_unchanged(self) -> None:
        if self._param_signature() != self._signature:
            raise RuntimeError(
                "the wrapped optimizer's params changed after wrapping (a param group was added or edited); "
                "add every param group before wrapping it"
            )

    def _make_buffers(self, bucket_cap_mb: float):
        """One flat fp32 buffer, params laid out in reverse order (the order
        their gradients usually arrive in), each view 64-byte aligned and with
        its param's strides; buckets are contiguous runs of at most ~cap bytes,
        each padded to a multiple of world_size * 16 elements (aligned shards)."""
        order = list(reversed(self._params))
        cap = bucket_cap_mb * 2**20
        groups, current, size = [], [], 0
        for p in order:
            if current and size + p.numel() * 4 > cap:
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * 4
        if current:
            groups.append(current)
        buckets = [_Bucket(i, g) for i, g in enumerate(groups)]
        offsets, total = {}, 0
        for b in buckets:
            b.start = total
            for p in b.params:
                offsets[id(p)] = total
                total += -(-p.numel() // _ALIGN_ELEMENTS) * _ALIGN_ELEMENTS
            unit = _ALIGN_ELEMENTS * self.world_size
            total = -(-total // unit) * unit
            b.end = total
        flat = torch.zeros(total, dtype=torch.float32, device=self.device)
        buffers = []
        for p in self._params:
            if p.is_contiguous():
                view = flat[offsets[id(p)] : offsets[id(p)] + p.numel()].view(p.shape)
            else:  # dense with another memory order (e.g. channels_last): same strides
                view = flat.as_strided(p.shape, p.stride(), offsets[id(p)])
            buffers.append(view)
        bucket_of = {id(p): b for b in buckets for p in b.params}
        return buffers, flat, buckets, bucket_of, offsets

    # ---- internals: accumulation -------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if grad.layout != torch.strided:
            raise RuntimeError("AccumulatingOptimizer: sparse gradients are not supported")
        if grad.shape != param.shape:
            raise RuntimeError(
                f"AccumulatingOptimizer: a gradient of shape {tuple(grad.shape)} arrived for a param of shape "
                f"{tuple(param.shape)}"
            )
        bucket = self._bucket_of[id(param)]
        last = self._reducer is not None and self._in_last_micro_step()
        if last and self._reducer.is_launched(bucket.index):
            raise RuntimeError(
                "AccumulatingOptimizer: a gradient arrived for a bucket whose cross-rank reduction has already "
                "started (a second backward in the window's last micro-step): sum the losses and call backward "
                "once per micro-step"
            )
        bucket.pending[id(param)] = param
        self._grads_since_step = True
        if len(bucket.pending) == bucket.expected:
            self._fold(bucket)
            if last:
                self._reduce_bucket(bucket)

    def _refuse_during_reduction(self, what: str) -> None:
        if self._reducer is not None and self._reducer.started:
            raise RuntimeError(
                f"{what} between the window's last backward and step(): the buffers are being reduced across "
                "ranks in place; call it before that backward or after step()"
            )

    def _in_last_micro_step(self) -> bool:
        return self.accum_steps is None or self._micro_steps + 1 >= self.accum_steps

    def _reduce_bucket(self, bucket: _Bucket) -> None:
        """This rank's window sum of ``bucket`` is final: zero the views of
        params it got no gradient for (they hold an older window's values) and
        hand the bucket to the reducer."""
        for p in bucket.params:
            if id(p) not in self._touched:
                self._buffers[self._index[id(p)]].zero_()
        self._reducer.ready(bucket.index)

    def _flush(self) -> None:
        """Fold the gradients still waiting in incomplete buckets (params that
        got no gradient this micro-step leave their bucket incomplete)."""
        for bucket in self._buckets:
            if bucket.pending:
                self._fold(bucket)

    def _inv_loss_scale(self):
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return 1.0
        if self._micro_inv_scale is None:
            scale = self.grad_scaler._scale
            if scale is None:
                raise RuntimeError("grad_scaler has not scaled a loss yet: call scaler.scale(loss).backward()")
            self._micro_inv_scale = scale.double().reciprocal().float().to(self.device)
        return self._micro_inv_scale

    @torch.no_grad()
    def _fold(self, bucket: _Bucket) -> None:
        # A gradient the user dropped after it arrived (module.zero_grad()) is gone.
        params = [p for p in bucket.pending.values() if p.grad is not None]
        bucket.pending.clear()
        found_inf = self._step_found_inf if self._check_inf else None
        scale = self._inv_loss_scale()
        for overwrite in (True, False):
            chosen = [p for p in params if (id(p) not in self._touched) == overwrite]
            if chosen:
                ops.accumulate_(
                    [self._buffers[self._index[id(p)]] for p in chosen],
                    [p.grad for p in chosen],
                    scale,
                    overwrite=overwrite,
                    found_inf=found_inf,
                    backend=self.backend,
                )
        for p in params:
            self._touched.add(id(p))
            p.grad = None

    def _count_items(self, num_items) -> None:
        if self.normalize != "items":
            if num_items is not None:
                raise ValueError(f"num_items is only used with normalize='items' (this wrapper has {self.normalize!r})")
            return
        if num_items is None:
            raise ValueError("normalize='items' needs step(num_items=n) on every micro-step")
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1:
                raise ValueError(f"num_items must have 1 element; got {num_items.numel()}")
            self._items = self._items + num_items.reshape(()).to(self.device, torch.float32)
        else:
            if isinstance(num_items, bool) or not isinstance(num_items, (int, float)) or not num_items > 0:
                raise ValueError(f"num_items must be > 0; got {num_items!r}")
            self._items = self._items + float(num_items)

    def _report_to_scaler(self, found_inf: torch.Tensor) -> None:
        """GradScaler.update() backs off on the inf/NaN flags its optimizers
        report; it could not see ours (there are no .grad to inspect)."""
        per_optimizer = self.grad_scaler._per_optimizer_states[id(self)]
        per_optimizer["found_inf_per_device"] = {self.device: found_inf}

    # ---- internals: the window step ----------------------------------------

    def _normalization(self, pending: bool = False):
        if self.normalize == "sum":
            return 1.0
        if self.normalize == "mean":
            return 1.0 / max(1, self._micro_steps + (1 if pending and self._grads_since_step else 0))
        if isinstance(self._items, torch.Tensor):
            return 1.0 / self._items
        if self._items <= 0:
            raise RuntimeError("normalize='items': no items were counted in this window yet")
        return 1.0 / self._items

    def _grad_norm(self, scale) -> torch.Tensor:
        """Global L2 norm of the window's gradient times ``|scale|``; in sharded
        mode the shards' squared norms are summed across ranks."""
        touched = [p for p in self._params if id(p) in self._touched and self._steps_here(p)]
        if touched:
            norm = ops.grad_norm([self._buffer_view(p) for p in touched], backend=self.backend)
        else:
            norm = torch.zeros((), device=self.device)
        if self.sharded:
            squared = (norm * norm).reshape(1)
            dist.all_reduce(squared, group=self.process_group)
            norm = squared.sqrt().reshape(())
        return (norm * (scale.abs() if isinstance(scale, torch.Tensor) else abs(scale))).reshape(())

    def _end_window(self) -> None:
        if self._reducer is not None:
            grad_scale, found_inf = self._reduce_window()
        else:
            grad_scale = self._normalization()
            found_inf = self._window_found_inf if self._check_inf else None
        if self.max_grad_norm is not None:
            self.last_grad_norm = self._grad_norm(grad_scale)
            coef = torch.clamp(self.max_grad_norm / (self.last_grad_norm + 1e-6), max=1.0)
            self._clip_coef = coef if self._clip_coef is None else torch.minimum(coef, self._clip_coef)
        if self._clip_coef is not None:
            grad_scale = self._clip_coef * grad_scale
        if isinstance(grad_scale, torch.Tensor):
            grad_scale = grad_scale.reshape(1).to(torch.float32)
        if self._kind == "fallback":
            self._fallback_step(grad_scale, found_inf)
        else:
            for group in self.param_groups:
                params = [p for p in group["params"] if id(p) in self._touched and self._steps_here(p)]
                if params:
                    self._step_group(group, params, grad_scale, found_inf)
        if self.sharded:
            self._gather_params()
        self._windows += 1
        self._clear_window()

    def _reduce_window(self):
        """Sum the window across ranks: launch the buckets not launched during
        backward, then one float64 all-reduce of [inf flag, items, micro-steps,
        a got-a-gradient mask over params]. Leaves ``_touched`` as the union over
        ranks; returns the global normalization and inf flag (device tensors)."""
        if self._windows == 0:
            self._refuse_ddp()  # a DDP module made after the wrapper
        for bucket in self._buckets:
            if not self._reducer.is_launched(bucket.index):
                self._reduce_bucket(bucket)
        flag = self._window_found_inf if self._check_inf else torch.zeros(1, device=self.device)
        items = self._items if isinstance(self._items, torch.Tensor) else torch.tensor(float(self._items))
        head = torch.stack(
            [
                flag.reshape(()).to(self.device, torch.float64),
                items.reshape(()).to(self.device, torch.float64),
                torch.tensor(float(self._micro_steps), dtype=torch.float64, device=self.device),
            ]
        )
        mask = torch.tensor([float(id(p) in self._touched) for p in self._params], dtype=torch.float64)
        meta = torch.cat([head, mask.to(self.device)])
        work = dist.all_reduce(meta, group=self.process_group, async_op=True)
        self._reducer.finish()
        work.wait()
        union = meta[3:].cpu()  # the host sync: which params the step updates
        self._touched = {id(p) for p, got in zip(self._params, union.tolist()) if got > 0}
        found_inf = (meta[0:1] > 0).to(torch.float32)
        if self.grad_scaler is not None:
            self._report_to_scaler(found_inf)
        if self.normalize == "sum":
            scale = 1.0
        else:
            scale = meta[2:3] if self.normalize == "mean" else meta[1:2]
            scale = scale.reciprocal().to(torch.float32)
        return scale, (found_inf if self._check_inf else None)

    def _gather_params(self) -> None:
        """Sharded mode, after the step: every bucket's updated params travel in
        the bucket's own memory, now free (fp32, or viewed as the params' common
        16-bit dtype), all-gathered in place, then copied into the params."""
        staging = []
        for b in self._buckets:
            region = self._flat[b.start : b.end]
            if b.gather_dtype != torch.float32:
                region = region.view(b.gather_dtype)[: b.end - b.start]
            for p in b.params:
                if id(p) in self._shard:
                    lo, hi = self._shard[id(p)]
                    at = self._offset[id(p)] - b.start
                    region[at + lo : at + hi].copy_(self._param_view(p))
            staging.append(region)
        self._reducer.gather_params(staging)
        for b, region in zip(self._buckets, staging):
            for p in b.params:
                if id(p) in self._touched:
                    at = self._offset[id(p)] - b.start
                    _flat_view(p).copy_(region[at : at + p.numel()])

    def _clear_window(self) -> None:
        self._touched.clear()
        self._micro_steps = 0
        self._items = 0.0
        self._grads_since_step = False
        self._window_found_inf.zero_()
        self._clip_coef = None

    @staticmethod
    def _number(value):
        """A hyperparameter given as a tensor (torch.optim allows a tensor lr) is read once per window."""
        return float(value) if isinstance(value, torch.Tensor) else value

    def _step_group(self, group, params, grad_scale, found_inf) -> None:
        # One kernel call per (master weights or not, first step or not).
        with_master = [p for p in params if id(p) in self._masters]
        without = [p for p in params if id(p) not in self._masters]
        for subset in (with_master, without):
            if not subset:
                continue
            masters = [self._masters[id(p)] for p in subset] if subset is with_master else None
            if self._kind == "sgd":
                self._sgd(group, subset, masters, grad_scale, found_inf)
            else:
                self._adam(group, subset, masters, grad_scale, found_inf)

    def _state_like(self, p, key):
        """The fp32 state tensor ``key`` of ``p`` (of its shard, in sharded mode),
        created as zeros laid out like what is stepped if missing."""
        like = self._param_view(p)
        state = self.state[p]
        value = state.get(key)
        if value is None or value.dtype != torch.float32 or value.device != like.device or value.stride() != like.stride():
            fresh = torch.zeros_like(like, dtype=torch.float32, memory_format=torch.preserve_format)
            if value is not None:
                fresh.copy_(value)
            state[key] = value = fresh
        return value

    def _sgd(self, group, params, masters, grad_scale, found_inf) -> None:
        momentum = group["momentum"]
        # torch.optim starts a momentum buffer as a copy of the first gradient:
        # params without one take a separate first-step call.
        first = {id(p) for p in params if momentum and self.state[p].get("momentum_buffer") is None}
        for is_first in (True, False):
            index = [i for i, p in enumerate(params) if (id(p) in first) == is_first]
            if not index:
                continue
            chosen = [params[i] for i in index]
            ops.sgd_step_and_zero_(
                [self._param_view(p) for p in chosen],
                [self._buffer_view(p) for p in chosen],
                [self._state_like(p, "momentum_buffer") for p in chosen] if momentum else None,
                lr=self._number(group["lr"]),
                momentum=momentum,
                dampening=group["dampening"],
                weight_decay=group["weight_decay"],
                nesterov=group["nesterov"],
                maximize=group.get("maximize", False),
                is_first_step=is_first,
                grad_scale=grad_scale,
                found_inf=found_inf,
                master_params=[masters[i] for i in index] if masters else None,
                zero_buffers=False,
                stochastic_rounding=self.stochastic_rounding,
                seed=self._windows % 2**32,
                backend=self.backend,
            )

    def _adam(self, group, params, masters, grad_scale, found_inf) -> None:
        adamw = self._kind == "adamw" or group.get("decoupled_weight_decay", False)
        amsgrad = group["amsgrad"]
        steps = []
        for p in params:
            step = self.state[p].get("step")
            if step is None or not torch.is_tensor(step) or step.device != p.device or step.dtype != torch.float32:
                step = torch.tensor(float(step or 0.0), dtype=torch.float32, device=p.device)
                self.state[p]["step"] = step
            steps.append(step)
        fn = ops.adamw_step_and_zero_ if adamw else ops.adam_step_and_zero_
        fn(
            [self._param_view(p) for p in params],
            [self._buffer_view(p) for p in params],
            [self._state_like(p, "exp_avg") for p in params],
            [self._state_like(p, "exp_avg_sq") for p in params],
            steps,
            max_exp_avg_sqs=[self._state_like(p, "max_exp_avg_sq") for p in params] if amsgrad else None,
            lr=self._number(group["lr"]),
            betas=tuple(self._number(b) for b in group["betas"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            amsgrad=amsgrad,
            maximize=group.get("maximize", False),
            grad_scale=grad_scale,
            found_inf=found_inf,
            master_params=masters,
            zero_buffers=False,
            stochastic_rounding=self.stochastic_rounding,
            seed=self._windows % 2**32,
            backend=self.backend,
        )

    def _fallback_step(self, grad_scale, found_inf) -> None:
        """Any other optimizer: hand it the window's gradient as .grad and let it
        step. The inf/NaN skip needs one host sync here."""
        if found_inf is not None and bool(found_inf.item()):
            return
        for p in self._params:
            if id(p) in self._touched:
                p.grad = (self._buffers[self._index[id(p)]] * grad_scale).to(p.dtype)
        self.optimizer.step()
        for p in self._params:
            p.grad = None

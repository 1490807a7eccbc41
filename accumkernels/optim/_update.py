"""The window's update: the fused step-and-zero ops for SGD, Adam and AdamW
(hyperparameters read from the param groups at every window), the fallback
that hands any other optimizer the window's gradient as ``.grad``, the global
gradient norm for clipping, each param's precision (master weights, rounding,
state dtype) and the stochastic-rounding streams (each param's stream id is
its index in the wrapper, so no two params share random bits, whatever kernel
call they are stepped in)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _state8 as state8
from .. import ops
from .._validation import is_dense
from ._fsdp import local_tensor, shard_like, state8_blocks, state8_scales
from ._layout import Layout, ParamRecord

KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}


MASTER_WEIGHTS = (False, True, "remainders")
STATE_DTYPES = (None, torch.float32, torch.bfloat16, "8bit")


@dataclass(frozen=True)
class Precision:
    """How the fused step keeps one param (chosen by ``precision_of``).

    master       None; "fp32": an fp32 copy (4 bytes per element); "remainders":
                 an int16 of the fp32 master's low 16 bits, whose high 16 bits
                 the bf16 param holds (2 bytes: param and remainder are the
                 fp32 master bit for bit)
    stochastic   round the updated bf16 param stochastically (unbiased)
    state_dtype  of its optimizer state (bf16: rounded stochastically; "8bit":
                 uint8 codes and block scales, accumkernels._state8)
    """

    master: str | None
    stochastic: bool
    state_dtype: torch.dtype | str

    def state_bytes(self, numel: int) -> int:
        """The bytes of one state tensor of ``numel`` elements."""
        if self.state_dtype == "8bit":
            return numel + 4 * state8.scales_numel(numel)
        return numel * (torch.finfo(self.state_dtype).bits // 8)

    def master_bytes(self) -> int:
        return {None: 0, "fp32": 4, "remainders": 2}[self.master]


def precision_of(param_dtype: torch.dtype, *, master_weights, stochastic_rounding, state_dtype) -> Precision:
    """The wrapper's options for one param. Defaults (``None``): bf16 params
    without master weights are rounded stochastically and keep their state in
    bf16; every other param keeps fp32 state and rounds to nearest."""
    low = param_dtype in (torch.bfloat16, torch.float16)
    master = None
    if master_weights and low:
        master = "remainders" if master_weights == "remainders" else "fp32"
    bf16_alone = param_dtype == torch.bfloat16 and master is None
    stochastic = bf16_alone if stochastic_rounding is None else bool(stochastic_rounding) and bf16_alone
    if state_dtype is None:
        state_dtype = torch.bfloat16 if bf16_alone else torch.float32
    return Precision(master, stochastic, state_dtype)


def state_keys(kind: str, group: dict) -> tuple[str, ...]:
    """The state tensors the fused step keeps per param of ``group`` (as torch.optim names them;
    8-bit state keeps each as ``<key>_codes`` and ``<key>_scales``)."""
    if kind == "sgd":
        return ("momentum_buffer",) if group["momentum"] else ()
    if kind in ("adam", "adamw"):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    return ()


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """'sgd', 'adam', 'adamw' (the fused step) or 'fallback'."""
    return KINDS.get(type(optimizer), "fallback")


def _number(value):
    """A hyperparameter given as a tensor (torch.optim allows a tensor lr) is read once per window."""
    return float(value) if isinstance(value, torch.Tensor) else value


def clip_coefficient(max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm / (norm + 1e-6))."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _dense(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the kernels step: each param view, or a contiguous copy of one that
    is a non-dense view (a column slice), which the kernels cannot walk."""
    return [v if is_dense(v) else v.contiguous() for v in views]


def _write_back(views: list[torch.Tensor], stepped: list[torch.Tensor]) -> None:
    for view, dense in zip(views, stepped):
        if dense is not view:
            view.copy_(dense)


def _fp32_mastered(records: list[ParamRecord]) -> list[ParamRecord]:
    """The records this rank steps from fp32 master weights."""
    return [r for r in records if r.master is not None and r.master.dtype == torch.float32 and r.stepped_here]


def _write_mark(r: ParamRecord) -> tuple[int, int]:
    """What changes when anything writes ``r``'s param in place or replaces its storage."""
    local = r.local
    return local._version, local.data_ptr()


class Updater:
    """Steps the params of a window from the buffers."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        *,
        master_weights,
        stochastic_rounding,
        state_dtype,
        backend: ops.Prepared,
        sync,
    ) -> None:
        # backend: the ops' Prepared backend (the tensors stepped are the wrapper's
        # own); sync: the window's cross-rank part, for global norms and
        # stochastic-rounding stream ids.
        self.sync = sync
        self.optimizer = optimizer
        self.kind = optimizer_kind(optimizer)
        self.layout = layout
        self.backend = backend
        # Param index -> (version counter, storage) of its stepped elements when
        # the window last wrote them (fp32 master weights only: follow_params).
        self._written: dict[int, tuple[int, int]] = {}
        for r in layout:
            r.precision = precision_of(
                r.param.dtype,
                master_weights=master_weights if self.kind != "fallback" else False,
                stochastic_rounding=stochastic_rounding if self.kind != "fallback" else False,
                state_dtype=state_dtype if self.kind != "fallback" else torch.float32,
            )

    def make_masters(self, kept: dict[int, torch.Tensor]) -> None:
        """The master weights of the params this rank steps: ``kept``'s by
        param index (those held before the layout was remade), else an fp32
        copy, or zero remainders (a bf16 param is an fp32 value with zero low bits)."""
        for r in self.layout:
            if r.index in kept:
                r.master = kept[r.index]
            elif r.precision.master is not None and r.stepped_here:
                view = r.param_view().detach()
                r.master = (
                    view.float().clone() if r.precision.master == "fp32" else torch.zeros_like(view, dtype=torch.int16)
                )

    def follow_params(self, records: list[ParamRecord]) -> None:
        """fp32 master weights follow a param written by anything but the step
        since the step last wrote it (``model.load_state_dict``, an in-place
        ``copy_`` under no_grad, ``.data`` replaced): torch.optim steps from the
        param as it is, so where the param is no longer what its master rounds
        to, the master becomes the param's value. Only params whose version
        counter or storage moved are compared (one host sync for all). A write
        through ``p.data`` bumps no counter: the step sees it element by
        element (formulas.h's master_or_param starts from the param where it
        no longer holds its master rounded). Remainders need no following: the
        param holds the master's high bits itself."""
        moved = [r for r in _fp32_mastered(records) if self._written.get(r.index) != _write_mark(r)]
        if not moved:
            return
        views = [r.param_view() for r in moved]
        differ = torch.stack([(r.master.to(v.dtype) != v).any() for r, v in zip(moved, views)]).tolist()
        for r, view, d in zip(moved, views, differ):
            if d:
                r.master.copy_(view)

    def note_params(self, records: list[ParamRecord]) -> None:
        """The window wrote ``records``' params (stepped, and gathered across ranks)."""
        for r in _fp32_mastered(records):
            self._written[r.index] = _write_mark(r)

    def init_state(self, intake) -> None:
        """Create the state of every param this rank steps (zeros, step 0), as a
        first step would, without stepping; a fallback optimizer takes one
        step of lr 0 on zero gradients (what torch.distributed.checkpoint
        does to create a plain optimizer's state)."""
        if self.kind == "fallback":
            self._init_fallback_state(intake)
            return
        for group in self.optimizer.param_groups:
            for r in (self.layout.record(p) for p in group["params"]):
                if not r.stepped_here:
                    continue
                for key in state_keys(self.kind, group):
                    if r.precision.state_dtype == "8bit":
                        self._codes_like(r, key)
                    else:
                        self._state_like(r, key)
                if self.kind != "sgd":
                    self.optimizer.state[r.param].setdefault("step", torch.zeros((), device=r.local.device))

    # ---- the global norm ------------------------------------------------------

    def local_squared_norm(self, records: list[ParamRecord]) -> torch.Tensor:
        """Sum of squares of this rank's stepped buffer elements (0-dim fp32)."""
        views = [r.buffer_view() for r in records if r.stepped_here]
        if not views:
            return torch.zeros((), device=self.layout.device)
        # fp32 buffers, or gradients held in their params' dtypes (_intake: lean).
        norm = ops.grad_norm(views, backend=self.backend)
        return norm * norm

    def norm(self, records: list[ParamRecord], scale) -> torch.Tensor:
        """Global L2 norm of ``scale`` times the buffers of ``records`` (over every rank)."""
        squared = self.sync.squared_norm(self.local_squared_norm(records))
        return (squared.sqrt() * (scale.abs() if isinstance(scale, torch.Tensor) else abs(scale))).reshape(())

    # ---- the step ---------------------------------------------------------------

    def step(self, records: list[ParamRecord], grad_scale, found_inf, seed: int, intake) -> None:
        """Update ``records`` (the params with a gradient this window) from
        ``grad_scale * buffer``; skip everything if ``found_inf`` is nonzero.
        The intake says whether the buffers must be cleared and sets ``.grad``
        for the fallback."""
        zero_buffers = intake.zero_buffers_at_step
        self.follow_params(records)
        if self.kind == "fallback":
            self._fallback(records, grad_scale, found_inf, intake)
            return
        chosen = {r.index for r in records if r.stepped_here}
        for group in self.optimizer.param_groups:
            members = [r for r in (self.layout.record(p) for p in group["params"]) if r.index in chosen]
            # One kernel call per (master weights, state dtype) and, for SGD,
            # first momentum step or not: a call takes one kind of each.
            calls: dict[tuple, list[ParamRecord]] = {}
            for r in members:
                calls.setdefault((r.precision.master, r.precision.state_dtype), []).append(r)
            for subset in calls.values():
                if self.kind == "sgd":
                    self._sgd(group, subset, grad_scale, found_inf, seed, zero_buffers)
                else:
                    self._adam(group, subset, grad_scale, found_inf, seed, zero_buffers)

    def _has_state(self, r: ParamRecord, key: str) -> bool:
        """Whether ``r`` holds state ``key`` (plain, or as 8-bit codes). A
        plain ``key`` set to None is none, codes or not: torch's SGD starts
        its momentum anew from the gradient there."""
        state = self.optimizer.state[r.param]
        if key in state:
            return state[key] is not None
        return state.get(key + "_codes") is not None

    def _state_like(self, r: ParamRecord, key: str) -> torch.Tensor:
        """The state tensor ``key`` of ``r`` (of this rank's elements) in the
        param's state dtype, created as zeros laid out like what is stepped if
        missing (or converted, if it is of another dtype, device or layout).
        For an FSDP2 param the state is a DTensor sharded like it (what
        torch.optim keeps, and what torch.distributed.checkpoint saves); the
        kernels get its local shard. Its layout is the buffer's: the param's own,
        or contiguous for a param that is a non-dense view (as torch.optim's
        ``zeros_like(param, memory_format=torch.preserve_format)``)."""
        like = r.buffer_like()
        dtype = r.precision.state_dtype
        state = self.optimizer.state[r.param]
        if key not in state and key + "_codes" in state:  # an 8-bit checkpoint: decoded
            state[key] = state8.decode_moment(key, state.pop(key + "_codes"), state.pop(key + "_scales"))
        value = state.get(key)
        local = value if value is None or r.local_of is None else local_tensor(value)
        if local is None or local.dtype != dtype or local.device != like.device or local.stride() != like.stride():
            fresh = torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)
            if local is not None:
                fresh.copy_(local.reshape(fresh.shape))
            value = local = fresh
            if r.param is not r.local:  # a DTensor param
                value = shard_like(fresh, r.param)
            state[key] = value
        return local

    def _codes_like(self, r: ParamRecord, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The 8-bit state ``key`` of ``r``: (uint8 codes laid out like what is
        stepped, fp32 block scales), kept as ``<key>_codes`` and
        ``<key>_scales``; created as zeros, or encoded (to nearest) from a
        plain ``key`` (an fp32 or bf16 checkpoint's, or one set since the last
        step, as torch code that resets a moment does: it replaces the codes),
        or re-encoded from codes laid out otherwise (the blocks follow the
        memory order). For an FSDP2 param the codes are a DTensor sharded like
        it and the scales this rank's row of a (W, blocks) DTensor
        (_fsdp.state8_blocks says why); the kernels get the local shard and
        the row's first scales."""
        like = r.buffer_like()
        blocks = state8.scales_numel(like.numel())
        dtensor = r.param is not r.local
        kept = state8_blocks(r.param) if dtensor else blocks  # scales this rank keeps
        state = self.optimizer.state[r.param]
        codes, scales = state.get(key + "_codes"), state.get(key + "_scales")
        codes = None if codes is None else local_tensor(codes)
        scales = None if scales is None else local_tensor(scales).reshape(-1)
        fits = (
            codes is not None
            and codes.dtype == torch.uint8
            and codes.device == like.device
            and codes.shape == like.shape
            and codes.stride() == like.stride()
            and scales is not None
            and scales.dtype == torch.float32
            and scales.device == like.device
            and scales.numel() == kept
            and dtensor == hasattr(state[key + "_scales"], "device_mesh")
        )
        plain = state.pop(key, None)
        if fits and plain is None:
            return codes, scales[:blocks]
        plain = None if plain is None else local_tensor(plain)
        if plain is None and codes is not None and scales is not None:
            plain = state8.decode_moment(key, codes, scales[:blocks])
        if plain is None:
            codes = torch.zeros_like(like, dtype=torch.uint8, memory_format=torch.preserve_format)
            scales = torch.zeros(kept, dtype=torch.float32, device=like.device)
        else:
            codes, encoded = state8.encode_moment(key, plain.float().to(like.device).reshape(like.shape), like, None)
            scales = torch.zeros(kept, dtype=torch.float32, device=like.device)
            scales[:blocks] = encoded
        if dtensor:
            state[key + "_codes"], state[key + "_scales"] = shard_like(codes, r.param), state8_scales(scales, r.param)
        else:
            state[key + "_codes"], state[key + "_scales"] = codes, scales
        return codes, scales[:blocks]

    def _stream_id(self, r: ParamRecord) -> int:
        """Its index; ranks that hold different elements of a param (FSDP2,
        ZeRO-1) mix their rank in (sync.stream_id)."""
        return self.sync.stream_id(r.index)

    def _common(self, group, subset, grad_scale, found_inf, seed, zero_buffers) -> dict:
        return dict(
            grad_scale=grad_scale,
            found_inf=found_inf,
            maximize=group.get("maximize", False),
            master_params=[r.master for r in subset] if subset[0].master is not None else None,
            zero_buffers=zero_buffers,
            stochastic_rounding=any(r.precision.stochastic for r in subset),
            seed=seed,
            positions=[self._stream_id(r) for r in subset],
            backend=self.backend,
        )

    def _sgd(self, group, subset, grad_scale, found_inf, seed, zero_buffers) -> None:
        momentum = group["momentum"]
        # torch.optim starts a momentum buffer as a copy of the first gradient:
        # params without one take a separate first-step call.
        first = {r.index for r in subset if momentum and not self._has_state(r, "momentum_buffer")}
        eight_bit = momentum and subset[0].precision.state_dtype == "8bit"
        for is_first in (True, False):
            chosen = [r for r in subset if (r.index in first) == is_first]
            if not chosen:
                continue
            views = [r.param_view() for r in chosen]
            stepped = _dense(views)
            if eight_bit:
                codes = [self._codes_like(r, "momentum_buffer") for r in chosen]
                buffers, scales = [c for c, _ in codes], [s for _, s in codes]
            else:
                buffers = [self._state_like(r, "momentum_buffer") for r in chosen] if momentum else None
                scales = None
            ops.sgd_step_and_zero_(
                stepped,
                [r.buffer_view() for r in chosen],
                buffers,
                momentum_buffer_scales=scales,
                lr=_number(group["lr"]),
                momentum=momentum,
                dampening=group["dampening"],
                weight_decay=group["weight_decay"],
                nesterov=group["nesterov"],
                is_first_step=is_first,
                **self._common(group, chosen, grad_scale, found_inf, seed, zero_buffers),
            )
            _write_back(views, stepped)

    def _adam(self, group, subset, grad_scale, found_inf, seed, zero_buffers) -> None:
        # (torch.optim.Adam's step reads the group's key, which AdamW's groups hold as True)
        adamw = group.get("decoupled_weight_decay", self.kind == "adamw")
        amsgrad = group["amsgrad"]
        steps = []
        for r in subset:
            state = self.optimizer.state[r.param]
            step = state.get("step")
            if (
                step is None
                or not torch.is_tensor(step)
                or step.device != r.local.device
                or step.dtype != torch.float32
            ):
                step = torch.tensor(float(step or 0.0), dtype=torch.float32, device=r.local.device)
                state["step"] = step
            steps.append(step)
        fn = ops.adamw_step_and_zero_ if adamw else ops.adam_step_and_zero_
        views = [r.param_view() for r in subset]
        stepped = _dense(views)
        scales = {}
        if subset[0].precision.state_dtype == "8bit":
            m = [self._codes_like(r, "exp_avg") for r in subset]
            v = [self._codes_like(r, "exp_avg_sq") for r in subset]
            exp_avgs, exp_avg_sqs = [c for c, _ in m], [c for c, _ in v]
            scales = dict(exp_avg_scales=[s for _, s in m], exp_avg_sq_scales=[s for _, s in v])
        else:
            exp_avgs = [self._state_like(r, "exp_avg") for r in subset]
            exp_avg_sqs = [self._state_like(r, "exp_avg_sq") for r in subset]
        fn(
            stepped,
            [r.buffer_view() for r in subset],
            exp_avgs,
            exp_avg_sqs,
            steps,
            **scales,
            max_exp_avg_sqs=[self._state_like(r, "max_exp_avg_sq") for r in subset] if amsgrad else None,
            lr=_number(group["lr"]),
            betas=tuple(_number(b) for b in group["betas"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            amsgrad=amsgrad,
            **self._common(group, subset, grad_scale, found_inf, seed, zero_buffers),
        )
        _write_back(views, stepped)

    def _init_fallback_state(self, intake) -> None:
        groups = self.optimizer.param_groups
        lrs = [group["lr"] for group in groups]
        records = [r for r in self.layout if r.param.requires_grad]
        had_none = [r for r in records if r.param.grad is None]
        try:
            for group in groups:
                group["lr"] = 0.0 * group["lr"]  # (a tensor lr stays a tensor)
            for r in records:
                intake.set_grad(r, torch.zeros_like(r.param))
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, lrs):
                group["lr"] = lr
            for r in records:
                intake.set_grad(r, None)
            for r in had_none:  # (as they were)
                r.param.grad = None

    def _fallback(self, records, grad_scale, found_inf, intake) -> None:
        """Any other optimizer: hand it the window's gradient as .grad and let it
        step; the other params hold None meanwhile, so it skips them as
        torch.optim skips a param without gradient. The inf/NaN skip needs one
        host sync here."""
        if found_inf is None or not bool(found_inf.item()):
            stepped = {r.index for r in records}
            others = [r for r in self.layout if r.index not in stepped and r.param.grad is not None]
            for r in records:
                intake.set_grad(r, (r.buffer * grad_scale).to(r.param.dtype))
            for r in others:
                r.param.grad = None
            self.optimizer.step()
            for r in (*records, *others):
                intake.set_grad(r, None)
        if intake.zero_buffers_at_step:
            self.layout.zero_views(records)

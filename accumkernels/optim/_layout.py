"""Where AccumulatingOptimizer keeps its fp32 sums: one flat buffer per wrapper,
one view per param, buckets of contiguous views, and one record per param.

Layout of the flat buffer: params in reverse order (the order their gradients
usually arrive in during backward), each view starting on a 64-byte boundary
(16 fp32 elements) and carrying its param's sizes and strides (a channels_last
param gets a channels_last view), grouped into buckets of at most
``bucket_cap_mb`` of contiguous views. Each bucket is padded to a multiple of
16 * W elements, W the number of ranks that split it, so every rank's shard of
it, ``flat[start + r*s : start + (r+1)*s]`` with ``s = (end - start) / W``,
starts aligned too. All the flat-buffer arithmetic lives here.

A wrapper whose windows are one micro-batch (accum_steps=1, one process)
holds no flat buffer between windows (``hold=False``): each record's
``buffer`` is then the gradient itself, in the param's dtype and laid out as
its view would be, or None; ``allocate()`` makes the flat buffer for a
window that must sum after all, ``release()`` drops it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._validation import is_dense

ALIGN_ELEMENTS = 16  # 64 bytes of fp32


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """The elements of a dense tensor in memory order, as a 1-D view."""
    return t.detach().as_strided((t.numel(),), (1,), t.storage_offset())


@dataclass(eq=False)
class Bucket:
    """Records whose views are contiguous in the flat buffer, ``flat[start:end]``:
    the unit in which gradients are folded and reduced across ranks."""

    index: int
    records: list[ParamRecord]
    start: int = 0
    end: int = 0
    expected: int = 0  # gradients per backward that complete it (its trainable params)

    @property
    def gather_dtype(self) -> torch.dtype:
        """The dtype updated params travel in when gathered across ranks:
        their own when the bucket's params share one, else fp32."""
        dtypes = {r.param.dtype for r in self.records}
        return dtypes.pop() if len(dtypes) == 1 else torch.float32


@dataclass(eq=False)
class ParamRecord:
    """Everything the wrapper keeps about one param."""

    param: torch.Tensor
    local_of: Callable[[torch.Tensor], torch.Tensor] | None  # the param -> the elements this process holds (None: all)
    index: int  # place in the wrapper's params: also its stochastic-rounding stream id
    group: int  # its param group
    offset: int  # first element of its view in the flat buffer
    bucket: Bucket | None = None
    # fp32 view of the flat buffer, laid out like the param (without a flat
    # buffer: the window's gradient in the param's dtype, laid out alike, or None)
    buffer: torch.Tensor | None = None
    shard: tuple[int, int] | None = None  # [lo, hi) of its elements this rank steps; None: all
    precision: object = None  # how the fused step keeps it (_update.Precision)
    # the param's dtype, device and strides when wrapped (model.to() after wrapping is refused)
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    stride: tuple[int, ...] = ()
    master: torch.Tensor | None = None  # master weights of what this rank steps: fp32, or int16 remainders
    marker: torch.Tensor | None = None  # intake "hooks": the FoldedGrad its .grad holds
    contiguous: bool = True  # its buffer view is contiguous (intake "hooks" reads it per gradient)
    buffer_stride: tuple[int, ...] = ()  # its buffer view's strides

    def relaid(self) -> str:
        """The refusal of a param no longer laid out as when wrapped (its
        strides differ: its buffer, state and master weights are laid out like it was)."""
        return (
            f"param {self.index} has strides {self.param.stride()} and had {self.stride} when "
            "AccumulatingOptimizer was built (model.to(memory_format=...), or p.data = a tensor laid out "
            "otherwise, after wrapping): its buffer, state and master weights are laid out as it was. Convert the "
            "model first, then build the optimizer and the wrapper (or call opt.close() first)"
        )

    @property
    def local(self) -> torch.Tensor:
        """The elements of the param this process holds: the param itself, or a
        DTensor's local shard (looked up each time: FSDP2 may replace it)."""
        return self.param if self.local_of is None else self.local_of(self.param)

    def local_grad(self) -> torch.Tensor | None:
        """The param's ``.grad`` as this process holds it (a DTensor's local shard)."""
        grad = self.param.grad
        return grad if self.local_of is None or grad is None else self.local_of(grad)

    @property
    def numel(self) -> int:
        return self.local.numel()

    @property
    def stepped_here(self) -> bool:
        """Whether this rank updates (part of) the param."""
        return self.shard is None or self.shard[0] < self.shard[1]

    def param_view(self) -> torch.Tensor:
        """What this rank steps of the param: the param, or its shard's elements (1-D)."""
        if self.shard is None:
            return self.local
        return flat_view(self.local)[self.shard[0] : self.shard[1]]

    def buffer_view(self) -> torch.Tensor:
        """The buffer elements matching param_view()."""
        if self.shard is None:
            return self.buffer
        return flat_view(self.buffer)[self.shard[0] : self.shard[1]]

    def buffer_like(self) -> torch.Tensor:
        """A tensor laid out as buffer_view() (what state is made like): the
        view, or where there is none (no flat buffer, no gradient), the
        param's stepped elements, or a new contiguous tensor for a non-dense param."""
        if self.buffer is not None:
            return self.buffer_view()
        view = self.param_view()
        return view if is_dense(view) else torch.empty(view.shape, dtype=torch.uint8, device=view.device)


def collect_params(optimizer) -> tuple[list[torch.Tensor], list[int]]:
    """The optimizer's params in group order and the group of each; refuses a
    param in two groups, sparse params and a lazy module's uninitialized ones."""
    params, groups, seen = [], [], set()
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in seen:
                # torch.optim warns of duplicates in a group (and will refuse them): it steps such a param twice.
                raise ValueError(
                    f"param group {g} lists a param that is already listed (in this group or an earlier "
                    "one): list each param once"
                )
            if p.layout != torch.strided:
                raise TypeError(f"param group {g} holds a {p.layout} param; only dense params are supported")
            if isinstance(p, torch.nn.parameter.UninitializedParameter):
                # torch.optim holds it until a forward gives it a shape; the fp32 buffers need the shape now.
                raise ValueError(
                    f"param group {g} holds an uninitialized param (a lazy module's, e.g. nn.LazyLinear): its fp32 "
                    "buffer is laid out from its size, which it has only after a forward; run the model once "
                    "on a dummy batch before building the optimizer (or adding the group)"
                )
            seen.add(id(p))
            params.append(p)
            groups.append(g)
    return params, groups


def param_signature(param_groups) -> tuple:
    """Which params sit in which group: compared at every step() to the wrapped one."""
    return tuple(tuple(id(p) for p in group["params"]) for group in param_groups)


class Layout:
    """The flat buffer, its buckets and the records of ``params``.

    ``shard_ranks``: the number of ranks each bucket is split across (1 unless
    the wrapper shards optimizer state); buckets are padded for it.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        groups: list[int],
        device: torch.device,
        bucket_cap_mb: float,
        shard_ranks: int = 1,
        local=None,
        unit_of=None,
        hold: bool = True,
    ) -> None:
        # `local` maps a param to the tensor whose elements the buffers hold
        # (a DTensor's local shard under FSDP2); None: the param itself.
        # `unit_of` maps a param to the unit its gradients arrive with (FSDP2:
        # its fully_shard module); a bucket never spans two, so it is folded as
        # soon as its unit's gradients are in.
        self.records = [
            ParamRecord(p, local, i, g, 0, dtype=p.dtype, device=p.device, stride=p.stride())
            for i, (p, g) in enumerate(zip(params, groups))
        ]
        self._by_id = {id(r.param): r for r in self.records}
        cap = bucket_cap_mb * 2**20
        unit = unit_of or (lambda p: None)
        runs, current, size = [], [], 0
        for r in reversed(self.records):
            nbytes = r.numel * 4
            if current and (size + nbytes > cap or unit(r.param) != unit(current[-1].param)):
                runs.append(current)
                current, size = [], 0
            current.append(r)
            size += nbytes
        if current:
            runs.append(current)
        self.buckets = [Bucket(i, run) for i, run in enumerate(runs)]
        total = 0
        for b in self.buckets:
            b.start = total
            for r in b.records:
                r.bucket = b
                r.offset = total
                total += _round_up(r.numel, ALIGN_ELEMENTS)
            total = _round_up(total, ALIGN_ELEMENTS * shard_ranks)
            b.end = total
        self.numel = total
        self.device = device
        self.flat: torch.Tensor | None = None
        for r in self.records:
            t = r.local
            r.contiguous = t.is_contiguous() or not is_dense(t)
            r.buffer_stride = _contiguous_strides(t.shape) if r.contiguous else t.stride()
        if hold:
            self.allocate()
        self.refresh_expected()

    def allocate(self) -> None:
        """Make the flat buffer (zeros) and point every record's buffer at its view."""
        self.flat = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for r in self.records:
            r.buffer = self.view(r)

    def release(self) -> None:
        """Drop the flat buffer (or the gradients held without one)."""
        self.flat = None
        for r in self.records:
            r.buffer = None

    def view(self, r: ParamRecord, flat: torch.Tensor | None = None) -> torch.Tensor:
        """A new view of ``r``'s slice of the flat buffer (or of ``flat``), laid
        out like the param where the param is dense in some memory order
        (channels_last: the same strides); contiguous for a param that is a
        non-dense view (a column slice), whose strides would reach into the
        neighbours' slices."""
        flat = self.flat if flat is None else flat
        if r.contiguous:
            return flat[r.offset : r.offset + r.local.numel()].view(r.local.shape)
        return flat.as_strided(r.local.shape, r.buffer_stride, r.offset)

    def flat_of(self, values: dict[int, torch.Tensor]) -> torch.Tensor:
        """A new fp32 flat buffer holding ``values`` (record index -> its
        window sum) in their views and zeros elsewhere: what a layout
        without one saves in a checkpoint."""
        flat = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for i, value in values.items():
            self.view(self.records[i], flat).copy_(value)
        return flat

    def aliased(self, r: ParamRecord) -> bool:
        """``r.buffer`` still lies in the flat buffer. Code that replaces a
        tensor's data in place (``module.to('cpu:0')`` on 'cpu' tensors sets
        ``param.grad.data`` to a copy) can move an exposed view out of it."""
        return r.buffer.data_ptr() == self.flat.data_ptr() + r.offset * 4

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def records_of(self, indices) -> list[ParamRecord]:
        """The records with these indices, in index order."""
        return [self.records[i] for i in sorted(indices)]

    def record(self, param: torch.Tensor) -> ParamRecord | None:
        return self._by_id.get(id(param))

    def refresh_expected(self) -> None:
        """Recount each bucket's trainable params (requires_grad may change
        during training)."""
        for b in self.buckets:
            b.expected = sum(r.param.requires_grad for r in b.records)

    @staticmethod
    def shard_of(bucket: Bucket, rank: int, world: int, relative: bool = False) -> tuple[int, int]:
        """Rank ``rank``'s [lo, hi) of ``bucket`` split across ``world`` ranks:
        in the flat buffer, or from the bucket's start (``relative``)."""
        s = (bucket.end - bucket.start) // world
        base = 0 if relative else bucket.start
        return base + rank * s, base + (rank + 1) * s

    def region(self, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor:
        """The bucket's memory as ``bucket.end - bucket.start`` elements of
        ``dtype`` (fp32, or a 16-bit dtype in the first half of it)."""
        region = self.flat[bucket.start : bucket.end]
        return region if dtype == torch.float32 else region.view(dtype)[: bucket.end - bucket.start]

    def set_shards(self, rank: int, world: int) -> None:
        """Sharded optimizer state: each record gets the part of its elements
        that falls in rank ``rank``'s shard of its bucket."""
        for b in self.buckets:
            lo, hi = self.shard_of(b, rank, world)
            for r in b.records:
                a, z = max(lo, r.offset), min(hi, r.offset + r.numel)
                r.shard = (a - r.offset, z - r.offset) if a < z else (0, 0)

    def zero_all(self) -> None:
        """Every window sum becomes zeros: the flat buffer in one pass, and
        any view moved out of it (``aliased``)."""
        self.flat.zero_()
        for r in self.records:
            if not self.aliased(r):
                r.buffer.zero_()

    def zero_views(self, records) -> None:
        """The records' window sums become zeros (without a flat buffer: a zero
        gradient of the param's dtype, laid out as its view)."""
        for r in records:
            if self.flat is None:
                r.buffer = torch.zeros_like(r.buffer_like(), dtype=r.dtype, memory_format=torch.preserve_format)
            else:
                r.buffer.zero_()

"""Cross-rank reduction of AccumulatingOptimizer's flat fp32 buffer, once per
window, and the window's cross-rank bookkeeping.

Each bucket is a contiguous slice ``flat[start:end]`` whose length is a multiple
of the world size W, so rank r's shard of it is ``flat[start + r*s : start + (r+1)*s]``
with ``s = (end - start) / W`` (accumkernels.optim._layout). Buckets are launched
strictly in index order (every rank must issue the same collectives in the same
order), each as soon as it and all before it are ready; ``finish()`` waits for
them. ``sync_window`` then sums the window's counts and flags over ranks in one
small all-reduce.

Collectives per bucket and window (torch.distributed only, NCCL or gloo):

=============  =========================================  =====================================
mode / wire    fp32 (default)                             bf16
=============  =========================================  =====================================
all-reduce     ``all_reduce`` (SUM), in place             ``all_to_all_single`` of bf16 chunks,
                                                          fp32 sum, ``all_gather_single`` (bf16)
sharded        ``reduce_scatter_single`` (SUM), in place  ``all_to_all_single`` of bf16 chunks,
                                                          fp32 sum into the shard
=============  =========================================  =====================================

With a bf16 wire each rank's contribution is rounded to bf16 once (relative error
<= 2^-8, bf16's unit roundoff), the sum over ranks is computed in fp32, and in all-reduce mode the summed
shard is rounded to bf16 once more to be gathered.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from . import _pipeline
from ._layout import Bucket, Layout, ParamRecord, flat_view
from ._sync import Sync
from ._window import Window


def _reduce_scatter(output, input, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch < 2.13
    return fn(output, input, group=group, async_op=True)


def _all_gather(output, input, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    return fn(output, input, group=group, async_op=True)


class BucketSync(Sync):
    """Several data-parallel ranks: launches and completes the per-bucket
    collectives of each window, sums its bookkeeping over the ranks, and
    (sharded, ZeRO-1) gathers the updated params."""

    spans_ranks = True
    reduces_buffers = True

    def __init__(
        self,
        group,
        layout: Layout,
        window: Window,
        sharded: bool,
        wire_dtype,
        average: bool,
        ddp=None,
        each_backward: bool = False,
    ) -> None:
        # average: the intake exposes the buffers as .grad, which must hold the
        # window averaged over ranks (as DDP's) once reduced (see reduce_now);
        # each_backward: accum_steps=None with such an intake (see the property)
        super().__init__(layout, window, ddp)
        self._each_backward = each_backward
        self._stages_looked_for = False
        # Set by an intake whose buffers are .grad: reduces the window now, once
        # (a pipeline stage's schedule calls it when its backwards end)
        self.reduce_window = None
        self.replicas_checked = False  # the first window sent its replica hashes
        self.average = average
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.flat = layout.flat
        self.sharded = sharded
        self.wire_dtype = wire_dtype
        self._ready: set[int] = set()
        self._next = 0  # the next bucket to launch
        self.finished = False  # the window's sum is reduced (finish() ran)
        self._reopened = False  # reduced once this window already: every view holds its reduced sum
        self._launched: list[tuple[int, object, tuple]] = []  # (bucket, work, tensors kept alive)
        self.check_layout()
        if sharded:
            layout.set_shards(self.rank, self.world)

    def check_layout(self) -> None:
        """At construction: every rank of the group wraps params of the same
        count, shapes and dtypes (else the per-bucket collectives would pair
        unlike buffers, or abort inside gloo on their sizes)."""
        key = 0
        for r in self.layout:
            for part in (zlib.crc32(str(r.param.dtype).encode()), r.param.ndim, *r.param.shape):
                key = (key * 1_000_003 + part) % _PRIME
        values = torch.tensor([len(self.layout), self.flat.numel(), key], dtype=torch.int64, device=self.flat.device)
        both = torch.cat([values, -values])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)  # the max, and minus the min
        if bool((both[:3] != -both[3:]).any()):
            _refuse_unlike_params(self.group, "params of other shapes or dtypes")

    def replica_hashes(self) -> torch.Tensor:
        """Two 20-bit hashes of this rank's param values (integer sums of their
        bits, weighted by position): equal on every rank of data-parallel
        replicas (DDP broadcasts rank 0's at construction, possibly after the
        wrapper was built)."""
        device = self.flat.device
        integer = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if not len(self.layout):
            return torch.zeros(2, dtype=torch.int64, device=device)
        sums = torch.stack(
            [
                flat_view(r.param).view(integer[r.param.element_size()]).to(torch.int64).sum() % _PRIME
                for r in self.layout
            ]
        )
        position = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=device)
        return torch.stack(
            [
                (sums * position % _PRIME).sum() % 2**20,
                (sums * (position * position % _PRIME) % _PRIME).sum() % _PRIME % 2**20,
            ]
        )

    @property
    def each_backward(self) -> bool:
        """Without a DDP module, each backward ends with the reduction, except
        on a pipeline stage: its schedule runs a window's backwards in one call
        (a collective in one stage's backward would wait for a stage that waits
        for its gradients), and reduces the window when they end
        (_pipeline.reduce_when_backwards_end). Stages are looked for at the
        first backward (one built after the wrapper is found there too)."""
        if self._each_backward and not self._stages_looked_for:
            self._stages_looked_for = True
            stages = _pipeline.stages_holding([r.param for r in self.layout])
            for stage in stages:
                _pipeline.reduce_when_backwards_end(stage, self.reduce_window)
            self._each_backward = not stages
        return self._each_backward

    @property
    def stage(self) -> bool:
        """The params are a pipeline stage's (looked for at the first backward, see each_backward)."""
        return self._stages_looked_for and not self._each_backward

    @property
    def started(self) -> bool:
        return bool(self._ready) or self.finished

    @property
    def reduced(self) -> bool:
        return self.finished

    def norm_records(self) -> list[ParamRecord]:
        """Reduced: params another rank touched hold gradient too (the others zeros)."""
        return list(self.layout)

    def reset(self) -> None:
        """The window ended: the next one starts unreduced."""
        self._restart()
        self._reopened = False

    def _restart(self) -> None:
        self._ready.clear()
        self._next = 0
        self._launched.clear()
        self.finished = False

    def reopen(self) -> bool:
        """accum_steps=None with intake "grad": a backward after the window's
        reduction (each backward of a module without DDP is reduced, as is each
        of a DDP module outside no_sync()). Its gradients add into the reduced
        buffers, which every rank holds alike, and its end reduces them again:
        the average over ranks keeps the earlier sum and adds this backward's
        average, as DDP's .grad does. Not on a bf16 wire, which rounds each
        rank's contribution once per window."""
        if not self.average or self.sharded or self.wire_dtype != torch.float32 or not self.finished:
            return False
        self._restart()
        self._reopened = True
        return True

    def bucket_launched(self, bucket: Bucket) -> bool:
        return bucket.index < self._next

    def _shard(self, index: int) -> tuple[int, int]:
        return self.layout.shard_of(self.layout.buckets[index], self.rank, self.world)

    def bucket_ready(self, bucket: Bucket) -> None:
        """``bucket`` holds this rank's whole window sum: launch it and every
        ready bucket after it, in order. Views of params that got no gradient in
        the window still hold an older window's values: zeroed first."""
        window = self.window
        if not self._reopened:
            self.layout.zero_views(r for r in bucket.records if r.index not in window.touched)
        self._ready.add(bucket.index)
        while self._next < len(self.layout.buckets) and self._next in self._ready:
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        b = self.layout.buckets[index]
        bucket = self.flat[b.start : b.end]
        if self.wire_dtype == torch.float32:
            if self.sharded:
                lo, hi = self._shard(index)
                work = _reduce_scatter(self.flat[lo:hi], bucket, self.group)
            else:
                work = dist.all_reduce(bucket, group=self.group, async_op=True)
            self._launched.append((index, work, ()))
            return
        send = bucket.to(self.wire_dtype)
        received = torch.empty_like(send)  # chunk r of every rank, rank by rank
        work = dist.all_to_all_single(received, send, group=self.group, async_op=True)
        self._launched.append((index, work, (send, received)))

    def finish(self) -> None:
        """Wait for every bucket's reduction; after it each rank's shard (sharded)
        or whole buffer (all-reduce) holds the sum over ranks."""
        if self._next != len(self.layout.buckets):
            raise RuntimeError("BucketSync.finish() before every bucket was launched")
        gathers = []
        for index, work, tensors in self._launched:
            work.wait()
            if not tensors:
                continue
            send, received = tensors
            lo, hi = self._shard(index)
            total = received.view(self.world, hi - lo).sum(dim=0, dtype=torch.float32)
            if self.sharded:
                self.flat[lo:hi].copy_(total)
            else:  # gather the summed shards; ``send`` is free again and receives them
                gathers.append((index, _all_gather(send, total.to(self.wire_dtype), self.group), send))
        for index, work, gathered in gathers:
            work.wait()
            b = self.layout.buckets[index]
            self.flat[b.start : b.end].copy_(gathered)
        self.finished = True

    def launch_remaining(self) -> None:
        """Launch the buckets the last backward left incomplete."""
        if self.finished:
            return
        for bucket in self.layout.buckets:
            if not self.bucket_launched(bucket):
                self.bucket_ready(bucket)

    def reduce_now(self) -> None:
        """Reduce the whole window now and average it over the ranks (the
        ``.grad`` a DDP user expects after the window's last backward)."""
        self.launch_remaining()
        self.finish()
        self.flat.div_(self.world)
        self.window.divisor = float(self.world)

    def end_window(self, check_inf: bool):
        """The window's sums over ranks (see all_reduce_window), the buckets
        not launched during backward launched first and completed meanwhile.
        The first window's also carries the replica hashes: ranks that hold
        different param values (pipeline stages of equal shapes, replicas
        seeded apart) are refused before anything is stepped."""
        self._end_first_window()
        if self.average and not self.finished:
            self.reduce_now()
        self.launch_remaining()
        hashes = None if self.replicas_checked else self.replica_hashes()
        found_inf, items, micro_steps, unlike = all_reduce_window(
            self.group,
            self.window,
            self.layout,
            check_inf,
            while_waiting=None if self.finished else self.finish,
            replica_hashes=hashes,
        )
        self.replicas_checked = True
        if unlike:
            _refuse_unlike_params(self.group, "different param values")
        return found_inf, self.window.global_normalization(items, micro_steps)

    def squared_norm(self, local: torch.Tensor) -> torch.Tensor:
        """The window gradient's squared norm from this rank's: every rank holds
        the whole reduced buffer, or (sharded) its shard of it."""
        return self.over_stages(sum_over_ranks(local, self.group) if self.sharded else local)

    def after_step(self) -> None:
        if self.sharded:
            self.gather_params()
        self.reset()

    def stream_id(self, index: int) -> int:
        """Param ``index``'s stochastic-rounding stream: all-reduce mode, the
        same on every rank (every rank steps the same elements); sharded, one
        per rank, whose shard's element indices start at 0 (as FSDP2's)."""
        return index * self.world + self.rank if self.sharded else index

    def gather_params(self) -> None:
        """Sharded mode, after the step: every bucket's updated params travel in
        the bucket's own memory, now free (fp32, or viewed as the params' common
        16-bit dtype), all-gathered in place, then copied into the params.
        All gathers are launched before any wait."""
        touched = self.window.touched
        staging, works = [], []
        for b in self.layout.buckets:
            region = self.layout.region(b, b.gather_dtype)
            for r in b.records:
                if r.stepped_here:
                    lo, hi = r.shard
                    at = r.offset - b.start
                    region[at + lo : at + hi].copy_(r.param_view())
            lo, hi = self.layout.shard_of(b, self.rank, self.world, relative=True)
            works.append(_all_gather(region, region[lo:hi], self.group))
            staging.append(region)
        for work in works:
            work.wait()
        for b, region in zip(self.layout.buckets, staging):
            for r in b.records:
                if r.index in touched:
                    at = r.offset - b.start
                    flat_view(r.param).copy_(region[at : at + r.numel])


_PRIME = 2**31 - 1


def _refuse_unlike_params(group, what: str) -> None:
    raise ValueError(
        f"the {dist.get_world_size(group)} ranks of AccumulatingOptimizer's process group hold {what}: they are "
        "not data-parallel replicas, and summing their gradients would train each wrong. Pipeline stages: build "
        "each stage's wrapper after its PipelineStage (it then reduces over the stage's data-parallel group) or "
        "pass process_group= that group (e.g. mesh['dp']); tensor-parallel shards are not supported; replicas "
        "must start equal (DistributedDataParallel broadcasts rank 0's params, or seed every rank alike)"
    )


def sum_over_ranks(value: torch.Tensor, group) -> torch.Tensor:
    """A 0-dim tensor summed over the ranks of ``group`` (a new tensor)."""
    total = value.reshape(1).clone()
    dist.all_reduce(total, group=group)
    return total.reshape(())


def all_reduce_window(group, window: Window, layout: Layout, check_inf: bool, while_waiting=None, replica_hashes=None):
    """One float64 all-reduce of [inf flag, items, micro-steps, a got-a-gradient
    mask over params] (``while_waiting`` runs while it is in flight). Leaves
    ``window.touched`` as the union over ranks (the mask is read on the host:
    the one host sync of a distributed window); returns the global inf flag and
    the global item and micro-step counts (device tensors), and whether
    ``replica_hashes`` (int64 values below 2^20, or None) differ between
    ranks: each h is sent as h and h^2, which are equal everywhere exactly
    when W * sum(h^2) == sum(h)^2 (both sides the one rounding of W^2 h^2 where
    they are equal: the sums are exact in float64 for W < 2^13)."""
    device = layout.flat.device
    flag = window.found_inf if check_inf else torch.zeros(1, device=device)
    items = window.items if isinstance(window.items, torch.Tensor) else torch.tensor(float(window.items))
    head = torch.stack(
        [
            flag.reshape(()).to(device, torch.float64),
            items.reshape(()).to(device, torch.float64),
            torch.tensor(float(window.micro_steps), dtype=torch.float64, device=device),
        ]
    )
    mask = torch.zeros(len(layout), dtype=torch.float64)
    mask[sorted(window.touched)] = 1.0
    hashes = torch.zeros(0, dtype=torch.float64, device=device)
    if replica_hashes is not None:
        h = replica_hashes.to(device, torch.float64)
        hashes = torch.stack([h, h * h], dim=1).flatten()
    meta = torch.cat([head, hashes, mask.to(device)])
    work = dist.all_reduce(meta, group=group, async_op=True)
    if while_waiting is not None:
        while_waiting()
    work.wait()
    n = hashes.numel()
    union = meta[3 + n :].cpu()
    window.touched = set(union.nonzero().flatten().tolist())
    unlike = False
    if n:
        sums = meta[3 : 3 + n].view(-1, 2)
        unlike = bool((dist.get_world_size(group) * sums[:, 1] != sums[:, 0] * sums[:, 0]).any())
    return (meta[0:1] > 0).to(torch.float32), meta[1:2], meta[2:3], unlike

"""Cross-rank reduction of AccumulatingOptimizer's flat fp32 buffer, once per window.

Each bucket is a contiguous slice ``flat[start:end]`` whose length is a multiple
of the world size W, so rank r's shard of it is ``flat[start + r*s : start + (r+1)*s]``
with ``s = (end - start) / W``. Buckets are launched strictly in index order (every
rank must issue the same collectives in the same order), each as soon as it and all
before it are ready; ``finish()`` waits for them.

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
<= 2^-9), the sum over ranks is computed in fp32, and in all-reduce mode the summed
shard is rounded to bf16 once more to be gathered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _reduce_scatter(output, input, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch < 2.13
    return fn(output, input, group=group, async_op=True)


def _all_gather(output, input, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    return fn(output, input, group=group, async_op=True)


class BucketReducer:
    """Launches and completes the per-bucket collectives of one window."""

    def __init__(self, group, flat: torch.Tensor, ranges: list[tuple[int, int]], sharded: bool, wire_dtype) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.flat = flat
        self.ranges = ranges
        self.sharded = sharded
        self.wire_dtype = wire_dtype
        self._ready: set[int] = set()
        self._next = 0  # the next bucket to launch
        self._launched: list[tuple[int, object, tuple]] = []  # (bucket, work, tensors kept alive)

    @property
    def started(self) -> bool:
        return bool(self._ready)

    def is_launched(self, index: int) -> bool:
        return index < self._next

    def shard(self, index: int) -> tuple[int, int]:
        """This rank's [lo, hi) slice of bucket ``index`` in the flat buffer."""
        start, end = self.ranges[index]
        s = (end - start) // self.world
        return start + self.rank * s, start + (self.rank + 1) * s

    def ready(self, index: int) -> None:
        """Bucket ``index`` holds this rank's whole window sum: launch it and
        every ready bucket after it, in order."""
        self._ready.add(index)
        while self._next < len(self.ranges) and self._next in self._ready:
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        start, end = self.ranges[index]
        bucket = self.flat[start:end]
        if self.wire_dtype == torch.float32:
            if self.sharded:
                lo, hi = self.shard(index)
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
        if self._next != len(self.ranges):
            raise RuntimeError("BucketReducer.finish() before every bucket was launched")
        gathers = []
        for index, work, tensors in self._launched:
            work.wait()
            if not tensors:
                continue
            send, received = tensors
            lo, hi = self.shard(index)
            total = received.view(self.world, hi - lo).sum(dim=0, dtype=torch.float32)
            if self.sharded:
                self.flat[lo:hi].copy_(total)
            else:  # gather the summed shards; ``send`` is free again and receives them
                gathers.append((index, _all_gather(send, total.to(self.wire_dtype), self.group), send))
        for index, work, gathered in gathers:
            work.wait()
            start, end = self.ranges[index]
            self.flat[start:end].copy_(gathered)
        self._ready.clear()
        self._next = 0
        self._launched.clear()

    def gather_params(self, staging: list[torch.Tensor]) -> None:
        """All-gather every bucket's ``staging`` tensor (length end - start, in
        place: this rank's chunk is its input), all launched before any wait."""
        works = []
        for tensor in staging:
            s = tensor.numel() // self.world
            works.append(_all_gather(tensor, tensor[self.rank * s : (self.rank + 1) * s], self.group))
        for work in works:
            work.wait()

"""The window's cross-rank part: one interface, one implementation per way
params are spread over ranks.

=================  ====================================================  ==========================
Sync               what crosses ranks                                    module
=================  ====================================================  ==========================
``Sync``           nothing (one process, or a pipeline stage no other    here
                   rank holds)
``BucketSync``     the fp32 buffers, bucket by bucket (all-reduce, or    ``_distributed``
                   ZeRO-1's reduce-scatter), and the params after a
                   sharded step
``FSDPSync``       nothing of the buffers: FSDP2 reduce-scatters each    ``_fsdp``
                   micro-step's gradient itself
=================  ====================================================  ==========================

Each owns its reduction's start (``bucket_ready``, ``reduce_now``) and
finish (``end_window``: the window's flags, counts and touched params over
every rank, and the gradient's normalization from them), the cross-rank
norm (``squared_norm``), the params a global norm covers (``norm_records``),
its shards and divisor, and the stochastic-rounding stream of each param
(``stream_id``). A DistributedDataParallel module over the params is taken
over (accumkernels.optim._ddp) by whichever sync the wrapper has.
"""

from __future__ import annotations

import torch

from ._layout import Bucket, Layout, ParamRecord
from ._window import Window


class Sync:
    """One process: the buffers hold the whole window, nothing is reduced."""

    spans_ranks = False  # the window's gradient is summed over several ranks
    reduces_buffers = False  # the wrapper's buffers are summed across ranks in place (during backward)
    # accum_steps=None, intake "grad", no DDP module to say which backward ends
    # the window: each backward ends with the reduction (see BucketSync.reopen)
    each_backward = False
    # A pipeline stage's: (its pipeline group, None for the world; the
    # refusal of a norm over it, or None), else () (see _options.Options)
    pipeline: tuple = ()

    def __init__(self, layout: Layout, window: Window, ddp=None) -> None:
        # ddp: the _ddp.DDPWatch of a process with torch.distributed initialized, else None
        self.layout = layout
        self.window = window
        self.ddp = ddp

    @property
    def started(self) -> bool:
        """The buffers are being (or have been) reduced in place this window."""
        return False

    @property
    def reduced(self) -> bool:
        """The buffers hold the window's global gradient now (so a norm of them is the global one)."""
        return True

    def bucket_ready(self, bucket: Bucket) -> None:
        """This rank's window sum of ``bucket`` is final (the last micro-step's backward)."""

    def bucket_launched(self, bucket: Bucket) -> bool:
        """``bucket``'s cross-rank reduction has started."""
        return False

    def reduce_now(self) -> None:
        """Reduce the whole window now (intake "grad", at the end of its last backward)."""

    def reopen(self) -> bool:
        """A backward after the window's reduction: whether its gradients may be
        added and the window reduced again (else it is refused)."""
        return False

    def norm_records(self) -> list[ParamRecord]:
        """The params a global norm of the window covers now: those with a gradient."""
        return self.layout.records_of(self.window.touched)

    def end_window(self, check_inf: bool):
        """(the window's inf flag, its grad_scale before clipping) over every rank;
        leaves ``window.touched`` as the params with a gradient on any rank."""
        self._end_first_window()
        return self.window.found_inf, self.window.normalization()

    def squared_norm(self, local: torch.Tensor) -> torch.Tensor:
        """The window gradient's squared norm from this rank's part of it."""
        return self.over_stages(local)

    def over_stages(self, squared: torch.Tensor) -> torch.Tensor:
        """A pipeline stage's squared norm of its params summed over the
        pipeline's stages: the whole model's, as one process would clip it
        (every stage's step() takes part, as each rank runs its own)."""
        if not self.pipeline:
            return squared
        if self.pipeline[1]:
            raise RuntimeError(self.pipeline[1])
        from ._distributed import sum_over_ranks  # (it imports this module)

        return sum_over_ranks(squared, self.pipeline[0])

    def stream_id(self, index: int) -> int:
        """Param ``index``'s stochastic-rounding stream: its index."""
        return index

    def after_step(self) -> None:
        """The window was stepped: the next one starts unreduced."""

    def _end_first_window(self) -> None:
        if self.ddp is not None and self.window.windows == 0:
            self.ddp.end_first_window()


def make_sync(options, layout: Layout, window: Window, *, sharded: bool, wire_dtype, average: bool) -> Sync:
    """The sync for the wrapper's checked options (accumkernels.optim._options):
    FSDP2's mesh, a data-parallel group of several ranks, or none.
    ``average``: the intake exposes the buffers as ``.grad``, which must hold
    the window averaged over ranks (as DDP's) once reduced."""
    from . import _ddp, _distributed, _fsdp

    ddp = _ddp.DDPWatch(options.params, window) if options.initialized and options.mesh is None else None
    if options.mesh is not None:
        sync = _fsdp.FSDPSync(options.mesh, options.params, layout, window)
    elif options.world_size > 1:
        sync = _distributed.BucketSync(
            options.process_group,
            layout,
            window,
            sharded,
            wire_dtype,
            average=average,
            ddp=ddp,
            each_backward=average and options.accum_steps is None,
        )
    else:
        sync = Sync(layout, window, ddp)
    sync.pipeline = options.pipeline
    return sync

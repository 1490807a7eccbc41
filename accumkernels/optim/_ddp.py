"""DistributedDataParallel: taken over, not refused.

Frameworks (Accelerate, HF Trainer, Lightning) wrap the model in DDP on
several processes. DDP's reducer would all-reduce ``.grad`` on every
micro-step that is not under ``no_sync()`` (in the params' dtype: bf16 for
bf16 params), while the wrapper reduces its fp32 buffers once per window
(accumkernels.optim._distributed). The wrapper takes a DDP module over: its
forward runs with ``require_backward_grad_sync = False`` (so the reducer
never prepares a reduction and its hooks do nothing), and the value the
framework set (False inside ``no_sync()``, True on the micro-step that
should sync) is kept as the window's ``sync_intent``: it tells which
backward ends the window.
"""

from __future__ import annotations

import weakref

import torch

from ._discovery import live_instances
from ._window import Window


def ddp_modules_holding(params) -> list:
    """The DistributedDataParallel modules (anywhere in this process) that hold any of ``params``."""
    from torch.nn.parallel import DistributedDataParallel

    ids = {id(p) for p in params}
    return live_instances(DistributedDataParallel, lambda ddp: any(id(p) in ids for p in ddp.module.parameters()))


def refuse_comm_hook(name: str) -> None:
    """A comm hook (fp16/bf16 compression, PowerSGD, DDP's own mixed
    precision) would never run: DDP's reducer is silenced and the wrapper
    reduces its fp32 window sums itself."""
    raise RuntimeError(
        f"a comm hook ({name}) on this DistributedDataParallel module would never run: "
        "AccumulatingOptimizer silences DDP's reducer and reduces the fp32 window sums itself, once per window. "
        "Build DDP without the hook (Lightning: DDPStrategy(ddp_comm_hook=None); Accelerate: no comm_hook in "
        "DistributedDataParallelKwargs); for a 16-bit wire pass wire_dtype=torch.bfloat16 to AccumulatingOptimizer"
    )


def refuse_join(ddp) -> None:
    """At a forward inside ``ddp.join()``, before any collective, so that every
    rank raises this rather than a gloo or NCCL abort."""
    join = getattr(ddp, "_join_config", None)
    if join is not None and join.enable:
        raise RuntimeError(
            "DistributedDataParallel.join() (uneven inputs across ranks) does not work with AccumulatingOptimizer: "
            "the wrapper reduces the buckets itself, once per window, and a rank that ran out of data has no shadow "
            "for those collectives. Give every rank the same number of micro-batches (e.g. "
            "DistributedSampler(drop_last=True)) and drop the join() context"
        )


def refuse_what_cannot_run(ddp) -> None:
    """Before ``ddp`` is taken over, on every rank alike: a comm hook already
    registered (DDP's logging data names Python and built-in ones alike;
    take_over_ddp refuses those registered later, at the call), or a
    ``join()`` it runs in."""
    hook = ddp._get_ddp_logging_data().get("comm_hook")
    if hook:
        refuse_comm_hook(hook)
    refuse_join(ddp)


def take_over_ddp(ddp, window: Window, reclaim=None) -> None:
    """Silence ``ddp``'s communication and record the framework's sync intent
    in ``window`` at every forward (idempotent). ``reclaim(params)``: given by
    an intake whose buffers are ``.grad``, which DDP built with
    gradient_as_bucket_view=True has made views of its own buckets."""
    if getattr(ddp, "_accumkernels_window", None) is not None:
        if ddp._accumkernels_window() is not window:
            raise RuntimeError(
                "this DistributedDataParallel module is already taken over by another AccumulatingOptimizer"
            )
        return
    if getattr(ddp, "static_graph", False) or getattr(ddp, "_use_python_reducer", False):
        raise RuntimeError(
            "AccumulatingOptimizer takes over DistributedDataParallel's communication, which it cannot do with "
            "static_graph=True or the python reducer (compiled autograd): construct DDP without them"
        )
    forward = ddp.forward
    window_ref = weakref.ref(window)

    def forward_without_sync(*args, **kwargs):
        refuse_join(ddp)
        intent = ddp.require_backward_grad_sync
        ddp.require_backward_grad_sync = False
        try:
            return forward(*args, **kwargs)
        finally:
            ddp.require_backward_grad_sync = intent
            ddp.require_forward_param_sync = True  # buffers broadcast at the next forward, as when DDP syncs
            owner = window_ref()
            if owner is not None and torch.is_grad_enabled():
                owner.sync_intent = intent

    ddp.forward = forward_without_sync
    # A hook registered from here on is refused at the call (rather than
    # looked up again at every forward).
    ddp.register_comm_hook = lambda state, hook: refuse_comm_hook(hook.__qualname__)
    ddp._register_builtin_comm_hook = lambda comm_hook_type: refuse_comm_hook(str(comm_hook_type))
    ddp._accumkernels_window = window_ref
    if reclaim is not None and getattr(ddp, "gradient_as_bucket_view", False):
        # Its buckets are never used from here on (it syncs nothing), and it
        # does not make .grad views again (it rebuilds buckets only when it syncs).
        reclaim(list(ddp.module.parameters()))


class DDPWatch:
    """Finds DDP modules over the wrapper's params: those that exist now, and
    those a framework builds after the optimizer (Accelerate, HF Trainer), at
    their first forward, through a global module forward pre-hook that lives
    until the wrapper's first window ends (then one last scan)."""

    def __init__(self, params, window: Window) -> None:
        self._ids = {id(p) for p in params}
        self._params = params
        self._window = window
        self._seen: set[int] = set()
        # Set by an intake whose buffers are .grad (take_over_ddp); DDP modules
        # that exist now made no bucket views of them yet.
        self.reclaim = None
        held = ddp_modules_holding(params)
        for ddp in held:
            refuse_what_cannot_run(ddp)
        for ddp in held:
            take_over_ddp(ddp, window)
        ref = weakref.ref(self)
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: _watch_forward(ref, module)
        )
        weakref.finalize(self, self._handle.remove)

    def check_module(self, module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if id(module) in self._seen or not issubclass(type(module), DistributedDataParallel):
            return
        if not any(id(p) in self._ids for p in module.module.parameters()):
            self._seen.add(id(module))
            return
        first = getattr(module, "_accumkernels_window", None) is None
        if first:
            refuse_what_cannot_run(module)  # before it counts as seen: a retried forward is refused again
        self._seen.add(id(module))
        take_over_ddp(module, self._window, self.reclaim)
        if first:
            # This call already looked up the old forward: silence it by hand and
            # restore the framework's value after it.
            intent = module.require_backward_grad_sync
            module.require_backward_grad_sync = False
            if torch.is_grad_enabled():
                self._window.sync_intent = intent
            handle = None

            def restore(mod, args, output):
                mod.require_backward_grad_sync = intent
                mod.require_forward_param_sync = True
                handle.remove()

            handle = module.register_forward_hook(restore)

    def end_first_window(self) -> None:
        self._handle.remove()
        for ddp in ddp_modules_holding(self._params):
            take_over_ddp(ddp, self._window, self.reclaim)


def _watch_forward(ref, module) -> None:
    watch = ref()
    if watch is not None:
        watch.check_module(module)

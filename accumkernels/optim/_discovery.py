"""Finding what nobody passes to the wrapper: who is calling ``step()`` (a
frame on the call stack) and which objects of a library hold its params (a
scan of the live objects). The two helpers every such lookup goes through.

Where they run is decided by their callers, to keep them off the
per-micro-step path: an object scan runs at construction (FSDP2 groups,
pipeline stages, device meshes) or until the first window ends (DDP modules
a framework builds late); a stack walk runs only where nothing cheaper
tells (a framework at the first ``step()``, DCP while the optimizer has no
state, a GradScaler until one is known).
"""

from __future__ import annotations

import gc
import sys


def calling_frame(match, *, skip: int, limit: int):
    """The innermost of the ``limit`` frames above the caller's ``skip``-th
    for which ``match(frame)`` is true, or None. ``skip=1`` starts at the
    caller's caller."""
    frame = sys._getframe(skip + 1)
    for _ in range(limit):
        if frame is None:
            return None
        if match(frame):
            return frame
        frame = frame.f_back
    return None


def frames_above(*, skip: int, limit: int):
    """The ``limit`` frames above the caller's ``skip``-th, innermost first."""
    frame = sys._getframe(skip + 1)
    for _ in range(limit):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def live_instances(cls, holds=None) -> list:
    """The live objects of ``cls`` (or a subclass), optionally only those for
    which ``holds(obj)`` is true. ``type()``, not ``isinstance()``: the latter
    reads ``__class__``, which warns on deprecated proxies such as
    ``torch.distributed.reduce_op``."""
    return [obj for obj in gc.get_objects() if issubclass(type(obj), cls) and (holds is None or holds(obj))]

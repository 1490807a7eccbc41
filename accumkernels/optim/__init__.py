"""The optimizers: ``AccumulatingOptimizer`` (wraps any ``torch.optim``
optimizer) and its parts, one module per concern:

``wrapper``        the class: arguments, the ``torch.optim.Optimizer`` surface, ``step()``, state dicts
``_options``       the constructor's checks
``_layout``        the flat fp32 buffer, buckets, shard ranges, one record per param
``_intake``        how gradients reach the buffers: the "hooks" and "grad" intakes
``_window``        what a window has seen: params, counts, items, inf flags, clip, seeds
``_amp``           GradScaler (the only code that reads its internals)
``_update``        the fused and fallback steps, norms, master weights
``_checkpoint``    loading state dicts safely; torch.distributed.checkpoint
``_distributed``   the per-bucket reduction across ranks, the DDP takeover
``_fsdp``          FSDP2 (DTensor) params

Imports go one way: ``wrapper`` -> its parts -> ``accumkernels.ops`` -> backends.
"""

from .wrapper import AccumulatingOptimizer

__all__ = ["AccumulatingOptimizer"]

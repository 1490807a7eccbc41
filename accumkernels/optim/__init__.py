"""The optimizers: ``AdamW``, ``Adam`` and ``SGD`` (``torch.optim``'s
signatures, built from params), ``AccumulatingOptimizer`` (wraps any
``torch.optim`` optimizer, which they are too) and its parts, one module per
concern:

``optimizers``     the drop-in classes
``wrapper``        AccumulatingOptimizer: arguments, the ``torch.optim.Optimizer`` surface, ``step()``, state dicts
``_options``       the constructor's checks
``_layout``        the flat fp32 buffer, buckets, shard ranges, one record per param
``_intake``        the Intake interface; how gradients reach the buffers: the "hooks" and "grad" intakes
``_window``        what a window has seen: params, counts, items, inf flags, clip, seeds
``_sync``          the Sync interface: the window's cross-rank part (none on one process)
``_distributed``   BucketSync: the per-bucket reduction across ranks, ZeRO-1, replica checks
``_fsdp``          FSDPSync and FSDP2 (DTensor) params
``_ddp``           the takeover of DistributedDataParallel modules
``_pipeline``      pipeline stages: a stage's data-parallel group; its reduction when the schedule's backwards end
``_amp``           GradScaler (the only code that reads its internals)
``_update``        the fused and fallback steps, norms, master weights
``_memory``        ``static_bytes``: what a configuration holds (the planner's static part)
``_checkpoint``    loading state dicts safely; torch.distributed.checkpoint
``_guards``        the mistakes step() refuses (a framework or loop counting the window too)
``_folded``        FoldedGrad, what ``.grad`` holds under intake "hooks"
``_discovery``     the stack walk and the object scan that find what nobody passes in

Imports go one way: ``optimizers`` -> ``wrapper`` -> its parts -> ``accumkernels.ops`` -> backends.
"""

from ._checkpoint import dequantized_state_dict
from ._memory import static_bytes
from .optimizers import SGD, Adam, AdamW
from .wrapper import AccumulatingOptimizer

__all__ = ["AccumulatingOptimizer", "Adam", "AdamW", "SGD", "dequantized_state_dict", "static_bytes"]

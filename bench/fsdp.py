"""FSDP2 accumulation: AccumulatingOptimizer against FSDP2's own.

`python -m bench.fsdp [--quick] [--world W]` spawns W processes (NCCL on W
GPUs if there are that many, else gloo on the CPU) that train the repo's GPT
model, each block and the root through ``fully_shard``, AdamW, windows of N
micro-batches, on the same data, along three paths:

- ``fsdp-bf16``: bf16 sharded params (compute and reduce-scatter in bf16) every
  micro-step; FSDP2 adds each micro-step's shard into the bf16 sharded ``.grad``.
- ``fsdp-no-sync-fp32``: fp32 sharded params, bf16 compute, fp32 reduce_dtype,
  ``set_requires_gradient_sync(False)`` on the first N-1 micro-steps: FSDP2
  accumulates the *unsharded* gradient in fp32 (the whole model on every
  rank) and reduce-scatters once per window.
- ``ours``: the same policy as fsdp-no-sync-fp32 with a reduce-scatter every
  micro-step (fp32), each shard folded into the wrapper's fp32 buffers (1/W).

Per path: the median time per window (rank 0, a barrier before each window),
the payload handed to collectives per window and the bytes each rank sends
under the ring model, the per-rank peak memory of a window (CPU: the running
sum of the profiler's memory events; CUDA: the allocator's peak) with the
optimizer state, the wrapper's buffers and FSDP2's unsharded accumulated
gradient (the last two measured as allocated), and the relative L2 error of
the window's gradient (the one the optimizer steps with) against the float64
gradient of the big batch (the same weights in float64, every rank's
micro-batches).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from accumkernels.testing import GPT, CollectiveCounter, exit_skipping_teardown

from . import common

PATHS = ("fsdp-bf16", "fsdp-no-sync-fp32", "ours")


def _micro_batch(window: int, rank: int, micro: int, batch: int, ctx: int, device):
    g = torch.Generator().manual_seed(window * 1000 + rank * 100 + micro)
    tokens = torch.randint(0, 256, (batch, ctx + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _worker(rank: int, world: int, init_file: str, cfg: dict, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import accumkernels as ak

    device = common.init_rank(rank, world, init_file, cfg)
    mesh = init_device_mesh(device.type, (world,))
    n_micro, batch, ctx = cfg["n_micro"], cfg["micro_batch"], cfg["ctx"]

    def new_model():
        torch.manual_seed(0)
        return GPT(d=cfg["d"], layers=cfg["layers"], heads=4, ctx=ctx).to(device)

    def sharded(path):
        model = new_model()
        if path == "fsdp-bf16":
            model = model.to(torch.bfloat16)
            policy = MixedPrecisionPolicy()
        else:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = ak.AccumulatingOptimizer(inner, accum_steps=n_micro) if path == "ours" else inner
        return model, opt

    def backward_window(path, model, opt, w, stop_before_step=False) -> int:
        """The window's micro-steps; returns the most bytes FSDP2's unsharded
        accumulated gradients held after any of them."""
        unsharded = 0
        for m in range(n_micro):
            if path == "fsdp-no-sync-fp32":
                model.set_requires_gradient_sync(m == n_micro - 1)
            x, y = _micro_batch(w, rank, m, batch, ctx, device)
            loss = model.loss(x, y)
            (loss if path == "ours" else loss / n_micro).backward()
            unsharded = max(unsharded, _bytes(fp.unsharded_accumulated_grad for fp in _fsdp_params(model)))
            if path == "ours" and not (stop_before_step and m == n_micro - 1):
                opt.step()
        return unsharded

    # The float64 gradient of window 0's big batch, each rank's shard of it.
    reference = new_model().double()
    loss = sum(reference.loss(*_micro_batch(0, r, m, batch, ctx, device)) for r in range(world) for m in range(n_micro))
    (loss / (world * n_micro)).backward()
    exact = [distribute_tensor(p.grad, mesh, [Shard(0)])._local_tensor for p in reference.parameters()]
    del reference

    rows = []
    for path in PATHS:
        model, opt = sharded(path)
        # Window 0: its gradient against float64, its collectives counted.
        with CollectiveCounter() as counter:
            backward_window(path, model, opt, 0, stop_before_step=True)
        if path == "ours":
            got = [opt.accumulated_grad(p) for p in model.parameters()]
        else:
            got = [p.grad._local_tensor.double() for p in model.parameters()]
        sums = torch.tensor(
            [
                sum(((g.double() - e) ** 2).sum() for g, e in zip(got, exact)).item(),
                sum((e**2).sum() for e in exact).item(),
            ],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(sums)
        error = (sums[0] / sums[1]).sqrt().item()
        opt.step()  # the window's last step() (the wrapper's) or the plain step
        opt.zero_grad()
        # Per-rank peak memory of window 1 (state exists now), with its parts.
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            unsharded = backward_window(path, model, opt, 1)
            if path != "ours":
                opt.step()
                opt.zero_grad()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                unsharded = backward_window(path, model, opt, 1)
                if path != "ours":
                    opt.step()
                    opt.zero_grad()
            peak = common.profiled_peak(prof)
        inner = opt.optimizer if path == "ours" else opt
        state = _bytes(
            t._local_tensor if hasattr(t, "_local_tensor") else t for s in inner.state.values() for t in s.values()
        )
        times = []
        for w in range(2, 2 + cfg["warmup"] + cfg["reps"]):
            dist.barrier()
            common.synchronize(device)
            t0 = time.perf_counter()
            backward_window(path, model, opt, w)
            if path != "ours":
                opt.step()
                opt.zero_grad()
            common.synchronize(device)
            if w >= 2 + cfg["warmup"]:
                times.append(time.perf_counter() - t0)
        rows.append(
            {
                "path": path,
                "world": world,
                "n_micro": n_micro,
                "params": sum(p.numel() for p in model.parameters()),
                "window_ms": statistics.median(times) * 1e3,
                "payload_mib": sum(counter.payload.values()) / 2**20,
                "sent_mib": counter.sent_bytes(world) / 2**20,
                "collectives": dict(counter.calls),
                "peak_mib_per_rank": peak / 2**20,
                "state_mib_per_rank": state / 2**20,
                "buffers_mib_per_rank": (opt._layout.flat.numel() * 4 if path == "ours" else 0) / 2**20,
                "unsharded_grad_mib_per_rank": unsharded / 2**20,
                "grad_rel_error_vs_float64": error,
            }
        )
        del model, opt
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()
    exit_skipping_teardown(0)


def _fsdp_params(model):
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                yield from group.fsdp_params


TABLE = [
    ("path", "path", "s"),
    ("window_ms", "ms/window", ".1f"),
    ("sent_mib", "sent MiB/rank (ring)", ".2f"),
    ("peak_mib_per_rank", "peak MiB/rank", ".1f"),
    ("state_mib_per_rank", "opt state MiB/rank", ".2f"),
    ("buffers_mib_per_rank", "fp32 buffers MiB/rank", ".2f"),
    ("unsharded_grad_mib_per_rank", "unsharded grad MiB/rank", ".2f"),
    ("grad_rel_error_vs_float64", "grad error vs float64", ".1e"),
]


def main(argv=None) -> int:
    return common.ranks_main(argv, __doc__, "fsdp", "FSDP2 benchmark", _worker, TABLE)


if __name__ == "__main__":
    raise SystemExit(main())

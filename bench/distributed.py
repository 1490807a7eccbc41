"""Distributed accumulation: AccumulatingOptimizer against DDP with no_sync().

`python -m bench.distributed [--quick]` spawns W processes (default 2; NCCL on
W GPUs if there are that many, else gloo on the CPU) that train the repo's
GPT-style model (bf16 params, AdamW) for windows of N micro-batches, on the same
data, along five paths:

- ``ddp-no_sync``: what users write today: ``DistributedDataParallel``, the
  loss divided by N, ``no_sync()`` on the first N-1 micro-batches (bf16 ``.grad``
  accumulation), ``step()``, ``zero_grad()``;
- ``ours-allreduce``, ``ours-sharded``, ``ours-allreduce-bf16wire``: the wrapper
  counting the window (``accum_steps=N``: one reduction per window);
- ``ours-each-backward``: torch's own loop on the plain module (the loss divided
  by N, N backwards, ``step()``, ``zero_grad()``) with the wrapper's defaults
  (``accum_steps=None``): without DDP to say which backward ends the window,
  each backward ends with the reduction, as DDP's does outside ``no_sync()``.

Correctness first: fp32 copies of the model take one SGD window with lr = 1
from the same weights, so each path's update is minus its global mean
gradient; each is compared with ours-allreduce's. Then per path: the
median time per window (rank 0, interleaved rounds, a barrier before each
window), the payload handed to collectives per window and rank (DDP: counted by
a comm hook; ours: by wrapping the torch.distributed calls) with the bytes each
rank sends under the ring model (all-reduce 2(W-1)/W of the payload,
reduce-scatter, all-gather and all-to-all (W-1)/W), and the optimizer state per
rank.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from accumkernels.testing import GPT, CollectiveCounter, exit_skipping_teardown

from . import common

# The wrapper's paths and the options that make them.
OURS = {
    "ours-allreduce": {},
    "ours-sharded": {"sharded": True},
    "ours-allreduce-bf16wire": {"wire_dtype": torch.bfloat16},
}


def _micro_batch(window: int, rank: int, micro: int, batch: int, ctx: int, device):
    g = torch.Generator().manual_seed(window * 1000 + rank * 100 + micro)
    tokens = torch.randint(0, 256, (batch, ctx + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _state_mib(opt) -> float:
    return (
        sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)) / 2**20
    )


def _worker(rank: int, world: int, init_file: str, cfg: dict, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import accumkernels as ak

    device = common.init_rank(rank, world, init_file, cfg)
    n_micro, batch, ctx = cfg["n_micro"], cfg["micro_batch"], cfg["ctx"]

    def new_model(dtype):
        """The same initial weights for every path."""
        torch.manual_seed(0)
        return GPT(d=cfg["d"], layers=cfg["layers"], heads=4, ctx=ctx).to(device, dtype)

    def make_paths(dtype, make_opt):
        """path -> (model, window(w), optimizer, counter of window 0's collectives)."""
        paths = {}
        model = new_model(dtype)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp_counter = CollectiveCounter()  # filled by the hook: DDP's reducer calls no Python collective

        def counting_hook(state, bucket):  # DDP's default all-reduce, counted
            if state["window"] == 0:
                ddp_counter.calls["all_reduce"] += 1
                ddp_counter.payload["all_reduce"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return default_hooks.allreduce_hook(None, bucket)

        hook_state = {"window": 0}
        ddp.register_comm_hook(hook_state, counting_hook)
        opt = make_opt(model.parameters())

        def ddp_window(w):
            hook_state["window"] = w
            for m in range(n_micro):
                x, y = _micro_batch(w, rank, m, batch, ctx, device)
                if m < n_micro - 1:
                    with ddp.no_sync():
                        (_ddp_loss(ddp, x, y) / n_micro).backward()
                else:
                    (_ddp_loss(ddp, x, y) / n_micro).backward()
            opt.step()
            opt.zero_grad()

        paths["ddp-no_sync"] = [model, ddp_window, opt, ddp_counter]
        for path, kwargs in OURS.items():
            model = new_model(dtype)
            wrapper = ak.AccumulatingOptimizer(make_opt(model.parameters()), accum_steps=n_micro, **kwargs)

            def window(w, model=model, wrapper=wrapper):
                for m in range(n_micro):
                    x, y = _micro_batch(w, rank, m, batch, ctx, device)
                    model.loss(x, y).backward()
                    wrapper.step()
                    wrapper.zero_grad()

            paths[path] = [model, window, wrapper, None]
        model = new_model(dtype)
        wrapper = ak.AccumulatingOptimizer(make_opt(model.parameters()))

        def each_backward_window(w, model=model, wrapper=wrapper):
            for m in range(n_micro):
                x, y = _micro_batch(w, rank, m, batch, ctx, device)
                (model.loss(x, y) / n_micro).backward()
            wrapper.step()
            wrapper.zero_grad()

        paths["ours-each-backward"] = [model, each_backward_window, wrapper, None]
        for path, entry in paths.items():  # window 0, counting our collectives
            if path == "ddp-no_sync":
                entry[1](0)
            else:
                with CollectiveCounter() as entry[3]:
                    entry[1](0)
        return paths

    # Correctness first: fp32 copies, SGD with lr=1 for one window, so each
    # path's param change is minus its global mean gradient; compared with ours-allreduce.
    check = make_paths(torch.float32, lambda params: torch.optim.SGD(params, lr=1.0))
    initial = [p.detach().double().cpu() for p in new_model(torch.float32).parameters()]
    base = [p.detach().double().cpu() - i for p, i in zip(check["ours-allreduce"][0].parameters(), initial)]
    agree = {}
    for path, (model, *_rest) in check.items():
        delta = [p.detach().double().cpu() - i for p, i in zip(model.parameters(), initial)]
        err = sum(((d - b) ** 2).sum() for d, b in zip(delta, base)).sqrt() / sum((b**2).sum() for b in base).sqrt()
        agree[path] = err.item()
    del check

    runs = make_paths(torch.bfloat16, lambda params: torch.optim.AdamW(params, lr=1e-3))
    times = {path: [] for path in runs}
    for w in range(1, 1 + cfg["warmup"] + cfg["reps"]):
        for path, (_model, window, *_rest) in runs.items():
            dist.barrier()
            common.synchronize(device)
            t0 = time.perf_counter()
            window(w)
            common.synchronize(device)
            if w > cfg["warmup"]:
                times[path].append(time.perf_counter() - t0)
    if rank == 0:
        rows = []
        for path, (model, _window, opt_, counter) in runs.items():
            rows.append(
                {
                    "path": path,
                    "world": world,
                    "n_micro": n_micro,
                    "params": sum(p.numel() for p in model.parameters()),
                    "window_ms": statistics.median(times[path]) * 1e3,
                    "payload_mib": sum(counter.payload.values()) / 2**20,
                    "sent_mib": counter.sent_bytes(world) / 2**20,
                    "collectives": dict(counter.calls),
                    "state_mib_per_rank": _state_mib(opt_),
                    "update_rel_error_vs_ours_allreduce": agree[path],
                }
            )
        torch.save(rows, out)
    dist.barrier()  # every rank past its last collective before any leaves
    dist.destroy_process_group()
    exit_skipping_teardown(0)


def _ddp_loss(ddp, x, y):
    """GPT.loss through DDP's forward (which arms its reducer)."""
    logits = ddp(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


TABLE = [
    ("path", "path", "s"),
    ("window_ms", "ms/window", ".1f"),
    ("payload_mib", "payload MiB", ".2f"),
    ("sent_mib", "sent MiB (ring)", ".2f"),
    ("state_mib_per_rank", "opt state MiB/rank", ".2f"),
    ("update_rel_error_vs_ours_allreduce", "update vs ours-allreduce", ".1e"),
]


def main(argv=None) -> int:
    return common.ranks_main(argv, __doc__, "distributed", "distributed benchmark", _worker, TABLE)


if __name__ == "__main__":
    raise SystemExit(main())

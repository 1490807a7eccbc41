"""The process side of tests/test_distributed.py: scenarios run by every rank of
a gloo group (torch.multiprocessing.spawn), each returning what the test checks.

Every rank draws its own micro-batches from a generator seeded by (seed, window,
rank, micro-step); the runs return their params after every window, and the
tests check each window's step against the exact one from the same params on
all W*N micro-batches' gradients (window_gradients; tests/helpers.py).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os

import torch
import torch.distributed as dist
from helpers import gradients_at
from torch import nn
from torch.nn import functional as F

import accumkernels as ak
from accumkernels.testing import CollectiveCounter, exit_skipping_teardown

ADAM_EPS = 1e-4  # see tests/test_optimizer.py: keeps Adam's noise-level elements below 1e-5
N_MICRO = 3
WINDOWS = 3
BUCKET_MB = 0.0005  # ~500 bytes: the toy model spans several buckets


class Net(nn.Module):
    """An MLP with LayerNorm, plus a head only odd ranks use: the params that get
    a gradient differ between ranks. The head comes first, so its params land
    in the last bucket (buckets run in reverse param order)."""

    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.side = nn.Linear(12, 3)
        self.body = nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3))
        self.to(dtype)

    def forward(self, x, use_side: bool):
        out = self.body(x.to(self.side.weight.dtype))
        if use_side:
            out = out + self.side(x.to(self.side.weight.dtype))
        return out

    def loss(self, x, y, use_side: bool, reduction: str = "mean"):
        return F.mse_loss(self(x, use_side).float(), y, reduction=reduction)


def micro_batch(seed: int, window: int, rank: int, micro: int, varying: bool):
    g = torch.Generator().manual_seed(seed * 1_000_003 + window * 10_007 + rank * 101 + micro)
    n = int(torch.randint(2, 9, (1,), generator=g)) if varying else 4
    return torch.randn(n, 12, generator=g), torch.randn(n, 3, generator=g)


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=ADAM_EPS)


def window_gradients(cfg, world: int, loss_divisor: int = 1):
    """For tests/helpers.py's assert_windows_within_bound: window w's
    micro-batch gradients on every rank at the given params, each as a rank
    computes it (its loss, mean or sum-reduced, divided by ``loss_divisor`` as
    a loop that divides it does), and the divisor of their sum (the wrapper's
    normalization: ranks x micro-steps, the items, or DDP's mean over ranks)."""
    items = cfg.get("normalize") == "items"

    def gradients(w: int, params: list[torch.Tensor]):
        batches = [(r, *micro_batch(cfg["seed"], w, r, m, items)) for r in range(world) for m in range(N_MICRO)]
        reduction = "sum" if items else "mean"
        losses = [
            lambda model, r=r, x=x, y=y: model.loss(x, y, r % 2 == 1, reduction=reduction) / loss_divisor
            for r, x, y in batches
        ]
        divisor = sum(y.numel() for _, _, y in batches) if items else world * N_MICRO // loss_divisor
        return gradients_at(Net(), params, losses), divisor

    return gradients


def wrapped(cfg, model):
    return ak.AccumulatingOptimizer(
        make_optimizer(cfg["optimizer"], model.parameters()),
        accum_steps=N_MICRO,
        intake=cfg.get("intake"),
        normalize=cfg.get("normalize", "mean"),
        max_grad_norm=cfg.get("clip"),
        master_weights=cfg.get("master_weights", False),
        skip_nonfinite=cfg.get("skip_nonfinite", False),
        grad_scaler=cfg.get("scaler"),
        bucket_cap_mb=BUCKET_MB,
        backend=cfg["backend"],
        sharded=cfg.get("sharded", False),
        wire_dtype=cfg.get("wire_dtype", torch.float32),
        state_dtype=cfg.get("state_dtype"),
    )


def micro_step(cfg, model, opt, w, m, rank, poison=False, counters=None):
    """One micro-batch: forward, backward, step (``counters``: a CollectiveCounter
    for the backward and one for the step)."""
    backward_counter, step_counter = counters or (CollectiveCounter(), CollectiveCounter())
    items = cfg.get("normalize") == "items"
    x, y = micro_batch(cfg["seed"], w, rank, m, items)
    loss = model.loss(x, y, rank % 2 == 1, reduction="sum" if items else "mean")
    if poison:
        loss = loss * float("inf")
    scaler = cfg.get("scaler")
    with backward_counter:
        (scaler.scale(loss) if scaler else loss).backward()
    with step_counter:
        _step(cfg, opt, y, items)
    opt.zero_grad()


def _step(cfg, opt, y, items):
    scaler = cfg.get("scaler")
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step(num_items=y.numel() if items else None)


def params_of(model):
    return [p.detach().float().clone() for p in model.parameters()]


def parity(cfg, rank, world):
    """W ranks x N micro-steps against one process with the W*N micro-batches."""
    model = Net()
    opt = wrapped(cfg, model)
    trajectory = [params_of(model)]
    for w in range(WINDOWS):
        for m in range(N_MICRO):
            micro_step(cfg, model, opt, w, m, rank)
        trajectory.append(params_of(model))
    return {"params": trajectory[-1], "trajectory": trajectory, "buckets": len(opt._layout.buckets)}


def count(cfg, rank, world):
    """Collectives issued by each micro-step of two windows, and how many of them
    were launched during the backward."""
    model = Net()
    opt = wrapped(cfg, model)
    per_micro, in_backward = [], []
    for w in range(2):
        for m in range(N_MICRO):
            counters = CollectiveCounter(), CollectiveCounter()
            micro_step(cfg, model, opt, w, m, rank, counters=counters)
            per_micro.append(dict(counters[0].calls + counters[1].calls))
            in_backward.append(counters[0].total())
    side = {id(p) for p in model.side.parameters()}
    side_buckets = sum(any(id(r.param) in side for r in b.records) for b in opt._layout.buckets)
    return {
        "per_micro": per_micro,
        "in_backward": in_backward,
        "buckets": len(opt._layout.buckets),
        "side_buckets": side_buckets,
    }


def inf_skip(cfg, rank, world):
    """Rank 1 poisons one micro-batch of window 1: every rank skips that window."""
    model = Net()
    opt = wrapped(cfg, model)
    after = []
    for w in range(3):
        for m in range(N_MICRO):
            micro_step(cfg, model, opt, w, m, rank, poison=(w == 1 and m == 1 and rank == 1))
        after.append(params_of(model))
    scaler = cfg.get("scaler")
    return {"after": after, "scale": None if scaler is None else float(scaler.get_scale())}


def resume(cfg, rank, world):
    """Checkpoint mid-window (window 1, after micro-step 1), run on; then load the
    checkpoint into a fresh model and wrapper and run the same steps."""
    model = Net(cfg.get("dtype", torch.float32))
    opt = wrapped(cfg, model)
    saved = None
    for w in range(WINDOWS):
        for m in range(N_MICRO):
            micro_step(cfg, model, opt, w, m, rank)
            if (w, m) == (1, 1):
                saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    straight = params_of(model)

    model = Net(cfg.get("dtype", torch.float32))
    opt = wrapped(cfg, model)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    for w in range(1, WINDOWS):
        for m in range(2 if w == 1 else 0, N_MICRO):
            micro_step(cfg, model, opt, w, m, rank)
    return {
        "straight": straight,
        "resumed": params_of(model),
        "micro_steps_saved": saved[1]["accumkernels"]["micro_steps"],
    }


def _count_reducer_calls(ddp, calls: list) -> None:
    """A probe on DDP's reducer: ``calls[0]`` counts the buckets it would send.
    Registered on the reducer itself, not through ddp.register_comm_hook (a
    user's hook, which the wrapper refuses: it would never run)."""

    def hook(state, bucket):
        calls[0] += 1
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    dist._register_comm_hook(ddp.reducer, None, hook)


def ddp_and_wrapper(cfg, model, order: str):
    """DDP over ``model`` and the wrapper over its params, built in ``order``:
    "ddp-first", or "optimizer-first" (as Accelerate and HF Trainer do)."""
    if order == "ddp-first":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, wrapped(cfg, model)
    opt = wrapped(cfg, model)
    return torch.nn.parallel.DistributedDataParallel(model), opt


def ddp_taken_over(cfg, rank, world):
    """A DistributedDataParallel model in the wrapper's own loop, wrapped in
    DDP before the optimizer or after it (as Accelerate does): the wrapper
    takes DDP's communication over (a comm hook counts what DDP's reducer would
    send: nothing), and each window steps on all ranks' micro-batches."""
    out = {}
    for order in ("ddp-first", "optimizer-first"):
        model = Net()
        trajectory = [params_of(model)]
        ddp, opt = ddp_and_wrapper(cfg, model, order)
        calls = [0]
        _count_reducer_calls(ddp, calls)
        for w in range(WINDOWS):
            for m in range(N_MICRO):
                x, y = micro_batch(cfg["seed"], w, rank, m, False)
                F.mse_loss(ddp(x, rank % 2 == 1).float(), y).backward()
                opt.step()
                opt.zero_grad()
            trajectory.append(params_of(model))
        out[order] = {"params": trajectory[-1], "trajectory": trajectory, "ddp_calls": calls[0]}
    return out


def framework_loop(cfg, rank, world):
    """What Accelerate and HF Trainer do on several processes: DDP built after
    the optimizer, no_sync() on all micro-steps but the window's last, the
    loss divided by N, torch's clip_grad_norm_ on the model's .grad, then
    step(): with the wrapper's default intake for accum_steps=None ("grad"),
    .grad holds the window's gradient averaged over ranks after the last
    backward, so the clip sees the global norm. ``cfg["ddp_kwargs"]``: DDP's
    (gradient_as_bucket_view=True makes .grad views of DDP's buckets when DDP
    is built: the wrapper takes them back at its first forward).
    ``cfg["ddp"] = False``: the same loop on the plain module, where each
    backward ends with the reduction (as DDP's without no_sync())."""
    model = Net()
    opt = ak.AccumulatingOptimizer(
        make_optimizer(cfg["optimizer"], model.parameters()), bucket_cap_mb=BUCKET_MB, backend=cfg["backend"]
    )
    calls = [0]
    ddp = None
    if cfg.get("ddp", True):
        ddp = torch.nn.parallel.DistributedDataParallel(model, **cfg.get("ddp_kwargs", {}))
        _count_reducer_calls(ddp, calls)
    norms, trajectory = [], [params_of(model)]
    for w in range(WINDOWS):
        for m in range(N_MICRO):
            x, y = micro_batch(cfg["seed"], w, rank, m, False)
            with ddp.no_sync() if ddp is not None and m < N_MICRO - 1 else contextlib.nullcontext():
                (F.mse_loss((ddp or model)(x, rank % 2 == 1).float(), y) / N_MICRO).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])))
        opt.step()
        opt.zero_grad()
        trajectory.append(params_of(model))
    return {
        "params": trajectory[-1],
        "trajectory": trajectory,
        "ddp_calls": calls[0],
        "norms": norms,
        "intake": opt.intake,
    }


def modes_agree(cfg, rank, world):
    """bf16 params with an fp32 LayerNorm (buckets of one dtype gather in it,
    mixed ones in fp32), master weights: all-reduce and sharded mode step the
    same elements with the same math on the same sums."""
    out = {}
    for sharded in (False, True):
        model = Net(torch.bfloat16)
        model.body[1].float()
        opt = wrapped(dict(cfg, sharded=sharded, master_weights=True), model)
        for w in range(WINDOWS):
            for m in range(N_MICRO):
                micro_step(cfg, model, opt, w, m, rank)
        out["sharded" if sharded else "allreduce"] = params_of(model)
        out["gather_dtypes"] = sorted({str(b.gather_dtype) for b in opt._layout.buckets})
    return out


def add_group(cfg, rank, world):
    """add_param_group by every rank after the first window (all-reduce mode):
    bit for bit the run that held the group from the start, its layer frozen
    until then (only odd ranks give it gradients: the ranks' union steps it);
    and refused with sharded=True, the groups left as they were."""
    out = {}
    for late in (False, True):
        model = Net()
        model.side.requires_grad_(False)
        side, body = list(model.side.parameters()), list(model.body.parameters())
        groups = [{"params": body}] + ([] if late else [{"params": side, "lr": 3e-3}])
        opt = ak.AccumulatingOptimizer(
            make_optimizer(cfg["optimizer"], groups), N_MICRO, bucket_cap_mb=BUCKET_MB, backend=cfg["backend"]
        )
        for w in range(WINDOWS):
            if w == 1:
                model.side.requires_grad_(True)
                if late:
                    opt.add_param_group({"params": side, "lr": 3e-3})
            for m in range(N_MICRO):
                micro_step(cfg, model, opt, w, m, rank)
        out["late" if late else "built"] = params_of(model)
        opt.close()
    model = Net()
    opt = wrapped(dict(cfg, sharded=True), model)
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        out["sharded_error"] = None
    except RuntimeError as e:
        out["sharded_error"] = str(e)
    out["sharded_groups"] = len(opt.param_groups)
    return out


def misuse(cfg, rank, world):
    """What the wrapper refuses in the window's last micro-step, after its
    backward has launched the reductions: reading the buffers, zero_grad()
    (which would discard sums being reduced), a second backward (and the
    step() after it, which sees two gradients for a param); and
    clip_grad_norm_() in distributed runs at all. Then, with accum_steps=None
    and a bf16 wire, a second backward after the reduction of the first."""
    model = Net()
    opt = wrapped(cfg, model)
    errors = {}
    for m in range(N_MICRO - 1):
        micro_step(cfg, model, opt, 0, m, rank)
    x, y = micro_batch(cfg["seed"], 0, rank, N_MICRO - 1, False)
    model.loss(x, y, True).backward()
    for name, call in (
        ("state_dict", opt.state_dict),
        ("accumulated_grad", lambda: opt.accumulated_grad(model.side.weight)),
        ("clip_grad_norm_", lambda: opt.clip_grad_norm_(1.0)),
        ("zero_grad", opt.zero_grad),
        ("second_backward", lambda: model.loss(x, y, True).backward()),
    ):
        try:
            call()
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    try:  # the refused second backward left a second gradient for some params: step() refuses too
        opt.step()
        errors["step"] = None
    except RuntimeError as e:
        errors["step"] = str(e)
    micro_steps = opt.micro_steps
    opt.close()
    # accum_steps=None on the plain module (each backward reduced) with a bf16
    # wire, which rounds each rank's contribution once per window: a second backward is refused.
    bf16_wire = ak.AccumulatingOptimizer(
        make_optimizer(cfg["optimizer"], model.parameters()), wire_dtype=torch.bfloat16, backend=cfg["backend"]
    )
    model.loss(x, y, True).backward()
    try:
        model.loss(x, y, True).backward()
        errors["bf16_wire_second_backward"] = None
    except RuntimeError as e:
        errors["bf16_wire_second_backward"] = str(e)
    bf16_wire.close()
    return {"errors": errors, "micro_steps": micro_steps}


def ddp_join(cfg, rank, world):
    """DDP.join() (uneven inputs) with the wrapper built after DDP and before
    it: refused at the first forward inside it, on every rank alike, before
    any collective (the wrapper's reductions have no shadow there)."""
    errors = {}
    for order in ("ddp-first", "optimizer-first"):
        model = Net()
        ddp, opt = ddp_and_wrapper(cfg, model, order)
        try:
            with ddp.join():
                x, y = micro_batch(cfg["seed"], 0, rank, 0, False)
                F.mse_loss(ddp(x, rank % 2 == 1).float(), y).backward()
                opt.step()
            errors[order] = None
        except RuntimeError as e:
            errors[order] = str(e)
        opt.close()
    return errors


def ddp_comm_hook(cfg, rank, world):
    """A comm hook on DDP (a Python one, fp16 compression; a built-in one)
    would never run: refused on every rank alike, before any collective,
    whether DDP and its hook come before the optimizer (at construction),
    after it (at the first forward), or the hook after a window (at its
    registration, nothing stepped or accumulated). (Not bf16_compress_hook:
    torch refuses that one itself without a CUDA build of torch.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def fp16(ddp):
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)

    def fp16_builtin(ddp):
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)

    def train_window(ddp, opt, w):
        for m in range(N_MICRO):
            x, y = micro_batch(cfg["seed"], w, rank, m, False)
            F.mse_loss(ddp(x, rank % 2 == 1).float(), y).backward()
            opt.step()
            opt.zero_grad()

    errors = {}
    for name, register in (("fp16", fp16), ("fp16-builtin", fp16_builtin)):
        model = Net()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        register(ddp)
        try:
            wrapped(cfg, model)
            errors[f"{name}-ddp-first"] = None
        except RuntimeError as e:
            errors[f"{name}-ddp-first"] = str(e)

        model = Net()
        opt = wrapped(cfg, model)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        register(ddp)
        for attempt in ("first", "retried"):  # a caught refusal does not let the next forward through
            try:
                train_window(ddp, opt, 0)
                errors[f"{name}-optimizer-first-{attempt}"] = None
            except RuntimeError as e:
                errors[f"{name}-optimizer-first-{attempt}"] = str(e)
        opt.close()

    model = Net()
    ddp, opt = ddp_and_wrapper(cfg, model, "ddp-first")
    train_window(ddp, opt, 0)
    before, micro_steps = params_of(model), opt.micro_steps
    try:
        fp16(ddp)
        train_window(ddp, opt, 1)
        errors["fp16-after-a-window"] = None
    except RuntimeError as e:
        errors["fp16-after-a-window"] = str(e)
    untouched = all(map(torch.equal, params_of(model), before)) and opt.micro_steps == micro_steps
    opt.close()
    return {"errors": errors, "untouched": untouched}


def zero_redundancy(cfg, rank, world):
    """torch's ZeroRedundancyOptimizer given accumkernels' class: refused at
    its construction on every rank, naming sharded=True, and for the wrapper
    built by a factory; the params are free after it (sharded=True builds
    and steps over them). Two layers that start equal: each rank's share
    (one layer) has the same shapes and values as its peer's, which the
    replica checks pass."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].load_state_dict(model[0].state_dict())
    factories = {
        "class-grad": (ak.AdamW, dict(intake="grad")),
        "class-hooks": (ak.AdamW, dict(intake="hooks")),
        "wrapper": (lambda params, **kw: ak.AccumulatingOptimizer(torch.optim.SGD(params, **kw), accum_steps=2), {}),
    }
    errors = {}
    for name, (factory, kwargs) in factories.items():
        try:
            ZeroRedundancyOptimizer(model.parameters(), optimizer_class=factory, lr=0.01, **kwargs)
            errors[name] = None
        except (ValueError, RuntimeError) as e:  # (RuntimeError: the params still held by an earlier one)
            errors[name] = str(e)
    opt = ak.AdamW(model.parameters(), lr=0.01, sharded=True, accum_steps=1)
    before = params_of(model)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    stepped = not any(map(torch.equal, params_of(model), before))
    opt.close()
    return {"errors": errors, "sharded_steps": stepped}


def dcp(cfg, rank, world):
    """torch.distributed.checkpoint's get/set_optimizer_state_dict at a window
    boundary: in all-reduce mode (bf16 params, fp32 masters) a fresh wrapper
    given the state trains on bit for bit; with sharded=True (ZeRO-1) each
    rank's state is its own shard, which DCP would save once for all ranks:
    the error (opt.state_dict(), per rank, still works)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def run(model, opt, windows):
        for w in windows:
            for m in range(N_MICRO):
                micro_step(cfg, model, opt, w, m, rank)

    options = dict(cfg, dtype=torch.bfloat16, master_weights=True)
    model = Net(torch.bfloat16)
    opt = wrapped(options, model)
    run(model, opt, [0])
    saved = copy.deepcopy((model.state_dict(), get_optimizer_state_dict(model, opt)))
    fresh = Net(torch.bfloat16)
    fresh_opt = wrapped(options, fresh)
    fresh.load_state_dict(saved[0])
    set_optimizer_state_dict(fresh, fresh_opt, saved[1])
    run(model, opt, [1, 2])
    run(fresh, fresh_opt, [1, 2])
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))

    model = Net()
    opt = wrapped(dict(cfg, sharded=True), model)
    run(model, opt, [0])
    try:
        get_optimizer_state_dict(model, opt)
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"same": same, "sharded_error": error, "per_rank": "accumkernels" in opt.state_dict()}


def wire_contribution(seed: int, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s window sum in the wire scenario: magnitudes over many octaves."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)


def wire(cfg, rank, world):
    """One reduction of known contributions over the bf16 wire: this rank's
    buffer after it (sharded: its shard holds the sum) and its shard ranges."""
    model = Net()
    opt = wrapped(cfg, model)
    flat, reducer = opt._layout.flat, opt._sync
    flat.copy_(wire_contribution(cfg["seed"], rank, flat.numel()))
    opt._window.touched = set(range(len(opt._layout)))
    reducer.launch_remaining()
    reducer.finish()
    shards = [opt._layout.shard_of(b, rank, world) for b in opt._layout.buckets] if cfg.get("sharded") else None
    return {"flat": flat.clone(), "shards": shards}


SCENARIOS = {
    "wire": wire,
    "parity": parity,
    "count": count,
    "inf_skip": inf_skip,
    "resume": resume,
    "ddp_taken_over": ddp_taken_over,
    "framework_loop": framework_loop,
    "misuse": misuse,
    "dcp": dcp,
    "zero_redundancy": zero_redundancy,
    "ddp_join": ddp_join,
    "ddp_comm_hook": ddp_comm_hook,
    "add_group": add_group,
    "modes_agree": modes_agree,
}


def join_gloo(rank: int, world: int, init_file: str) -> None:
    """A spawned rank joins the gloo group: one thread (2 cores for all the
    ranks), and a bounded timeout, so that a test that desynchronizes the
    ranks fails instead of hanging CI. Groups made later (dist.new_group,
    init_device_mesh's) take torch's default, 30 minutes, which no argument
    of init_device_mesh sets: the module default they read is set too."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)


def run_cases(rank: int, world: int, init_file: str, out_dir: str, cases: dict, run_case) -> None:
    """A spawned rank: join the gloo group, ``run_case(cfg, rank, world)`` for
    each case (every rank in step), save this rank's results in ``out_dir``."""
    join_gloo(rank, world, init_file)
    try:
        results = {}
        for key, cfg in cases.items():
            results[key] = run_case(dict(cfg), rank, world)
            dist.barrier()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank past its last collective before any leaves
    finally:
        dist.destroy_process_group()
    exit_skipping_teardown(0)  # only on success: an exception above reaches mp.spawn


def _run_case(cfg: dict, rank: int, world: int):
    if cfg.pop("with_scaler", False):
        cfg["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    return SCENARIOS[cfg["scenario"]](cfg, rank, world)


def main(rank: int, world: int, init_file: str, out_dir: str, cases: dict) -> None:
    run_cases(rank, world, init_file, out_dir, cases, _run_case)

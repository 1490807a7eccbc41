"""Scenarios of tests/test_fsdp.py, run on every rank of a gloo process group
(CPU): a model through FSDP2's fully_shard with AccumulatingOptimizer. Each
returns a picklable dict; results go to one file per rank."""

from __future__ import annotations

import copy
import io
import os
import random
import sys

import torch
import torch.distributed as dist
from distributed_worker import join_gloo
from helpers import gradients_at
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional as F

import accumkernels as ak
from accumkernels.testing import exit_skipping_teardown

N_MICRO, WINDOWS, ADAM_EPS = 4, 3, 1e-4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Net(nn.Module):
    """Two blocks (each its own fully_shard unit) and a head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(12 if i == 0 else width, width), nn.LayerNorm(width), nn.GELU()) for i in range(2)
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).float()


def micro_batch(seed, window, rank, micro, varying=False):
    g = torch.Generator().manual_seed(seed * 1_000_003 + window * 10_007 + rank * 101 + micro)
    n = int(torch.randint(2, 9, (1,), generator=g)) if varying else 4
    return torch.randn(n, 12, generator=g) * 3, torch.randn(n, 3, generator=g)


def shard(model, mesh, param_dtype=None, reduce_dtype=None):
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def make_optimizer(params, name="adamw"):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=ADAM_EPS)


def wrapped_model(cfg, mesh, **options):
    model = Net()
    if cfg.get("storage") == "bf16":
        model = model.to(torch.bfloat16)
    shard(model, mesh, DTYPES.get(cfg.get("param_dtype")), DTYPES.get(cfg.get("reduce_dtype")))
    opt = ak.AccumulatingOptimizer(
        make_optimizer(model.parameters(), cfg.get("optimizer", "adamw")),
        accum_steps=N_MICRO,
        backend=cfg["backend"],
        **options,
    )
    return model, opt


def compute_dtype(cfg):
    """The dtype the ranks' forward and backward run in: FSDP2's param_dtype,
    else the sharded params' own."""
    return DTYPES[cfg.get("param_dtype") or cfg.get("storage") or "fp32"]


def window_gradients(cfg, world):
    """For tests/helpers.py's assert_windows_within_bound: window w's
    micro-batch gradients on every rank at the given (full) params, as FSDP2
    computes them on the unsharded params (in bf16 where the policy computes
    in bf16: the params and inputs cast to it, to nearest, as FSDP2 casts
    them), and the divisor of their sum."""
    items = cfg.get("normalize") == "items"
    dtype = compute_dtype(cfg)

    def gradients(w: int, params: list[torch.Tensor]):
        batches = [micro_batch(cfg["seed"], w, r, m, items) for r in range(world) for m in range(N_MICRO)]
        reduction = "sum" if items else "mean"
        losses = [lambda model, x=x, y=y: F.mse_loss(model(x.to(dtype)), y, reduction=reduction) for x, y in batches]
        divisor = sum(y.numel() for _, y in batches) if items else world * N_MICRO
        return gradients_at(Net().to(dtype), params, losses), divisor

    return gradients


def full_params(model):
    return [p.full_tensor().detach().float().clone() for p in model.parameters()]


def train(cfg, model, opt, rank, windows=range(WINDOWS), no_sync=False, poison=None):
    items = cfg.get("normalize") == "items"
    for w in windows:
        for m in range(N_MICRO):
            if no_sync:
                model.set_requires_gradient_sync(m == N_MICRO - 1)
            x, y = micro_batch(cfg["seed"], w, rank, m, items)
            out = model(x.to(next(model.parameters()).dtype))
            loss = F.mse_loss(out, y, reduction="sum" if items else "mean")
            if poison == (w, m, rank):
                loss = loss * float("inf")
            loss.backward()
            opt.step(num_items=y.numel() if items else None)
            opt.zero_grad()


def parity(cfg, rank, world, mesh):
    """W ranks x N micro-steps against one process with the W*N micro-batches."""
    model, opt = wrapped_model(cfg, mesh, max_grad_norm=cfg.get("clip"), normalize=cfg.get("normalize", "mean"))
    trajectory = [full_params(model)]
    for w in range(WINDOWS):
        train(cfg, model, opt, rank, windows=[w], no_sync=cfg.get("no_sync", False))
        trajectory.append(full_params(model))
    return {"params": trajectory[-1], "trajectory": trajectory}


def _shard_recorder(model, sums):
    """A hook before the wrapper's on every sharded param: the float64 sum of
    the shards FSDP2 hands over, micro-step by micro-step. (It reads ``.grad``
    where FSDP2 assigned the shard to it: ``.grad`` was None at the reduce.)"""
    for i, p in enumerate(model.parameters()):

        def record(param, i=i):
            if param.grad is not None:
                g = param.grad._local_tensor.double()
                sums[i] = g.clone() if i not in sums else sums[i] + g

        p.register_post_accumulate_grad_hook(record)


def bf16_shards(cfg, rank, world, mesh):
    """bf16 sharded params: the window gradient the wrapper steps with against
    the float64 sum of the same shards, next to FSDP2's own accumulation of
    them in bf16 .grad (plain AdamW, no wrapper). Both runs get the same
    shards (no param changes): they are recorded in the wrapper's run, where
    model.zero_grad() after each micro-step's step() leaves .grad None, so
    FSDP2 assigns each shard to it rather than adding it into the marker."""
    errors, sums = {}, {}
    for path in ("ours", "plain"):
        model = shard(Net().to(torch.bfloat16), mesh, reduce_dtype=torch.float32)
        if path == "ours":
            _shard_recorder(model, sums)
        params = list(model.parameters())
        opt = (
            ak.AccumulatingOptimizer(make_optimizer(params), accum_steps=N_MICRO, backend=cfg["backend"])
            if path == "ours"
            else None
        )
        for m in range(N_MICRO):
            x, y = micro_batch(cfg["seed"], 0, rank, m)
            F.mse_loss(model(x.bfloat16()), y).backward()
            if m < N_MICRO - 1 and opt is not None:
                opt.step()
                model.zero_grad()  # (after step(): harmless in a counted window)
        got = [opt.accumulated_grad(p) * N_MICRO if opt is not None else p.grad._local_tensor.double() for p in params]
        num = sum(((g.double() - sums[i]) ** 2).sum() for i, g in enumerate(got))
        den = sum((s**2).sum() for s in sums.values())
        errors[path] = (num / den).sqrt().item()
    return errors


def inf_skip(cfg, rank, world, mesh):
    """An inf on rank 1 skips the window on every rank."""
    model, opt = wrapped_model(cfg, mesh, skip_nonfinite=True)
    before = full_params(model)
    train(cfg, model, opt, rank, windows=[0], poison=(0, 2, 1))
    skipped = all(torch.equal(a, b) for a, b in zip(full_params(model), before))
    train(cfg, model, opt, rank, windows=[1])
    return {"skipped": skipped, "moved": not all(torch.equal(a, b) for a, b in zip(full_params(model), before))}


def resume(cfg, rank, world, mesh):
    """Stop mid-window (after window 0 and two micro-steps of window 1), save
    per rank, load into fresh objects: the rest is bitwise the same."""
    options = dict(max_grad_norm=0.5, **cfg.get("options", {}))
    straight, straight_opt = wrapped_model(cfg, mesh, seed=7, **options)
    train(cfg, straight, straight_opt, rank, windows=range(WINDOWS))

    first, first_opt = wrapped_model(cfg, mesh, seed=7, **options)
    train(cfg, first, first_opt, rank, windows=[0])
    for m in range(2):
        x, y = micro_batch(cfg["seed"], 1, rank, m)
        F.mse_loss(first(x.to(next(first.parameters()).dtype)), y).backward()
        first_opt.step()
    blob = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    resumed, resumed_opt = wrapped_model(cfg, mesh, seed=99, **options)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    assert resumed_opt.micro_steps == 2
    for m in range(2, N_MICRO):
        x, y = micro_batch(cfg["seed"], 1, rank, m)
        F.mse_loss(resumed(x.to(next(resumed.parameters()).dtype)), y).backward()
        resumed_opt.step()
    train(cfg, resumed, resumed_opt, rank, windows=range(2, WINDOWS))
    return {"same": all(torch.equal(a, b) for a, b in zip(full_params(straight), full_params(resumed)))}


def dcp_round_trip(cfg, rank, world, mesh):
    """torch.distributed.checkpoint: the optimizer state dict of
    get_optimizer_state_dict, saved with dcp.save and loaded with dcp.load and
    set_optimizer_state_dict into a fresh model and wrapper, at a window
    boundary (refused mid-window, where it would drop the window's gradients);
    with cfg["full_state_dict"], the state gathered whole and handed over."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = cfg.get("options", {})
    model, opt = wrapped_model(cfg, mesh, **options)
    empty = get_optimizer_state_dict(model, opt)  # DCP calls step() to create the state: no micro-step counted
    assert opt.micro_steps == 0 and all(float(s["step"]) == 0 for s in empty["state"].values())
    train(cfg, model, opt, rank, windows=[0])
    dtype = next(model.parameters()).dtype
    x, y = micro_batch(cfg["seed"], 1, rank, 0)
    F.mse_loss(model(x.to(dtype)), y).backward()
    opt.step()
    try:
        get_optimizer_state_dict(model, opt)
        refused = False
    except RuntimeError as e:
        refused = "window" in str(e)
    for m in range(1, N_MICRO):
        x, y = micro_batch(cfg["seed"], 1, rank, m)
        F.mse_loss(model(x.to(dtype)), y).backward()
        opt.step()
    fresh, fresh_opt = wrapped_model(cfg, mesh, **options)
    if cfg.get("full_state_dict"):  # gathered whole on every rank, handed over in memory
        full = StateDictOptions(full_state_dict=True)
        state = copy.deepcopy(
            {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt, options=full)}
        )
        fresh.load_state_dict(state["model"])
        set_optimizer_state_dict(fresh, fresh_opt, state["optim"], options=full)
    else:
        folder = os.path.join(cfg["tmp"], "dcp")  # one per case (main)
        dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=folder)
        state = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
        dcp.load(state, checkpoint_id=folder)
        fresh.load_state_dict(state["model"])
        set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    train(cfg, model, opt, rank, windows=[2])
    train(cfg, fresh, fresh_opt, rank, windows=[2])
    same = all(torch.equal(a, b) for a, b in zip(full_params(model), full_params(fresh)))
    return {"refused_mid_window": refused, "same": same}


def dcp_8bit_save(cfg, rank, world, mesh):
    """8-bit state after one window, saved with torch.distributed.checkpoint
    into cfg["shared"] (read by dcp_8bit_other_world, at another world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = wrapped_model(cfg, mesh, state_dtype="8bit")
    train(cfg, model, opt, rank, windows=[0])
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=cfg["shared"])
    return {"saved": True}


def dcp_8bit_other_world(cfg, rank, world, mesh):
    """Loading that checkpoint at this world size fails loudly (the scales'
    (W, blocks) shape differs), instead of resharding scales that follow the
    saved ranks' shards; returns the error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, opt = wrapped_model(cfg, mesh, state_dtype="8bit")
    state = {"optim": get_optimizer_state_dict(model, opt)}
    try:
        dcp.load(state, checkpoint_id=cfg["shared"])
        set_optimizer_state_dict(model, opt, state["optim"])
    # DCP's CheckpointException is a BaseException; ours would be a ValueError
    except (CheckpointException, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def buffer_bytes(cfg, rank, world, mesh):
    """The memory the wrapper's construction leaves allocated on this rank (its
    buffers), measured by torch's profiler (every allocation and free of the
    CPU allocator), against the model's size in fp32."""
    width = 1024
    model = Net(width)
    shard(model, mesh)
    full = sum(p.numel() for p in model.parameters()) * 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        opt = ak.AccumulatingOptimizer(
            make_optimizer(model.parameters()), accum_steps=N_MICRO, backend=cfg["backend"], seed=0
        )
    allocated = sum(e.self_cpu_memory_usage for e in prof.events())
    # Each bucket holds the params of one fully_shard module: folded as soon as
    # that module's reduce-scatter hands its shards over.
    modules = {
        id(p): name for name, m in (("block0", model.blocks[0]), ("block1", model.blocks[1])) for p in m.parameters()
    }
    buckets = [sorted({modules.get(id(r.param), "root") for r in b.records}) for b in opt._layout.buckets]
    return {"allocated": allocated, "full_fp32": full, "flat": opt._layout.flat.numel() * 4, "buckets": buckets}


# Loops of test_contract's calls whose outcome is known (test_torch_optim_loops_on_fsdp2).
TORCH_LOOPS = {
    "clip after backward": (["backward", "norm", "step"], "refused"),
    "no clear between steps": (["backward", "step", "backward", "step"], "refused"),
    "model.zero_grad() before step()": (["backward", "model.zero_grad", "step"], "refused"),
    "model.zero_grad() between backwards": (["backward", "model.zero_grad", "backward", "step"], "refused"),
    "cleared each window": (["backward", "step", "zero_grad", "backward", "backward", "step"], "torch"),
    "kept as zeros": (["backward", "step", "zero_grad(False)", "step", "step"], "torch"),
    "kept as zeros, one dropped": (["backward", "step", "zero_grad(False)", "p0 = None", "step"], "torch"),
    "assigned before backward": (["p2 = 0.5", "backward", "step"], "torch"),
    "model.zero_grad() after step()": (["backward", "step", "model.zero_grad", "backward", "step"], "torch"),
    "cleared in place after step()": (
        ["backward", "step", "model.zero_grad(False)", "step", "p0.zero_()", "step"],
        "torch",
    ),
    "scaled in place": (["backward", "grads /= 4", "backward", "grads /= 4", "step"], "torch"),
    # the shards FSDP2 reduced during the backward are this rank's own: discarded, as torch's .grad
    "zero_grad() between a backward and step()": (["backward", "zero_grad", "backward", "step"], "torch"),
    "zero_grad(False) between a backward and step()": (
        ["backward", "step", "zero_grad", "backward", "zero_grad(False)", "step", "backward", "step"],
        "torch",
    ),
}


def torch_loops(cfg, rank, world, mesh):
    """test_contract's torch.optim loops (its _apply's calls) on an FSDP2
    model, under the wrapper (accum_steps=None, intake "hooks") and plain
    torch.optim AdamW on an FSDP2 copy: TORCH_LOOPS and 24 random ones (from
    the worker's seed). Per loop: ("torch", the largest of the params'
    differences over test_contract's bound (8 ulps of the param's largest
    value per step), the norms' largest relative difference, whether as many
    were logged) or ("refused", the message, whether any param changed
    before the refusal)."""
    from test_contract import FUZZ_OPS, _apply, _mlp

    rng = random.Random(cfg["seed"])
    loops = {name: ops for name, (ops, _) in TORCH_LOOPS.items()}
    for i in range(24):
        loops[f"random {i}"] = [rng.choice(FUZZ_OPS) for _ in range(rng.randint(3, 10))] + ["step"]
    outcomes = {}
    for name, ops in loops.items():
        ours, plain = fully_shard(_mlp(), mesh=mesh), fully_shard(_mlp(), mesh=mesh)
        opt = ak.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, intake="hooks", backend=cfg["backend"])
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
        gens = [torch.Generator().manual_seed(cfg["seed"] + rank) for _ in range(2)]
        norms, plain_norms = [], []
        for op in ops:
            before = full_params(ours)
            try:
                _apply(op, ours, opt, gens[0], norms)
            except RuntimeError as e:
                changed = not all(torch.equal(a, b) for a, b in zip(full_params(ours), before))
                outcomes[name] = ("refused", str(e), changed)
                break
            _apply(op, plain, plain_opt, gens[1], plain_norms)
        else:
            ulps = 8 * ops.count("step") * torch.finfo(torch.float32).eps
            worst = max(
                ((x - y).abs().max() / (ulps * y.abs().max() + 1e-30)).item()
                for x, y in zip(full_params(ours), full_params(plain))
            )
            rel = max((abs(x - y) / abs(y) for x, y in zip(norms, plain_norms) if y), default=0.0)
            outcomes[name] = ("torch", worst, rel, len(norms) == len(plain_norms))
        opt.close()
    return outcomes


def refusals(cfg, rank, world, mesh):
    """What is not supported is refused, with the reason: at construction, and
    add_param_group after it."""
    errors = {}
    model = shard(Net(), mesh)

    def attempt(name, make):
        try:
            make()
            errors[name] = None
        except (ValueError, RuntimeError) as e:
            errors[name] = str(e)

    attempt("sharded", lambda: ak.AccumulatingOptimizer(make_optimizer(model.parameters()), 4, sharded=True))
    attempt(
        "process_group",
        lambda: ak.AccumulatingOptimizer(make_optimizer(model.parameters()), 4, process_group=dist.group.WORLD),
    )
    attempt("grad_intake", lambda: ak.AccumulatingOptimizer(make_optimizer(model.parameters())))
    plain = nn.Linear(3, 3)
    attempt(
        "mixed",
        lambda: ak.AccumulatingOptimizer(make_optimizer(list(model.parameters()) + list(plain.parameters())), 4),
    )
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    hsdp = Net()
    fully_shard(hsdp, mesh=mesh2)
    attempt("hsdp", lambda: ak.AccumulatingOptimizer(make_optimizer(hsdp.parameters()), 4))
    other_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))
    two = Net()
    fully_shard(two.blocks[0], mesh=other_mesh)
    fully_shard(two, mesh=mesh)
    attempt("two_meshes", lambda: ak.AccumulatingOptimizer(make_optimizer(two.parameters()), 4))
    # After construction: add_param_group (not on FSDP2 params), the groups left as they were.
    opt = ak.AccumulatingOptimizer(make_optimizer(shard(Net(), mesh).parameters()), 4)
    groups = len(opt.param_groups)
    attempt("add_param_group", lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]}))
    errors["groups_kept"] = len(opt.param_groups) == groups
    return errors


SCENARIOS = {
    "parity": parity,
    "bf16_shards": bf16_shards,
    "inf_skip": inf_skip,
    "resume": resume,
    "dcp_round_trip": dcp_round_trip,
    "dcp_8bit_save": dcp_8bit_save,
    "dcp_8bit_other_world": dcp_8bit_other_world,
    "buffer_bytes": buffer_bytes,
    "refusals": refusals,
    "torch_loops": torch_loops,
}


def main(rank: int, world: int, init_file: str, out_dir: str, cases: dict) -> None:
    join_gloo(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for key, cfg in cases.items():
        results[key] = SCENARIOS[cfg["scenario"]](dict(cfg, tmp=os.path.join(out_dir, key)), rank, world, mesh)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    exit_skipping_teardown(0)  # only on success: an exception above reaches mp.spawn


if __name__ == "__main__":
    sys.exit("run through tests/test_fsdp.py")

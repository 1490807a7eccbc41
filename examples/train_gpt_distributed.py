"""Train the repo's GPT-style model on several processes with accumkernels.AdamW.

    torchrun --nproc-per-node 2 examples/train_gpt_distributed.py              # gloo on the CPU
    torchrun --nproc-per-node 8 examples/train_gpt_distributed.py --sharded    # NCCL, one GPU each
    torchrun --nproc-per-node 2 examples/train_gpt_distributed.py --fsdp       # FSDP2: fully_shard per block

Each rank draws its own micro-batches of a synthetic language (a fixed random
Markov chain over 256 tokens, so there is something to learn and nothing to
download), of varying length with padding masked out. The loss is summed over
the target tokens and ``normalize="items"`` divides the window's gradient by the
tokens of all ranks' micro-batches: the exact token-weighted mean of the global
batch. The wrapper reduces the fp32 buffers across ranks once per window, during
the last micro-batch's backward; no DistributedDataParallel. With ``--fsdp``
every block and the root go through FSDP2's ``fully_shard`` (fp32 sharded
params, bf16 compute, fp32 reduce-scatter): FSDP2 reduce-scatters each
micro-step and the wrapper sums this rank's shards in fp32 buffers (1/W of the
model). ``--checkpoint`` saves (and on restart resumes) each rank's state,
mid-window included.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

import accumkernels as ak
from accumkernels.testing import GPT, exit_skipping_teardown

VOCAB, PAD = 256, -100


def markov_chain(seed: int = 0) -> torch.Tensor:
    """Next-token probabilities: each token is followed by one of 4 likely tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=g)
    logits.scatter_(1, torch.randint(0, VOCAB, (VOCAB, 4), generator=g), 6.0)
    return logits.softmax(dim=1)


def micro_batch(chain, g, batch: int, ctx: int, device):
    tokens = torch.empty(batch, ctx + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
    for t in range(ctx):
        tokens[:, t + 1] = torch.multinomial(chain[tokens[:, t]], 1, generator=g).squeeze(1)
    targets = tokens[:, 1:].clone()
    lengths = torch.randint(ctx // 4, ctx + 1, (batch,), generator=g)
    targets[torch.arange(ctx)[None, :] >= lengths[:, None]] = PAD  # ragged sequences
    return tokens[:, :-1].to(device), targets.to(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=50)
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--width", type=int, default=128, help="model width d")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sharded", action="store_true", help="ZeRO-1: shard optimizer state across ranks")
    parser.add_argument("--bf16-wire", action="store_true", help="send bf16 on the wire, sum in fp32")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 (fully_shard per block)")
    parser.add_argument("--checkpoint", default=None, help="folder for per-rank checkpoints (resumed if present)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(vocab=VOCAB, d=args.width, layers=args.layers, ctx=args.ctx).to(device)
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        options = {}
    else:
        model = model.to(torch.bfloat16)  # the defaults: stochastic rounding, bf16 moments (10 bytes per param)
        options = dict(sharded=args.sharded, wire_dtype=torch.bfloat16 if args.bf16_wire else torch.float32)
    opt = ak.AdamW(
        model.parameters(),
        lr=3e-3,
        weight_decay=0.1,
        accum_steps=args.accum_steps,
        normalize="items",
        max_grad_norm=1.0,
        **options,
    )
    chain = markov_chain()
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own micro-batches
    step = 0
    path = None if args.checkpoint is None else Path(args.checkpoint) / f"rank{rank}.pt"
    if path is not None and path.exists():
        saved = torch.load(path, map_location=device, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        g.set_state(saved["generator"])
        step = saved["step"]
        if rank == 0:
            print(f"resumed at micro-step {step} ({opt.micro_steps} into a window)")

    total_steps = args.windows * args.accum_steps
    window_loss = torch.zeros((), device=device)
    window_tokens = torch.zeros((), device=device)
    while step < total_steps:
        x, y = micro_batch(chain, g, args.micro_batch, args.ctx, device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1), ignore_index=PAD, reduction="sum")
        loss.backward()
        tokens = (y != PAD).sum()
        opt.step(num_items=tokens.float())
        opt.zero_grad()
        window_loss += loss.detach()
        window_tokens += tokens
        step += 1
        if opt.window_stepped:
            stats = torch.stack([window_loss, window_tokens])
            dist.all_reduce(stats)  # for the log line only
            if rank == 0 and ((step // args.accum_steps) % 10 in (0, 1) or step == total_steps):
                print(
                    f"window {step // args.accum_steps:4d}  loss/token {stats[0] / stats[1]:.4f}  "
                    f"grad norm {opt.last_grad_norm:.3f}",
                    flush=True,
                )
            window_loss.zero_()
            window_tokens.zero_()
        if path is not None and step == total_steps // 2 + 1:  # a mid-window checkpoint
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "generator": g.get_state(), "step": step},
                path,
            )
    dist.barrier()  # every rank past its last collective before any leaves
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # Not raise SystemExit: gloo's threads can abort Python's teardown (see exit_skipping_teardown).
    exit_skipping_teardown(main())

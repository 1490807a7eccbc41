"""What the tests, the benchmarks and the examples share (and nothing in the
package itself uses): a small GPT-style model defined here (no downloads), a
counter of torch.distributed collectives, and a clean exit for processes that
used gloo."""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-LayerNorm blocks
    of causal self-attention and a GELU MLP, a final LayerNorm and an output head."""

    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 2, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


# ---- distributed runs -------------------------------------------------------

# Bytes each rank sends per payload byte under the ring algorithms, by collective.
RING = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
}


class CollectiveCounter:
    """Counts the torch.distributed collectives called inside it (by kind) and
    the payload bytes handed to them (an all-gather's payload is its output)."""

    KIND = {
        "all_reduce": "all_reduce",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "all_to_all_single": "all_to_all",
    }

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.payload: Counter = Counter()
        self._saved: dict = {}

    def total(self) -> int:
        return sum(self.calls.values())

    def sent_bytes(self, world: int) -> float:
        return sum(RING[kind](world) * n for kind, n in self.payload.items())

    def __enter__(self):
        for name in self.KIND:
            if hasattr(dist, name):
                original = self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._counting(name, original))
        return self

    def _counting(self, name, original):
        kind = self.KIND[name]

        def call(*args, **kwargs):
            # The tensor whose bytes are the payload: all-reduce's tensor, all-gather's
            # output, the others' input; by position or by keyword (FSDP2 uses keywords).
            if kind in ("all_reduce", "all_gather"):
                tensor = (
                    args[0] if args else next(kwargs[k] for k in ("tensor", "output_tensor", "output") if k in kwargs)
                )
            else:
                tensor = args[1] if len(args) > 1 else next(kwargs[k] for k in ("input_tensor", "input") if k in kwargs)
            self.calls[kind] += 1
            self.payload[kind] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return call

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def exit_skipping_teardown(code: int = 0) -> None:
    """End a process that used gloo without Python's interpreter teardown.

    With torch 2.13 and 2.14 a gloo worker thread can still be releasing the
    last collective's work (and the tensor in it, whose Python object it then
    frees) while the interpreter finalizes: it asks for the GIL, CPython ends
    the thread, and the process aborts with "terminate called without an active
    exception" (about 1 run in 5 of the example here; gdb: ~AsyncWork ->
    decref_pyobject -> take_gil -> pthread_exit). A barrier before
    destroy_process_group() made it rarer, not impossible. Everything must be
    saved before; stdout and stderr are flushed here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

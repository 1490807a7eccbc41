"""Convergence benchmark: the held-out loss a recipe trains a model to, on real
text, beside fp32 and the peers, on identical batches and seeds.

Data: text that ships with Python itself, the standard library's source files
(``os.path.dirname(os.__file__)/*.py``, sorted by name): even-indexed files
train, odd-indexed files are held out. Bytes are the tokens (vocabulary 256).

Model: the repository's GPT (accumkernels.testing.GPT), d=64, 2 layers, 4
heads, context 64. Training: windows of one effective batch of 64 sequences,
as N micro-batches of 64/N sequences (N = 8; the window-length axis keeps the
tokens per window and uses N = 32 and 64), AdamW (betas 0.9/0.95, weight
decay 0.1), lr 2e-3 with 10 warm-up windows and a cosine decay to 1e-4,
clipping at a global norm of 1.0. Every recipe of a seed sees the same
initial weights (drawn in fp32, then cast) and the same batches. The held-out
loss is the mean cross-entropy over a fixed set of held-out sequences,
evaluated in fp32 (an fp32 copy of the weights) every few windows.

Recipes (``RECIPES``): fp32; fp32 params under bf16 autocast (what HF
``bf16=True`` does); bf16 params with plain bf16 ``.grad`` and torch's AdamW;
AccumulatingOptimizer over bf16 params with its defaults (stochastic
rounding, bf16 state) and with each precision option; the peers torchao
``_AdamW(bf16_stochastic_round=True)`` and ``AdamW8bit(bf16_stochastic_round=True)``
and bitsandbytes' ``AdamW8bit`` (each where it is installed); fp16 params
(with a GradScaler) to decide their defaults.

Training state, bytes per param: what the recipe keeps across micro-steps
besides activations, measured on its objects: params, gradient storage after
a window's last backward (``.grad``, the wrapper's fp32 buffers, or at N = 1
the gradients it holds instead), optimizer state (the real storage of
quantized state), master weights or remainders.

``python -m bench.convergence`` runs the default setting (3 seeds, 80
windows, the main recipes at N = 8 and three at N = 32; about 5 minutes on 2
cores); ``--full`` the longer one (3 seeds, 300 windows, every recipe at N = 8,
five at N = 32 and 64, seven at N = 1, where the wrapper holds no fp32 buffer;
about 90 minutes on 2 cores, fp16 on the CPU is slow). It
prints a table (held-out loss mean and spread over seeds, difference to fp32,
bytes/param, ms/window), writes convergence-<setting>.json and a PNG of the
held-out loss curves and the final differences.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import common

CTX, SEQUENCES, D, LAYERS, HEADS = 64, 64, 64, 2, 4
LR, LR_END, WARMUP, BETAS, WEIGHT_DECAY, CLIP = 2e-3, 1e-4, 10, (0.9, 0.95), 0.1, 1.0
EVAL_SEQUENCES = 256
_MAIN = (
    "fp32",
    "autocast",
    "bf16-plain",
    "ours",
    "ours-nearest",
    "ours-master",
    "ours-remainders",
    "ours-8bit",
    "torchao-sr",
    "torchao-8bit",
    "bnb-8bit",
)
_LONG_WINDOWS = ("fp32", "autocast", "bf16-plain", "ours", "torchao-sr")
_NO_ACCUMULATION = ("fp32", "bf16-plain", "ours", "ours-8bit", "torchao-sr", "torchao-8bit", "bnb-8bit")
SETTINGS = {
    # name: (windows, seeds, {N: the recipes run at that window length})
    "default": (80, 3, {8: _MAIN, 32: ("fp32", "bf16-plain", "ours")}),
    "full": (
        300,
        3,
        {
            8: _MAIN + ("ours-fp32-state", "ours-remainders-bf16-state", "fp16-ours", "fp16-ours-master"),
            32: _LONG_WINDOWS,
            64: _LONG_WINDOWS,
            # No accumulation: the window's 64 sequences in one micro-batch,
            # where the wrapper holds no fp32 buffer (accum_steps=1).
            1: _NO_ACCUMULATION,
        },
    ),
    "quick": (6, 1, {4: ("fp32", "bf16-plain", "ours", "ours-remainders")}),
}


# ---- data ---------------------------------------------------------------------


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train bytes, held-out bytes) of the standard library's .py files."""
    files = sorted(Path(os.path.dirname(os.__file__)).glob("*.py"))
    train = b"".join(f.read_bytes() for f in files[0::2])
    held = b"".join(f.read_bytes() for f in files[1::2])
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).long()  # noqa: E731
    return as_tensor(train), as_tensor(held)


def sequences(text: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` random windows of CTX + 1 bytes: (inputs, next-byte targets)."""
    starts = torch.randint(0, text.numel() - CTX - 1, (count,), generator=generator)
    rows = text[starts[:, None] + torch.arange(CTX + 1)]
    return rows[:, :-1], rows[:, 1:]


def lr_at(window: int, windows: int) -> float:
    """Linear warm-up over WARMUP windows, then a cosine decay from LR to LR_END."""
    if window < WARMUP:
        return LR * (window + 1) / WARMUP
    progress = (window - WARMUP) / max(1, windows - WARMUP - 1)
    return LR_END + 0.5 * (LR - LR_END) * (1 + math.cos(math.pi * min(1.0, progress)))


# ---- recipes ------------------------------------------------------------------


@dataclass
class Recipe:
    label: str
    dtype: torch.dtype  # of the params
    optimizer: str  # "torch", "ours", "torchao-sr", "torchao-8bit", "bnb-8bit"
    options: dict
    autocast: bool = False
    needs: str | None = None  # the package it needs
    scaler: bool = False  # fp16: a GradScaler


RECIPES = {
    "fp32": Recipe("fp32 params, fp32 compute, torch AdamW", torch.float32, "torch", {}),
    "autocast": Recipe("fp32 params + bf16 autocast, torch AdamW", torch.float32, "torch", {}, autocast=True),
    "bf16-plain": Recipe("bf16 params, plain bf16 .grad, torch AdamW", torch.bfloat16, "torch", {}),
    "ours": Recipe("AccumulatingOptimizer, bf16 params, defaults", torch.bfloat16, "ours", {}),
    "ours-fp32-state": Recipe("  + state_dtype=torch.float32", torch.bfloat16, "ours", dict(state_dtype=torch.float32)),
    "ours-8bit": Recipe("  + state_dtype='8bit'", torch.bfloat16, "ours", dict(state_dtype="8bit")),
    "ours-nearest": Recipe(
        "  + stochastic_rounding=False, fp32 state (the old defaults)",
        torch.bfloat16,
        "ours",
        dict(stochastic_rounding=False, state_dtype=torch.float32),
    ),
    "ours-master": Recipe("  + master_weights=True", torch.bfloat16, "ours", dict(master_weights=True)),
    "ours-remainders": Recipe(
        "  + master_weights='remainders'", torch.bfloat16, "ours", dict(master_weights="remainders")
    ),
    "ours-remainders-bf16-state": Recipe(
        "  + master_weights='remainders', bf16 state",
        torch.bfloat16,
        "ours",
        dict(master_weights="remainders", state_dtype=torch.bfloat16),
    ),
    "torchao-sr": Recipe(
        "torchao _AdamW(bf16_stochastic_round=True), bf16 params and .grad",
        torch.bfloat16,
        "torchao-sr",
        {},
        needs="torchao",
    ),
    "torchao-8bit": Recipe(
        "torchao AdamW8bit(bf16_stochastic_round=True), bf16 params and .grad",
        torch.bfloat16,
        "torchao-8bit",
        {},
        needs="torchao",
    ),
    "bnb-8bit": Recipe(
        "bitsandbytes AdamW8bit, bf16 params and .grad", torch.bfloat16, "bnb-8bit", {}, needs="bitsandbytes"
    ),
    "fp16-ours": Recipe(
        "AccumulatingOptimizer, fp16 params + GradScaler, defaults", torch.float16, "ours", {}, scaler=True
    ),
    "fp16-ours-master": Recipe(
        "  + master_weights=True", torch.float16, "ours", dict(master_weights=True), scaler=True
    ),
}


def _available(recipe: Recipe) -> bool:
    return recipe.needs is None or importlib.util.find_spec(recipe.needs) is not None


def _tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor's storage holds, through tensor subclasses (torchao's
    8-bit state: its codes and scales)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _optimizer(recipe: Recipe, params, n_micro: int):
    hyper = dict(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    if recipe.optimizer in ("torch", "ours"):
        inner = torch.optim.AdamW(params, **hyper)
        if recipe.optimizer == "torch":
            return inner
        import accumkernels as ak

        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if recipe.scaler else None
        return ak.AccumulatingOptimizer(
            inner, accum_steps=n_micro, max_grad_norm=CLIP, grad_scaler=scaler, **recipe.options
        )
    if recipe.optimizer == "bnb-8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **hyper)
    from torchao.optim import AdamW8bit, _AdamW

    cls = _AdamW if recipe.optimizer == "torchao-sr" else AdamW8bit
    return cls(params, bf16_stochastic_round=True, **hyper)


def train(name: str, seed: int, n_micro: int, windows: int, data, eval_every: int) -> dict:
    """One run: the held-out loss curve, its last value, bytes/param, ms/window."""
    from accumkernels.testing import GPT

    recipe = RECIPES[name]
    train_text, held = data
    torch.manual_seed(seed)
    model = GPT(vocab=256, d=D, layers=LAYERS, heads=HEADS, ctx=CTX).to(recipe.dtype)
    params = list(model.parameters())
    opt = _optimizer(recipe, params, n_micro)
    ours = recipe.optimizer == "ours"
    scaler = opt.grad_scaler if ours else None
    held_gen = torch.Generator().manual_seed(12345)
    held_x, held_y = sequences(held, EVAL_SEQUENCES, held_gen)
    eval_model = GPT(vocab=256, d=D, layers=LAYERS, heads=HEADS, ctx=CTX)

    def held_out_loss() -> float:
        with torch.no_grad():
            for e, p in zip(eval_model.parameters(), params):
                e.copy_(p.float())
            return float(eval_model.loss(held_x, held_y))

    curve, times, state_bytes, grad_bytes = [], [], None, None
    batch_gen = torch.Generator().manual_seed(seed * 1_000_003 + 7)
    for w in range(windows):
        for group in opt.param_groups:  # torchao keeps lr as a tensor, to be filled in place
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr_at(w, windows))
            else:
                group["lr"] = lr_at(w, windows)
        x, y = sequences(train_text, SEQUENCES, batch_gen)
        t0 = time.perf_counter()
        for xb, yb in zip(x.chunk(n_micro), y.chunk(n_micro)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.autocast):
                loss = model.loss(xb, yb)
            if ours:
                (scaler.scale(loss) if scaler else loss).backward()
                if grad_bytes is None and opt.micro_steps + 1 == n_micro:  # the window's gradients, before its step
                    grad_bytes = _wrapper_grad_bytes(opt)
                if scaler:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
            else:
                (loss / n_micro).backward()
        if not ours:
            if state_bytes is None:
                state_bytes = _state_bytes(params, opt, None)
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if ours and state_bytes is None:
            state_bytes = _state_bytes(params, opt, opt, grads=grad_bytes)
        if (w + 1) % eval_every == 0 or w == windows - 1:
            curve.append((w + 1, held_out_loss()))
    if not ours:  # the optimizer state exists after the first step
        state_bytes = _state_bytes(params, opt, None, grads=state_bytes["grads"])
    n = sum(p.numel() for p in params)
    return {
        "recipe": name,
        "seed": seed,
        "n_micro": n_micro,
        "curve": curve,
        "held_out_loss": curve[-1][1],
        "bytes_per_param": sum(state_bytes.values()) / n,
        "bytes": state_bytes,
        "window_ms": statistics.median(times[1:] if len(times) > 1 else times) * 1e3,
    }


def _wrapper_grad_bytes(wrapper) -> int:
    """The wrapper's gradient storage after a window's last backward: its fp32
    buffers, or (accum_steps=1) the gradients it holds in the params' dtypes."""
    if wrapper._layout.flat is not None:
        return _tensor_bytes(wrapper._layout.flat)
    return sum(_tensor_bytes(r.buffer) for r in wrapper._layout if r.buffer is not None)


def _state_bytes(params, opt, wrapper, grads=None) -> dict:
    """Training state by part: params, gradient storage (``grads``: measured
    before the step), optimizer state, master weights."""
    out = {"params": sum(_tensor_bytes(p) for p in params)}
    if wrapper is not None:
        out["grads"] = grads
        out["masters"] = sum(_tensor_bytes(r.master) for r in wrapper._layout if r.master is not None)
    else:
        out["grads"] = grads if grads is not None else sum(_tensor_bytes(p.grad) for p in params if p.grad is not None)
        out["masters"] = 0
    out["optimizer state"] = sum(
        _tensor_bytes(v) for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"
    )
    return out


# ---- the suite ----------------------------------------------------------------

TABLE = [
    ("n_micro", "N", "d"),
    ("recipe", "recipe", "s"),
    ("held_out_loss", "held-out loss", ".4f"),
    ("spread", "spread", ".4f"),
    ("vs_fp32", "vs fp32", "+.4f"),
    ("bytes_per_param", "B/param", ".1f"),
    ("window_ms", "ms/window", ".0f"),
]


def summarize(runs: list[dict]) -> list[dict]:
    """Per (N, recipe): held-out loss mean and spread (max - min) over seeds,
    the difference to fp32's mean at the same N, bytes/param, ms/window."""
    rows = []
    by_key: dict = {}
    for r in runs:
        by_key.setdefault((r["n_micro"], r["recipe"]), []).append(r)
    for (n, name), rs in sorted(by_key.items(), key=lambda kv: (kv[0][0], list(RECIPES).index(kv[0][1]))):
        losses = [r["held_out_loss"] for r in rs]
        fp32 = by_key.get((n, "fp32"))
        rows.append(
            {
                "n_micro": n,
                "recipe": name,
                "label": RECIPES[name].label,
                "seeds": len(rs),
                "held_out_loss": statistics.mean(losses),
                "spread": max(losses) - min(losses),
                "vs_fp32": statistics.mean(losses) - statistics.mean(x["held_out_loss"] for x in fp32)
                if fp32
                else None,
                "bytes_per_param": statistics.mean(r["bytes_per_param"] for r in rs),
                "window_ms": statistics.median(r["window_ms"] for r in rs),
            }
        )
    return rows


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, rows = payload["runs"], payload["rows"]
    base_n = min(r["n_micro"] for r in runs)
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.15]})
    names = [n for n in RECIPES if any(r["recipe"] == n and r["n_micro"] == base_n for r in runs)]
    for name in names:
        rs = [r for r in runs if r["recipe"] == name and r["n_micro"] == base_n]
        steps = [w for w, _ in rs[0]["curve"]]
        mean = [statistics.mean(r["curve"][i][1] for r in rs) for i in range(len(steps))]
        style = "-" if name in ("fp32", "ours", "bf16-plain") else "--"
        curves.plot(steps, mean, style, label=name, linewidth=2 if name in ("fp32", "ours", "bf16-plain") else 1)
    last = [r["held_out_loss"] for r in rows if r["n_micro"] == base_n]
    curves.set_ylim(min(last) - 0.05, min(last) + 0.6)
    curves.set(
        xlabel="window",
        ylabel="held-out loss (fp32 eval, mean of seeds)",
        title=f"held-out loss, N = {base_n} micro-batches per window",
    )
    curves.legend(fontsize=7)
    ordered = sorted((r for r in rows if r["vs_fp32"] is not None), key=lambda r: (r["n_micro"], r["vs_fp32"]))
    ys = range(len(ordered))
    bars.barh(
        list(ys),
        [r["vs_fp32"] for r in ordered],
        xerr=[r["spread"] / 2 for r in ordered],
        color=["tab:green" if r["recipe"].startswith("ours") else "tab:gray" for r in ordered],
    )
    bars.set_yticks(list(ys))
    bars.set_yticklabels(
        [f"N={r['n_micro']} {r['recipe']} ({r['bytes_per_param']:.1f} B/param)" for r in ordered], fontsize=7
    )
    spread = max((r["spread"] for r in rows if r["recipe"] == "fp32"), default=0.0)
    bars.axvspan(-spread / 2, spread / 2, color="tab:blue", alpha=0.15, label="fp32's seed spread")
    bars.axvline(0, color="k", linewidth=0.8)
    bars.set(
        xlabel="final held-out loss minus fp32's (error bar: half the seed spread)",
        title="final held-out loss vs fp32, with training state in bytes/param",
    )
    bars.legend(fontsize=7)
    fig.suptitle(
        f"GPT d={D} x {LAYERS} layers on Python's standard library, {payload['windows']} windows of "
        f"{SEQUENCES} x {CTX} tokens, {payload['seeds']} seeds ({payload['machine']['cpu']}, "
        f"torch {payload['machine']['torch']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(setting: str, progress=print, recipes: list[str] | None = None, n_micro_only: int | None = None) -> dict:
    """The setting's runs; ``recipes``, ``n_micro_only``: only these rows (each as in the whole run)."""
    windows, seeds, axis = SETTINGS[setting]
    data = corpus()
    eval_every = max(1, windows // 20)
    runs, skipped = [], {}
    for n_micro, names in axis.items():
        if n_micro_only is not None and n_micro != n_micro_only:
            continue
        for name in names:
            if recipes is not None and name not in recipes:
                continue
            recipe = RECIPES[name]
            if not _available(recipe):
                skipped[name] = f"{recipe.needs} is not installed"
                continue
            for seed in range(seeds):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        r = train(name, seed, n_micro, windows, data, eval_every)
                except Exception as e:  # a peer that does not run here is reported, not hidden
                    skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    break
                runs.append(r)
                progress(
                    f"  N={n_micro:2d} {name:28s} seed {seed}: held-out {r['held_out_loss']:.4f}, "
                    f"{r['bytes_per_param']:.1f} B/param, {r['window_ms']:.0f} ms/window"
                )
    payload = {
        "machine": common.machine_record(torch.device("cpu")),
        "setting": setting,
        "windows": windows,
        "seeds": seeds,
        "runs": runs,
        "rows": summarize(runs),
        "skipped": skipped,
        "recipes": recipes,
        "n_micro_only": n_micro_only,
    }
    return payload


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="300 windows, N = 8, 32, 64 and 1")
    parser.add_argument("--quick", action="store_true", help="a few windows (the tests' smoke run)")
    parser.add_argument("--results-dir", default=None, help="default bench/results/local/")
    parser.add_argument(
        "--recipes",
        default=None,
        help=f"comma-separated: only these rows of the setting, written to convergence-<setting>-<recipes>.json "
        f"(of {', '.join(RECIPES)})",
    )
    parser.add_argument("--n-micro", type=int, default=None, help="only the rows of this window length N")
    args = parser.parse_args(argv)
    setting = "full" if args.full else "quick" if args.quick else "default"
    recipes = None if args.recipes is None else args.recipes.split(",")
    unknown = sorted(set(recipes or ()) - set(RECIPES))
    if unknown:
        parser.error(f"--recipes: unknown {unknown}")
    print(f"convergence benchmark ({setting}), commit {common.git_commit()}", flush=True)
    payload = run(setting, progress=lambda s: print(s, flush=True), recipes=recipes, n_micro_only=args.n_micro)
    print()
    print(common.table(payload["rows"], TABLE))
    for name, why in payload["skipped"].items():
        print(f"not run: {name}: {why}")
    name = f"convergence-{setting}" + ("" if recipes is None else "-" + "+".join(recipes))
    name += "" if args.n_micro is None else f"-n{args.n_micro}"
    path = common.write_results(name, payload, args.results_dir)
    try:
        plot(payload, path.with_suffix(".png"))
        print(f"wrote {path} and {path.with_suffix('.png')}")
    except ImportError:
        print(f"wrote {path} (no plot: matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

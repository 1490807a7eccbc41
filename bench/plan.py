"""The window planner against measurement: ``python -m bench.plan``.

For the repo's GPT model at a few sizes, ``plan_window`` picks the micro-batch
size and accumulation steps for a global batch and a memory budget; then each
prediction is checked against a peak measured independently, in a fresh
process that trains with that configuration (one window and the first
micro-step of the next, so that the optimizer state exists): on the CPU the
running sum of torch's profiler memory events (every allocation and free of
the CPU allocator, from before the model is built), on CUDA
``torch.cuda.max_memory_allocated``. Prints the plans and a table, writes JSON
and a plot of predicted and measured peak against the micro-batch size.

    python -m bench.plan [--quick] [--global-batch 96] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from . import common

MODELS = {"gpt-d64": (64, 2), "gpt-d128": (128, 2), "gpt-d256": (256, 4)}  # (d_model, layers)
CTX, VOCAB = 64, 256


def _model(name: str, device):
    from accumkernels.testing import GPT

    d, layers = MODELS[name]
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, d=d, layers=layers, heads=4, ctx=CTX).to(device)


def _loss_fn(model, b):
    device = next(model.parameters()).device
    idx = torch.randint(0, VOCAB, (b, CTX), device=device)
    return model.loss(idx, (idx * 7 + 3) % VOCAB)


def _train(model, opt, micro_batch: int, micro_steps: int) -> None:
    for _ in range(micro_steps):
        _loss_fn(model, micro_batch).backward()
        opt.step()
        opt.zero_grad()


def measure(cfg: dict) -> dict:
    """The peak of training ``cfg`` in this process (run in a fresh one)."""
    import accumkernels as ak

    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        model = _model(cfg["model"], device)
        opt = ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), accum_steps=cfg["accum_steps"])
        _train(model, opt, cfg["micro_batch"], cfg["accum_steps"] + 1)
        torch.cuda.synchronize(device)
        return {**cfg, "measured_peak": torch.cuda.max_memory_allocated(device)}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model = _model(cfg["model"], device)
        opt = ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), accum_steps=cfg["accum_steps"])
        _train(model, opt, cfg["micro_batch"], cfg["accum_steps"] + 1)
    return {**cfg, "measured_peak": common.profiled_peak(prof)}


def run(device: torch.device, models: list[str], global_batch: int, budgets: dict[str, str], progress=print) -> dict:
    import accumkernels as ak

    rows, plans = [], {}
    for name in models:
        model = _model(name, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        start = time.perf_counter()
        plan = ak.plan_window(model, _loss_fn, global_batch=global_batch, memory_budget=budgets[name], optimizer=opt)
        plan_seconds = time.perf_counter() - start
        progress(f"\n{name}, global batch {global_batch}, budget {budgets[name]}:\n{plan}")
        # What Accelerate's find_executable_batch_size would run for the same
        # answer: start at the global batch, retry at 0.9x after each OOM.
        attempts, b = 1, global_batch
        while b > plan.micro_batch_size:
            b = max(plan.micro_batch_size, int(b * 0.9))
            attempts += 1
        plans[name] = {
            "plan": str(plan),
            "micro_batch_size": plan.micro_batch_size,
            "accum_steps": plan.accum_steps,
            "budget": plan.budget_bytes,
            "predicted_peak": plan.predicted_peak_bytes,
            "fit": plan.fit,
            "passes": plan.passes,
            "seconds": plan_seconds,
            "retry_on_oom_attempts": attempts,
        }
        for micro in sorted(
            {max(1, plan.micro_batch_size // 4), max(1, plan.micro_batch_size // 2), plan.micro_batch_size}
        ):
            steps = -(-global_batch // micro)
            # What a window of `steps` micro-batches holds (no fp32 buffers in a window of one).
            static = sum(ak.plan.static_bytes(opt, accum_steps=steps).values())
            predicted = static + plan.fit["a"] + plan.fit["c"] * micro
            cfg = dict(device=str(device), model=name, micro_batch=micro, accum_steps=steps)
            r = common.in_fresh_process("bench.plan", cfg)
            r.update(predicted_peak=predicted, chosen=micro == plan.micro_batch_size, budget=plan.budget_bytes)
            r["error"] = r["predicted_peak"] / r["measured_peak"] - 1
            rows.append(r)
            progress(
                f"  {name} micro-batch {micro:3d} x {steps:3d}: predicted {predicted / 2**20:7.1f} MiB, measured "
                f"{r['measured_peak'] / 2**20:7.1f} MiB ({r['error'] * 100:+.1f} %)"
            )
    return {"plans": plans, "rows": rows}


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, name in enumerate(result["plans"]):
        rows = [r for r in result["rows"] if r["model"] == name]
        color = f"C{i}"
        ax.plot(
            [r["micro_batch"] for r in rows],
            [r["predicted_peak"] / 2**20 for r in rows],
            "-",
            color=color,
            label=f"{name} predicted",
        )
        ax.plot(
            [r["micro_batch"] for r in rows],
            [r["measured_peak"] / 2**20 for r in rows],
            "o",
            color=color,
            label=f"{name} measured",
        )
        ax.axhline(result["plans"][name]["budget"] / 2**20, color=color, ls=":", lw=0.8)
    ax.set_ylim(0, max(p["budget"] for p in result["plans"].values()) / 2**20 * 1.08)
    ax.set(
        xlabel="micro-batch size (samples)",
        ylabel="peak memory (MiB)",
        title="plan_window: predicted peak (lines) against measured (dots); budgets dotted",
    )
    ax.title.set_size(9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help="internal: one measurement (a JSON config)")
    parser.add_argument("--quick", action="store_true", help="one small model")
    parser.add_argument("--global-batch", type=int, default=96)
    parser.add_argument("--device", default=None)
    parser.add_argument("--results-dir", default=None, help="default bench/results/local/")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    models = ["gpt-d64"] if args.quick else list(MODELS)
    budgets = {"gpt-d64": "24MiB", "gpt-d128": "48MiB", "gpt-d256": "160MiB"}
    result = run(device, models, args.global_batch, budgets)
    result["machine"] = common.machine_record(device)
    print(
        "\n"
        + common.table(
            result["rows"],
            [
                ("model", "model", "s"),
                ("micro_batch", "micro-batch", "d"),
                ("accum_steps", "N", "d"),
                ("predicted_peak", "predicted B", ".0f"),
                ("measured_peak", "measured B", ".0f"),
                ("error", "error", "+.3f"),
                ("chosen", "chosen", ""),
            ],
        )
    )
    path = common.write_results(f"plan-{device.type}{'-quick' if args.quick else ''}", result, args.results_dir)
    png = path.with_suffix(".png")
    plot(result, png)
    print(f"wrote {path}\nwrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

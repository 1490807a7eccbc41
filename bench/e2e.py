"""End-to-end benchmark: training windows of a GPT-style model, the plain
``.grad`` path against AccumulatingOptimizer, and the time-for-memory trade.

Each measurement runs in a fresh subprocess (``python -m bench.e2e --one
'<json config>'``) so that its peak memory is its own: on CUDA the allocator's
``max_memory_allocated``, on the CPU the growth of the process's peak resident
set (``VmHWM``, reset when the model and data are built) over its size then.

Paths (all AdamW, lr 1e-3, one optimizer step per window of N micro-batches):

  plain-bf16       bf16 params, autograd adds each micro-batch into bf16 ``.grad``
  plain-autocast   fp32 params, bf16 autocast, fp32 ``.grad``
  ours-bf16        bf16 params, AccumulatingOptimizer (fp32 buffers)
  ours-bf16-master the same with fp32 master weights

Reported per window: median time, peak memory, the step's share of the window
(the last ``step()`` call, which runs the optimizer), and the relative error of
the window's summed gradient against a float64 sum of the same micro-batch
gradients (computed once, outside the timing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

PATHS = ("plain-bf16", "plain-autocast", "ours-bf16", "ours-bf16-master")
SIZES = {  # name: (d_model, layers); small enough for the default run to fit in minutes on 2 cores
    "gpt-d64": (64, 2),
    "gpt-d128": (128, 2),
    "gpt-d256": (256, 2),
}


def _proc_status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak(device: torch.device) -> int:
    """Start a peak-memory measurement; returns the bytes in use now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:  # Linux: reset the resident-set high-water mark (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _proc_status_kib("VmRSS") * 1024


def _peak_bytes(device: torch.device) -> int:
    """The high-water mark since _reset_peak. On the CPU, VmHWM: per address
    space, so unlike ru_maxrss it is not inherited from the parent process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status_kib("VmHWM") * 1024


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(cfg: dict) -> dict:
    """One (path, model, N, micro-batch) measurement, in this process."""
    import accumkernels as ak
    from accumkernels.testing import GPT

    device = torch.device(cfg["device"])
    path, n_micro, micro_batch, ctx, windows = cfg["path"], cfg["n_micro"], cfg["micro_batch"], 64, cfg["windows"]
    d, layers = SIZES[cfg["model"]]
    torch.manual_seed(0)
    model = GPT(vocab=256, d=d, layers=layers, heads=4, ctx=ctx).to(device)
    if path != "plain-autocast":
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    inner = torch.optim.AdamW(params, lr=1e-3)
    opt = inner
    if path.startswith("ours"):
        opt = ak.AccumulatingOptimizer(inner, accum_steps=n_micro, master_weights=path.endswith("master"))
    data = [torch.randint(0, 256, (micro_batch, ctx), device=device) for _ in range(n_micro)]

    # The plain paths divide each micro-batch's loss by N by hand; the wrapper
    # takes the loss as is and divides in the step (normalize="mean").
    divisor = n_micro if path.startswith("plain") else 1

    def micro_loss(model, idx):
        targets = (idx * 7 + 3) % 256
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=path == "plain-autocast"):
            return model.loss(idx, targets) / divisor

    def window():
        step_seconds = 0.0
        for i, idx in enumerate(data):
            micro_loss(model, idx).backward()
            if path.startswith("ours"):
                if i == n_micro - 1:
                    _sync(device)
                    t0 = time.perf_counter()
                opt.step()
                if i == n_micro - 1:
                    _sync(device)
                    step_seconds = time.perf_counter() - t0
        if path.startswith("plain"):
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            step_seconds = time.perf_counter() - t0
        return step_seconds

    _sync(device)
    baseline = _reset_peak(device)
    window()  # warm-up (allocates state and buffers)
    times, step_times = [], []
    for _ in range(windows):
        _sync(device)
        t0 = time.perf_counter()
        step_times.append(window())
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = _peak_bytes(device) - baseline

    # Gradient error of one window's accumulation, against a float64 sum of the
    # very same micro-batch gradients (taken one by one from a copy).
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for idx in data:
        grads = torch.autograd.grad(micro_loss(model, idx), params)
        for e, g in zip(exact, grads):
            e += g.double()
    if path.startswith("ours"):
        for idx in data[:-1]:
            micro_loss(model, idx).backward()
            opt.step()
        micro_loss(model, data[-1]).backward()
        got = [opt.accumulated_grad(p).double() for p in params]  # the window's mean
        exact = [e / n_micro for e in exact]  # our losses are not divided by N: the step divides
        opt.zero_grad()
    else:
        for idx in data:
            micro_loss(model, idx).backward()
        got = [p.grad.double() for p in params]
    num = sum(((g - e) ** 2).sum() for g, e in zip(got, exact)) ** 0.5
    den = sum((e**2).sum() for e in exact) ** 0.5
    return {
        **cfg,
        "window_ms": statistics.median(times) * 1e3,
        "step_share": statistics.median(s / t for s, t in zip(step_times, times)),
        "peak_mib": peak / 2**20,
        "grad_rel_error": (num / den).item(),
        "params": sum(p.numel() for p in params),
    }


def measure(cfg: dict) -> dict:
    """run_one in a fresh process (so that its peak memory is its own)."""
    out = subprocess.run([sys.executable, "-m", "bench.e2e", "--one", json.dumps(cfg)], capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"e2e measurement {cfg} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def windows_suite(device: str, quick: bool, progress=print) -> list[dict]:
    """Every path over model sizes and window lengths N."""
    sizes = ["gpt-d64"] if quick else list(SIZES)
    ns = [1, 4] if quick else [1, 2, 4, 8]
    rows = []
    for model in sizes:
        for n in ns:
            for path in PATHS:
                cfg = dict(device=device, path=path, model=model, n_micro=n, micro_batch=4, windows=2 if quick else 3)
                rows.append(measure(cfg))
                r = rows[-1]
                progress(f"  {model:9s} N={n:<3d} {path:17s} {r['window_ms']:9.1f} ms/window  peak {r['peak_mib']:8.1f} MiB"
                         f"  step {r['step_share'] * 100:5.1f} %  grad error {r['grad_rel_error']:.1e}")  # fmt: skip
    return rows


def trade_suite(device: str, quick: bool, progress=print) -> list[dict]:
    """One effective batch of B sequences as N micro-batches of B/N: the plain
    fp32 path (autocast) and the wrapper (bf16 params), peak memory and time."""
    batch = 16 if quick else 64
    ns = [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32, 64]
    model = "gpt-d64" if quick or device == "cpu" else "gpt-d256"
    rows = []
    for n in ns:
        for path in ("plain-autocast", "ours-bf16"):
            cfg = dict(device=device, path=path, model=model, n_micro=n, micro_batch=batch // n, windows=2)
            rows.append(measure(cfg))
            r = rows[-1]
            progress(f"  {model:9s} batch {batch} = {n:2d} x {batch // n:2d}  {path:15s} {r['window_ms']:9.1f} ms  "
                     f"peak {r['peak_mib']:8.1f} MiB")  # fmt: skip
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help="internal: run one measurement (a JSON config) and print its result")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    parser.error("run the suite through `python -m bench.run`; --one is for its subprocesses")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

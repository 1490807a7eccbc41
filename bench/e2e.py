"""End-to-end benchmark: training windows of a GPT-style model, the plain
``.grad`` paths against AccumulatingOptimizer (both intakes), the precision of
each path's window gradient, and the time-for-memory trade.

Paths (AdamW, lr 1e-3, one optimizer step per window of N micro-batches):

  plain-bf16       bf16 params, autograd adds each micro-batch into bf16 ``.grad`` (loss / N)
  plain-autocast   fp32 params, bf16 autocast, fp32 ``.grad`` (loss / N)
  plain-fp32       fp32 params, fp32 compute (precision reference only)
  ours-hooks       bf16 params, AccumulatingOptimizer, intake "hooks" (fp32 buffers, fused fold)
  ours-grad        bf16 params, AccumulatingOptimizer, intake "grad" (.grad is the fp32 buffer)
  ours-master      ours-hooks with fp32 master weights

``windows_suite``: each (path, model, N) measured in a fresh process
(``python -m bench.e2e --one '<json>'``) so that its peak memory is its own:
on CUDA the allocator's ``max_memory_allocated``, on the CPU the growth of the
process's peak resident set (``VmHWM``, reset when the model and data are built).
Reported: median time per window, peak memory, the step's share of the window.

``precision_suite``: for N = 1 ... 128 micro-batches (GPT d=128, 2 layers,
micro-batches of 4 x 32 tokens, all paths starting from the same bf16-exact
weights), the relative L2 error of each path's window gradient (the mean over
the window) against two references:

  summation error   the float64 sum of the same micro-batch gradients (those of
                    the path's own backward): the error of accumulating them
  total error       the float64 gradient of the big batch (the weights upcast to
                    float64, forward and backward in float64): everything,
                    the low-precision backward included

``trade_suite``: one effective batch of B sequences as N micro-batches of B/N.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from . import common

PATHS = ("plain-bf16", "plain-autocast", "ours-hooks", "ours-grad", "ours-master")
PRECISION_PATHS = ("plain-bf16", "plain-autocast", "plain-fp32", "ours-hooks", "ours-grad")
SIZES = {  # name: (d_model, layers)
    "gpt-d64": (64, 2),
    "gpt-d128": (128, 2),
    "gpt-d256": (256, 2),
    "gpt-d1024": (1024, 8),  # GPU only: 100M params
}
# The suite's models: small enough for the CPU run to fit in minutes on 2 cores.
SUITE_SIZES = {"cpu": ["gpt-d64", "gpt-d128", "gpt-d256"], "cuda": ["gpt-d64", "gpt-d256", "gpt-d1024"]}
VOCAB = 256


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


def _model(name: str, device, ctx: int):
    from accumkernels.testing import GPT

    d, layers = SIZES[name]
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, d=d, layers=layers, heads=4, ctx=ctx).to(device)
    with torch.no_grad():  # bf16-exact weights: every path starts from the same values
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def _tokens(n: int, batch: int, ctx: int, device, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, ctx), generator=g).to(device) for _ in range(n)]


def _loss(model, idx, autocast: bool):
    targets = (idx * 7 + 3) % VOCAB  # learnable: a fixed map from each token
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
        return model.loss(idx, targets)


def _setup(path: str, model_name: str, n_micro: int, device, ctx: int):
    """(model, optimizer the loop calls step() on, divisor of each micro-batch's loss)."""
    import accumkernels as ak

    model = _model(model_name, device, ctx)
    if path not in ("plain-autocast", "plain-fp32"):
        model = model.to(torch.bfloat16)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if not path.startswith("ours"):
        return model, inner, n_micro  # the plain paths divide each micro-batch's loss by N by hand
    intake = "grad" if path == "ours-grad" else "hooks"
    opt = ak.AccumulatingOptimizer(inner, accum_steps=n_micro, intake=intake, master_weights=path == "ours-master")
    return model, opt, 1  # the wrapper divides in the step (normalize="mean")


def run_one(cfg: dict) -> dict:
    """One (path, model, N, micro-batch) timing and memory measurement, in this process."""
    device = torch.device(cfg["device"])
    path, n_micro, ctx = cfg["path"], cfg["n_micro"], 64
    model, opt, divisor = _setup(path, cfg["model"], n_micro, device, ctx)
    data = _tokens(n_micro, cfg["micro_batch"], ctx, device)
    ours, autocast = path.startswith("ours"), path == "plain-autocast"

    def window():
        step_seconds = 0.0
        for i, idx in enumerate(data):
            (_loss(model, idx, autocast) / divisor).backward()
            if ours:
                last = i == n_micro - 1
                if last:
                    common.synchronize(device)
                    t0 = time.perf_counter()
                opt.step()
                opt.zero_grad()
                if last:
                    common.synchronize(device)
                    step_seconds = time.perf_counter() - t0
        if not ours:
            common.synchronize(device)
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            common.synchronize(device)
            step_seconds = time.perf_counter() - t0
        return step_seconds

    common.synchronize(device)
    baseline = _reset_peak(device)
    window()  # warm-up (allocates state and buffers)
    times, step_times = [], []
    for _ in range(cfg["windows"]):
        common.synchronize(device)
        t0 = time.perf_counter()
        step_times.append(window())
        common.synchronize(device)
        times.append(time.perf_counter() - t0)
    return {
        **cfg,
        "window_ms": statistics.median(times) * 1e3,
        "step_share": statistics.median(s / t for s, t in zip(step_times, times)),
        "peak_mib": (_peak_bytes(device) - baseline) / 2**20,
        "params": sum(p.numel() for p in model.parameters()),
    }


def _relative_error(got: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    num = sum(((g.double() - e) ** 2).sum() for g, e in zip(got, exact)) ** 0.5
    return (num / sum((e**2).sum() for e in exact) ** 0.5).item()


def precision_suite(device: str, quick: bool, progress=print) -> list[dict]:
    """Summation and total error of each path's window gradient against N."""
    device = torch.device(device)
    ns = [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32, 64, 128]
    model_name, batch, ctx = "gpt-d128", 4, 32
    data = _tokens(max(ns), batch, ctx, device, seed=2)
    reference = _model(model_name, device, ctx).double()
    ref_params = list(reference.parameters())
    rows = []
    for n in ns:
        # The float64 gradient of the big batch (the mean of the N micro-batch losses).
        exact = [torch.zeros_like(p) for p in ref_params]
        for idx in data[:n]:
            for e, g in zip(exact, torch.autograd.grad(_loss(reference, idx, False) / n, ref_params)):
                e += g
        for path in PRECISION_PATHS:
            model, opt, divisor = _setup(path, model_name, n, device, ctx)
            params = list(model.parameters())
            autocast = path == "plain-autocast"
            own_sum = [torch.zeros_like(p, dtype=torch.float64) for p in params]
            acc = [torch.zeros_like(p) for p in params]  # what autograd's .grad += does, in the param dtype
            for i, idx in enumerate(data[:n]):
                grads = torch.autograd.grad(_loss(model, idx, autocast), params)
                for s, g in zip(own_sum, grads):
                    s += g.double() / n
                if path.startswith("ours"):
                    _loss(model, idx, autocast).backward()
                    if i < n - 1:
                        opt.step()
                else:
                    for a, g in zip(acc, grads):
                        a.add_(g / divisor)
            got = [opt.accumulated_grad(p) for p in params] if path.startswith("ours") else acc
            rows.append(
                {
                    "path": path,
                    "n_micro": n,
                    "model": model_name,
                    "micro_batch": batch,
                    "ctx": ctx,
                    "sum_error": _relative_error(got, own_sum),
                    "total_error": _relative_error(got, exact),
                }
            )
            r = rows[-1]
            progress(
                f"  N={n:<4d} {path:15s} summation error {r['sum_error']:.1e}   total error {r['total_error']:.1e}"
            )
            if path.startswith("ours"):
                opt.close()
    return rows


def windows_suite(device: str, quick: bool, progress=print, sizes=None, ns=None, paths=None) -> list[dict]:
    """Every path (or ``paths``) over model sizes and window lengths N."""
    sizes = sizes or (["gpt-d64"] if quick else SUITE_SIZES[device])
    ns = ns or ([4] if quick else [1, 2, 4, 8])
    unknown = sorted(set(paths or ()) - set(PATHS))
    if unknown:
        raise ValueError(f"paths: unknown {unknown}; expected some of {list(PATHS)}")
    rows = []
    for model in sizes:
        for n in ns:
            for path in paths or PATHS:
                cfg = dict(device=device, path=path, model=model, n_micro=n, micro_batch=4, windows=2 if quick else 3)
                rows.append(common.in_fresh_process("bench.e2e", cfg))
                r = rows[-1]
                progress(
                    f"  {model:9s} N={n:<3d} {path:15s} {r['window_ms']:9.1f} ms/window  peak {r['peak_mib']:8.1f} MiB"
                    f"  step {r['step_share'] * 100:5.1f} %"
                )
    return rows


def trade_suite(device: str, quick: bool, progress=print) -> list[dict]:
    """One effective batch of B sequences as N micro-batches of B/N: the plain
    fp32 path (autocast) and the wrapper (bf16 params), peak memory and time."""
    batch = 16 if quick else 64
    ns = [1, 16] if quick else [1, 2, 4, 8, 16, 32, 64]
    model = "gpt-d64" if quick or device == "cpu" else "gpt-d256"
    rows = []
    for n in ns:
        for path in ("plain-autocast", "ours-hooks"):
            cfg = dict(device=device, path=path, model=model, n_micro=n, micro_batch=batch // n, windows=2)
            rows.append(common.in_fresh_process("bench.e2e", cfg))
            r = rows[-1]
            progress(
                f"  {model:9s} batch {batch} = {n:2d} x {batch // n:2d}  {path:15s} {r['window_ms']:9.1f} ms  "
                f"peak {r['peak_mib']:8.1f} MiB"
            )
    return rows


WINDOWS_TABLE = [
    ("model", "model", "s"),
    ("n_micro", "N", "d"),
    ("path", "path", "s"),
    ("window_ms", "ms/window", ".1f"),
    ("peak_mib", "peak MiB", ".1f"),
    ("step_share", "step share", ".3f"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help="internal: run one measurement (a JSON config) and print its result")
    parser.add_argument("--windows", action="store_true", help="only the training windows (the suite: bench.run)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present, else cpu)")
    parser.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--ns", default=None, help="comma-separated window lengths N")
    parser.add_argument("--paths", default=None, help=f"comma-separated, of {', '.join(PATHS)} (default: all)")
    parser.add_argument("--results-dir", default=None, help="default bench/results/local/")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    if not args.windows:
        parser.error("the suite runs through `python -m bench.run`; here: --windows, or --one (its subprocesses)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    record = common.machine_record(device)
    print(f"training windows on {device}, commit {record['commit']}")
    rows = windows_suite(
        device.type,
        False,
        sizes=args.models and args.models.split(","),
        ns=args.ns and [int(n) for n in args.ns.split(",")],
        paths=args.paths and args.paths.split(","),
    )
    print(common.table(rows, WINDOWS_TABLE))
    print(
        f"wrote {common.write_results(f'windows-{device.type}', {'machine': record, 'rows': rows}, args.results_dir)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

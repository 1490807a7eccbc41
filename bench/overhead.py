"""The wrapper's per-micro-step overhead on a model of many small params.

800 bf16 params (200 x Linear(64, 64) + LayerNorm), micro-batches of 8 rows,
AdamW, windows of N = 4: the median window time of the plain ``.grad`` path
(autograd adds into bf16 ``.grad``, loss / N, one ``AdamW.step()`` and
``zero_grad()``) against AccumulatingOptimizer with each intake, timed in
interleaved rounds. Small tensors make the window cheap, so the Python work
per param and per micro-step (hooks, bookkeeping) shows.

    python -m bench.overhead [--windows 40] [--out NAME]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from . import common

LAYERS, WIDTH, MICRO_BATCH, N = 200, 64, 8, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)]
    return nn.Sequential(*layers).to(torch.bfloat16)


def main(argv=None) -> int:
    import accumkernels as ak

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40, help="timed windows per path")
    parser.add_argument("--results-dir", default=None, help="folder for the JSON (default: bench/results/local)")
    parser.add_argument("--out", default="overhead-cpu")
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    data = [torch.randn(MICRO_BATCH, WIDTH, dtype=torch.bfloat16) for _ in range(N)]

    plain = _model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    def plain_window():
        for x in data:
            (plain(x).float().square().mean() / N).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    paths = {"plain .grad (bf16)": plain_window}
    for intake in ak.AccumulatingOptimizer.INTAKES:
        model = _model()
        opt = ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), accum_steps=N, intake=intake)

        def window(model=model, opt=opt):
            for x in data:
                model(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad()

        paths[f"AccumulatingOptimizer, intake={intake!r}"] = window

    medians = common.interleaved_medians(list(paths.values()), device, reps=args.windows, warmup=3)
    base = medians[0]
    rows = [dict(path=name, window_ms=m * 1e3, relative=m / base) for name, m in zip(paths, medians)]
    print(f"{LAYERS * 4} bf16 params, micro-batch {MICRO_BATCH}, N = {N}, AdamW, median of {args.windows} windows")
    print(common.table(rows, [("path", "path", ""), ("window_ms", "ms/window", ".2f"), ("relative", "x plain", ".3f")]))
    path = common.write_results(args.out, {"machine": common.machine_record(device), "rows": rows}, args.results_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

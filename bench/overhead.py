"""The wrapper's per-micro-step overhead: its window time against plain PyTorch's.

bf16 params, AdamW, each path's windows timed in interleaved rounds (one window
of each path per round, the order rotating), reported as the median window
time and the median over rounds of the window time over plain's in the same
round (paired: the machine's drift during a run cancels):

``tiny``            800 params (200 x Linear(64, 64) + LayerNorm), micro-batches
                    of 8 rows, N = 4. Small tensors make the window cheap, so the
                    Python work per param and per micro-step (hooks, bookkeeping) shows.
``gpt``             GPT d=64 x 2 layers (accumkernels.testing.GPT, vocabulary 256),
                    micro-batches of 8 x 64 tokens, N = 8: a realistic small model.
``convergence``     bench/convergence.py's model, data and optimizer (AdamW 0.9/0.95,
                    weight decay 0.1, clipping at 1: plain clips with
                    ``clip_grad_norm_``, the wrapper with ``max_grad_norm``), its
                    window of 64 sequences in N = 8 micro-batches.
``convergence-n64`` the same window in N = 64 micro-batches of one sequence.

Paths: the plain ``.grad`` loop (autograd adds into bf16 ``.grad``, loss / N,
one ``AdamW.step()`` and ``zero_grad()`` a window); AccumulatingOptimizer
counting the window (``accum_steps=N``, ``step()`` every micro-batch) with
each intake, and intake "hooks" once more through its Python pre-hooks only
(as a build without the extension runs it; the default path uses the native
ones of csrc/grad_inbox.cpp).

    python -m bench.overhead [--windows 40] [--cases tiny,gpt,...] [--paths plain,hooks,...] [--out NAME]

(``--paths`` of plain, hooks, hooks-python, grad: fewer paths make shorter
rounds, whose paired ratios this VM's drift disturbs less.)

Targets: tiny <= 1.05x plain, gpt counted <= 1.03x (issue #29); the
convergence model's window <= plain's (issue #27).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from . import common

LAYERS, WIDTH, MICRO_BATCH, TINY_N = 200, 64, 8, 4
GPT_D, GPT_LAYERS, GPT_BATCH, GPT_CTX, GPT_N, VOCAB = 64, 2, 8, 64, 8, 256


def _tiny():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)]
    model = nn.Sequential(*layers).to(torch.bfloat16)
    data = [torch.randn(MICRO_BATCH, WIDTH, dtype=torch.bfloat16) for _ in range(TINY_N)]
    return model, data, lambda model, x: model(x).float().square().mean()


def _gpt():
    from accumkernels.testing import GPT

    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, d=GPT_D, layers=GPT_LAYERS, heads=4, ctx=GPT_CTX).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (GPT_BATCH, GPT_CTX), generator=g) for _ in range(GPT_N)]
    return model, data, lambda model, idx: model.loss(idx, (idx * 7 + 3) % VOCAB).float()


def _convergence(n_micro: int):
    def build():
        from accumkernels.testing import GPT

        from . import convergence as c

        torch.manual_seed(0)
        model = GPT(vocab=256, d=c.D, layers=c.LAYERS, heads=c.HEADS, ctx=c.CTX).to(torch.bfloat16)
        x, y = c.sequences(c.corpus()[0], c.SEQUENCES, torch.Generator().manual_seed(7))
        data = list(zip(x.chunk(n_micro), y.chunk(n_micro)))
        return model, data, lambda model, xy: model.loss(*xy)

    return build


def _convergence_hyper():
    from . import convergence as c

    return dict(lr=c.LR, betas=c.BETAS, weight_decay=c.WEIGHT_DECAY), c.CLIP


# name -> (build, description, (AdamW's hyperparameters, clip norm or None))
CASES = {
    "tiny": (_tiny, f"{LAYERS * 4} bf16 params, micro-batch {MICRO_BATCH}, N = {TINY_N}", None),
    "gpt": (_gpt, f"GPT d={GPT_D} x {GPT_LAYERS}, micro-batch {GPT_BATCH} x {GPT_CTX}, N = {GPT_N}", None),
    "convergence": (_convergence(8), "bench.convergence's model, AdamW and clip, N = 8", _convergence_hyper),
    "convergence-n64": (_convergence(64), "bench.convergence's model, AdamW and clip, N = 64", _convergence_hyper),
}


# short name -> (intake, through the native inbox of csrc/grad_inbox.cpp; False: as
# without the extension, through the Python pre-hooks only)
WRAPPER_PATHS = {"hooks": ("hooks", True), "hooks-python": ("hooks", False), "grad": ("grad", True)}
PATHS = ("plain", *WRAPPER_PATHS)


def paths(case: str, chosen=PATHS) -> dict:
    """name -> a function that runs one window of that path (plain first)."""
    import accumkernels as ak
    from accumkernels.optim import _intake

    build, _, hyper_of = CASES[case]
    hyper, clip = hyper_of() if hyper_of else (dict(lr=1e-4), None)
    plain, data, loss_of = build()
    n = len(data)
    plain_opt = torch.optim.AdamW(plain.parameters(), **hyper)

    def plain_window():
        for x in data:
            (loss_of(plain, x) / n).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
        plain_opt.step()
        plain_opt.zero_grad()

    out = {"plain .grad (bf16)": plain_window}
    for intake, native in (WRAPPER_PATHS[name] for name in chosen if name != "plain"):
        model = build()[0]
        _intake.NATIVE_INBOX = native
        opt = ak.AccumulatingOptimizer(
            torch.optim.AdamW(model.parameters(), **hyper), accum_steps=n, intake=intake, max_grad_norm=clip
        )
        _intake.NATIVE_INBOX = True

        def window(model=model, opt=opt):
            for x in data:
                loss_of(model, x).backward()
                opt.step()
                opt.zero_grad()

        out[f"AccumulatingOptimizer, intake={intake!r}" + ("" if native else ", Python hooks only")] = window
    return out


def interleaved_times(fns: list, *, reps: int, warmup: int) -> list[list[float]]:
    """Each function's wall times over ``reps`` rounds, one run of each per
    round, the order rotating from round to round."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for r in range(reps):
        for i in [(r + k) % len(fns) for k in range(len(fns))]:
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40, help="timed windows per path")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {list(PATHS)} (plain always)")
    parser.add_argument("--results-dir", default=None, help="folder for the JSON (default: bench/results/local)")
    parser.add_argument("--out", default="overhead-cpu")
    args = parser.parse_args(argv)
    chosen = args.paths.split(",")
    unknown = sorted(set(chosen) - set(PATHS))
    if unknown:
        parser.error(f"--paths: unknown {unknown}; choose from {list(PATHS)}")
    device = torch.device("cpu")
    rows = []
    for case in args.cases.split(","):
        runs = paths(case, chosen)
        times = interleaved_times(list(runs.values()), reps=args.windows, warmup=3)
        base = times[0]
        case_rows = [
            dict(
                case=case,
                path=name,
                window_ms=statistics.median(t) * 1e3,
                relative=statistics.median(t) / statistics.median(base),
                paired=statistics.median(a / b for a, b in zip(t, base)),
            )
            for name, t in zip(runs, times)
        ]
        print(f"{CASES[case][1]}, AdamW, {args.windows} windows a path")
        columns = [
            ("path", "path", ""),
            ("window_ms", "ms/window", ".2f"),
            ("relative", "x plain (medians)", ".3f"),
            ("paired", "x plain (paired)", ".3f"),
        ]
        print(common.table(case_rows, columns))
        rows += case_rows
    path = common.write_results(args.out, {"machine": common.machine_record(device), "rows": rows}, args.results_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Kernel benchmark: accumulate_ and the step-and-zero ops against the paths
users write today, with GB/s by a bytes model and the fraction of a ceiling
measured in the same run.

Bytes model (per element, what the pass must move at least):
  add fp32 grad into fp32 buffer      12 = read buffer 4 + read grad 4 + write buffer 4
  add bf16/fp16 grad into fp32 buffer 10 = 4 + 2 + 4
  overwrite from a bf16 grad           6 = read grad 2 + write buffer 4
  AdamW/Adam step, fp32 params        32 = read p, g, m, v (16) + write p, m, v, g=0 (16)
  AdamW step, bf16 params, bf16 state 20 = read p 2, g 4, m 2, v 2 + write p 2, m 2, v 2, g=0 4
                                           (the defaults for bf16 params; 28 with fp32 state)
  ... + int16 remainders, fp32 state  32 = 28 + read and write the remainder (2 + 2)
  ... + fp32 master weights           36 = 28 + read and write the master (4 + 4)
                                           (28's read of p: the step starts from a
                                           param written since, master_or_param)
  torch AdamW, bf16 params and .grad  16 = read p, g, m, v (8) + write p, m, v, g=0 (8)
  SGD step, fp32 params, no momentum  16 = read p, g (8) + write p, g=0 (8)
The torch baselines are charged the same model (their extra passes show up as
lower GB/s). The ceiling is torch's own fp32 ``buf.add_(grad)`` (12 B/element)
on the same device, timed in the same run. On the CPU the AdamW steps are
also timed on one thread over cache-resident tensors (compute_floor): their
arithmetic per element, which bounds a step apart from memory.

Before a backend is timed it is checked on 100003 elements: accumulate_ (bf16
into fp32) and the fp32 AdamW step against float64 and torch; the bf16-param
AdamW steps (each state, master and buffer kind timed) and SGD bit for bit
against the reference backend; grad_norm against float64.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import accumkernels as ak

from . import common


def transformer_shapes(d: int = 512, layers: int = 16, vocab: int = 8192, ctx: int = 1024) -> list[tuple[int, ...]]:
    """The 200 parameter shapes of a GPT-style model: embeddings, 16 blocks of
    12 tensors (LayerNorms, attention, MLP, with biases), final LayerNorm."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,), (vocab, d), (vocab,), (d, d), (d,)]
    return shapes


def _gbs(bytes_per_element: float, numel: int, seconds: float) -> float:
    return bytes_per_element * numel / seconds / 1e9


def _check_accumulate(device, backend, n):
    b = torch.randn(n, device=device)
    g = torch.randn(n, device=device).bfloat16()
    want = b.double() + 0.5 * g.double()
    ak.accumulate_([b], [g], 0.5, backend=backend)
    err = ((b.double() - want).abs() / (want.abs() + 1)).max().item()
    if err > 1e-6:
        raise AssertionError(f"accumulate_ [{backend}] is wrong before timing: relative error {err}")


def _check_adamw(device, backend, n):
    p = torch.randn(n, device=device)
    g = torch.randn(n, device=device)
    ref = torch.nn.Parameter(p.clone())
    ref.grad = g.clone()
    torch.optim.AdamW([ref], lr=1e-3, foreach=False).step()
    m, v, s = torch.zeros_like(p), torch.zeros_like(p), torch.zeros((), device=device)
    ak.adamw_step_and_zero_([p], [g], [m], [v], [s], lr=1e-3, backend=backend)
    torch.testing.assert_close(p, ref.detach(), rtol=2e-6, atol=2e-6)
    if g.any():
        raise AssertionError(f"adamw_step_and_zero_ [{backend}] did not clear the buffer")


def _check_sgd(device, backend, n):
    """SGD's update rounds once, the same way in every backend: the reference's bits."""
    out = {}
    for name in (backend, "reference"):
        gen = torch.Generator().manual_seed(5)
        p, g = torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device)
        ak.sgd_step_and_zero_([p], [g], lr=1e-3, backend=name)
        out[name] = (p, g)
    if not (torch.equal(out[backend][0], out["reference"][0]) and not out[backend][1].any()):
        raise AssertionError(f"sgd_step_and_zero_ [{backend}] differs from the reference before timing")


def _check_grad_norm(device, backend, n):
    """The norm of fp32 and bf16 tensors against float64: one fp32 rounding of
    a float64 sum (relative 2^-24), with room for a float64 summation order."""
    x = torch.randn(n, device=device)
    for t in (x, x.bfloat16()):
        want = torch.linalg.vector_norm(t.double()).item()
        got = ak.grad_norm([t], backend=backend).item()
        if abs(got - want) > 2**-23 * want:
            raise AssertionError(f"grad_norm [{backend}] of a {t.dtype} tensor is {got}, float64 gives {want}")


def _check_bf16_step(device, backend, state_dtype, master_dtype=None, sr=True, grad_dtype=torch.float32, n=100003):
    """Two AdamW steps of bf16 params with moments of ``state_dtype`` (bf16,
    fp32, or uint8: 8-bit codes), master weights of ``master_dtype`` (None,
    int16 remainders or fp32 masters) and a buffer of ``grad_dtype`` (bf16: the
    step reads the gradient, clearing nothing) give the reference backend's
    bits, its rounding stream included."""

    def run(name):
        gen = torch.Generator().manual_seed(7)
        p = torch.randn(n, generator=gen).bfloat16().to(device)
        grads = [(torch.randn(n, generator=gen) * 1e-3).to(device, grad_dtype) for _ in range(2)]
        m, v = torch.zeros(n, device=device, dtype=state_dtype), torch.zeros(n, device=device, dtype=state_dtype)
        scales = {}
        if state_dtype == torch.uint8:
            from accumkernels import _state8

            scales = dict(
                exp_avg_scales=[torch.zeros(_state8.scales_numel(n), device=device)],
                exp_avg_sq_scales=[torch.zeros(_state8.scales_numel(n), device=device)],
            )
        masters = {None: None, torch.int16: torch.zeros_like(p, dtype=torch.int16), torch.float32: p.float()}
        extra = masters[master_dtype]
        step = torch.zeros((), device=device)
        for g in grads:
            ak.adamw_step_and_zero_(
                [p],
                [g],
                [m],
                [v],
                [step],
                **scales,
                lr=1e-3,
                zero_buffers=grad_dtype == torch.float32,
                stochastic_rounding=sr,
                seed=3,
                master_params=None if extra is None else [extra],
                backend=name,
            )
        return [p, m, v, *grads, *scales.get("exp_avg_scales", []), *scales.get("exp_avg_sq_scales", [])] + (
            [] if extra is None else [extra]
        )

    got, want = run(backend), run("reference")
    differ = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    if differ:
        raise AssertionError(
            f"adamw_step_and_zero_ [{backend}] (bf16 params, {state_dtype} state, {master_dtype} master weights, "
            f"{grad_dtype} buffer) differs from the reference before timing: outputs {differ} of "
            "[param, exp_avg, exp_avg_sq, buffers, scales, masters]"
        )


def timed_backends(device: torch.device) -> list[str]:
    """The backends worth timing on ``device``: not the reference (the oracle),
    nor Triton's CPU interpreter (a test vehicle)."""
    return [
        b
        for b in ak.available_backends()
        if b != "reference"
        and ak.backends.BACKENDS[b].supports(device)
        and not (b == "triton" and device.type == "cpu")
    ]


class Group:
    """The cases of one group, timed together in interleaved rounds with a
    ceiling case of its own: on CUDA a device-to-device fp32 copy (8 B/element),
    on the CPU torch's fp32 ``buf.add_(grad)`` (12 B/element)."""

    def __init__(self, name: str, device: torch.device, numel: int) -> None:
        self.name, self.device, self.cases = name, device, []
        a, b = torch.randn(numel, device=device), torch.randn(numel, device=device)
        key = "ceiling" if name == "accumulate" else f"ceiling_{name}"
        if device.type == "cuda":
            self.ceiling_bytes = 8
            self.add(key, "torch fp32 device-to-device copy_ (ceiling)", 8, numel, lambda: a.copy_(b))
        else:
            self.ceiling_bytes = 12
            self.add(key, "torch fp32 buf.add_(fp32 grad) (ceiling)", 12, numel, lambda: a.add_(b))

    def add(self, key, label, bytes_per_element, numel, fn) -> None:
        self.cases.append((key, label, bytes_per_element, numel, fn))

    def time(self, reps: int, rows: list) -> None:
        times = common.interleaved_times([c[4] for c in self.cases], self.device, reps=reps)
        seconds = [statistics.median(t) for t in times]
        ceiling = _gbs(self.ceiling_bytes, self.cases[0][3], seconds[0])
        for (key, label, bpe, n, _), s, t in zip(self.cases, seconds, times):
            gbps = _gbs(bpe, n, s)
            rows.append(
                {
                    "key": key,
                    "group": self.name,
                    "name": label,
                    "bytes_per_element": bpe,
                    "numel": n,
                    "median_ms": s * 1e3,
                    "gbps": gbps,
                    "ceiling_gbps": ceiling,
                    "fraction_of_ceiling": gbps / ceiling,
                    "round_ms": [x * 1e3 for x in t],  # one per interleaved round (headline's paired ratios)
                }
            )
            print(f"  {self.name:10s} {label:66s} {s * 1e3:9.3f} ms {gbps:7.1f} GB/s", flush=True)
        self.cases.clear()


def run(device: torch.device, numel: int, reps: int, quick: bool) -> dict:
    backends = timed_backends(device)
    rows = []

    # ---- one big tensor ---------------------------------------------------
    group = Group("accumulate", device, numel)
    buf = torch.randn(numel, device=device)
    g32 = torch.randn(numel, device=device)
    g16 = {"bf16": g32.bfloat16(), "fp16": g32.half()}
    for name, g in g16.items():
        group.add(f"torch_add_{name}", f"torch buf.add_({name} grad) (mixed dtype)", 10, numel, lambda g=g: buf.add_(g))
    # What autograd does into a bf16 .grad: bf16 += bf16 (and fp32 += fp32 is the ceiling).
    grad_bf16 = g16["bf16"].clone()
    group.add("autograd_bf16", "autograd-style bf16 .grad += bf16 grad", 6, numel, lambda: grad_bf16.add_(g16["bf16"]))
    # What the wrapper's "grad" intake leaves to autograd: a bf16 gradient added
    # into a bf16 param's fp32 .grad (param.grad_dtype = float32), by AccumulateGrad itself.
    if hasattr(torch.Tensor, "grad_dtype"):
        leaf = torch.zeros(numel, device=device, dtype=torch.bfloat16, requires_grad=True)
        leaf.grad_dtype = torch.float32
        leaf.grad = buf
        group.add(
            "autograd_fp32_grad",
            "autograd into fp32 .grad of a bf16 param (intake 'grad')",
            10,
            numel,
            lambda: torch.autograd.backward([leaf], [g16["bf16"]]),
        )
    for backend in backends:
        _check_accumulate(device, backend, 100003)
        for name, g in g16.items():
            group.add(
                f"accumulate_{name}[{backend}]",
                f"accumulate_ {name} -> fp32 [{backend}]",
                10,
                numel,
                lambda g=g, backend=backend: ak.accumulate_([buf], [g], 0.5, backend=backend),
            )
        group.add(
            f"accumulate_fp32[{backend}]",
            f"accumulate_ fp32 -> fp32 [{backend}]",
            12,
            numel,
            lambda backend=backend: ak.accumulate_([buf], [g32], 0.5, backend=backend),
        )
        group.add(
            f"accumulate_overwrite[{backend}]",
            f"accumulate_ bf16 overwrite [{backend}]",
            6,
            numel,
            lambda backend=backend: ak.accumulate_([buf], [g16["bf16"]], 0.5, overwrite=True, backend=backend),
        )
    group.time(reps, rows)
    del buf, g32, g16, group, grad_bf16
    leaf = None

    # ---- a model's parameter list ------------------------------------------
    # d=512: every tensor <= 4M elements; d=2048: the MLP and attention weights
    # hold 12-17M elements each. torch's mixed-dtype add_ behaves very
    # differently on the two (see the README), so both are shown.
    list_cases = [("list512", dict(d=512))] if quick else [("list512", dict(d=512)), ("list2048", dict(d=2048))]
    list_numel = {}
    for key, dims in list_cases:
        shapes = transformer_shapes(**dims)
        if quick:
            shapes = [(max(1, s[0] // 8), *s[1:]) for s in shapes]
        bufs = [torch.randn(s, device=device) for s in shapes]
        grads = [torch.randn(s, device=device).bfloat16() for s in shapes]
        n = list_numel[key] = sum(b.numel() for b in bufs)
        expect = [b.double() + g.double() for b, g in zip(bufs, grads)]
        ak.accumulate_(bufs, grads)
        if any(((b.double() - e).abs() > 1e-6 * (e.abs() + 1)).any() for b, e in zip(bufs, expect)):
            raise AssertionError("accumulate_ on the parameter list is wrong before timing")
        del expect

        def python_loop(bufs=bufs, grads=grads):
            for b, g in zip(bufs, grads):
                b.add_(g)

        tag = f"{len(shapes)} tensors, GPT d={dims['d']}, {n / 1e6:.0f}M elements"
        group = Group(key, device, numel)
        group.add(f"{key}_loop", f"Python loop of buf.add_(bf16 grad), {tag}", 10, n, python_loop)
        group.add(
            f"{key}_foreach",
            f"torch._foreach_add_(bufs, bf16 grads), {tag}",
            10,
            n,
            lambda bufs=bufs, grads=grads: torch._foreach_add_(bufs, grads),
        )
        for backend in backends:
            group.add(
                f"{key}[{backend}]",
                f"accumulate_ one call, {tag} [{backend}]",
                10,
                n,
                lambda bufs=bufs, grads=grads, backend=backend: ak.accumulate_(bufs, grads, backend=backend),
            )
        group.time(reps if n < 2e8 else min(reps, 5), rows)
        del bufs, grads, group

    # ---- optimizer step and zero -------------------------------------------
    group = Group("adamw", device, numel)
    params = [torch.nn.Parameter(torch.randn(numel, device=device) * 0.1)]
    params[0].grad = torch.randn(numel, device=device) * 1e-3
    for impl, flags in (
        ("fused", dict(fused=True)),
        ("foreach", dict(foreach=True)),
        ("for-loop", dict(foreach=False)),
    ):
        opt = torch.optim.AdamW(params, lr=1e-3, **flags)

        def torch_step(opt=opt):
            opt.step()
            opt.zero_grad(set_to_none=False)  # grad.zero_(): the buffer must exist for the next window

        group.add(f"adamw_torch_{impl}", f"torch AdamW({impl}).step() + grad.zero_()", 32, numel, torch_step)
    p, g = params[0].detach(), params[0].grad
    m, v, step = torch.zeros_like(p), torch.zeros_like(p), torch.zeros((), device=device)
    for backend in backends:
        _check_adamw(device, backend, 100003)
        group.add(
            f"adamw[{backend}]",
            f"adamw_step_and_zero_ [{backend}]",
            32,
            numel,
            lambda backend=backend: ak.adamw_step_and_zero_([p], [g], [m], [v], [step], lr=1e-3, backend=backend),
        )
        group.add(
            f"adamw_nozero[{backend}]",
            f"adamw_step_and_zero_ zero_buffers=False [{backend}] (28 B)",
            28,
            numel,
            lambda backend=backend: ak.adamw_step_and_zero_(
                [p], [g], [m], [v], [step], lr=1e-3, zero_buffers=False, backend=backend
            ),
        )
    # bf16 params: the defaults (stochastic rounding, bf16 state) and the master
    # weight options, against torch's fused AdamW on bf16 params, .grad and state.
    bf16_params = [torch.nn.Parameter(torch.randn(numel, device=device).bfloat16())]
    bf16_params[0].grad = (torch.randn(numel, device=device) * 1e-3).bfloat16()
    fused_bf16 = torch.optim.AdamW(bf16_params, lr=1e-3, fused=True)

    def torch_bf16_step():
        fused_bf16.step()
        fused_bf16.zero_grad(set_to_none=False)

    group.add(
        "adamw_torch_fused_bf16",
        "torch AdamW(fused) + grad.zero_(), bf16 params, .grad and state",
        16,
        numel,
        torch_bf16_step,
    )
    pb = bf16_params[0].detach().clone()
    mb, vb = torch.zeros_like(pb), torch.zeros_like(pb)
    m32, v32 = torch.zeros(numel, device=device), torch.zeros(numel, device=device)
    remainders, masters = torch.zeros_like(pb, dtype=torch.int16), pb.float()
    for backend in backends:
        for key, label, bpe, state, extra, sr in (
            ("adamw_bf16_state", "bf16 params, bf16 state, stochastic rounding (defaults)", 20, (mb, vb), None, True),
            ("adamw_bf16_fp32_state", "bf16 params, fp32 state, stochastic rounding", 28, (m32, v32), None, True),
            ("adamw_bf16_remainders", "bf16 params + int16 remainders, fp32 state", 32, (m32, v32), remainders, False),
            ("adamw_bf16_master", "bf16 params + fp32 master weights, fp32 state", 36, (m32, v32), masters, False),
        ):
            _check_bf16_step(device, backend, state[0].dtype, None if extra is None else extra.dtype, sr)
            group.add(
                f"{key}[{backend}]",
                f"adamw_step_and_zero_ {label} [{backend}]",
                bpe,
                numel,
                lambda state=state, extra=extra, sr=sr, backend=backend: ak.adamw_step_and_zero_(
                    [pb],
                    [g],
                    [state[0]],
                    [state[1]],
                    [step],
                    lr=1e-3,
                    stochastic_rounding=sr,
                    seed=3,
                    master_params=None if extra is None else [extra],
                    backend=backend,
                ),
            )
    # 8-bit moments (accumkernels._state8): p r/w 4 + buffer r/w 8 + codes r/w 4
    # + two fp32 scales r/w per block of 256 (16/256) = 16.0625 B/element.
    from accumkernels import _state8

    codes_m, codes_v = torch.zeros_like(pb, dtype=torch.uint8), torch.zeros_like(pb, dtype=torch.uint8)
    scales_m = torch.zeros(_state8.scales_numel(numel), device=device)
    scales_v = torch.zeros_like(scales_m)
    for backend in backends:
        _check_bf16_step(device, backend, codes_m.dtype)
        group.add(
            f"adamw_bf16_8bit[{backend}]",
            f"adamw_step_and_zero_ bf16 params, 8-bit state, stochastic rounding [{backend}]",
            16 + 16 / 256,
            numel,
            lambda backend=backend: ak.adamw_step_and_zero_(
                [pb],
                [g],
                [codes_m],
                [codes_v],
                [step],
                exp_avg_scales=[scales_m],
                exp_avg_sq_scales=[scales_v],
                lr=1e-3,
                stochastic_rounding=True,
                seed=3,
                backend=backend,
            ),
        )
    # No buffer (accum_steps=1): the step reads the bf16 gradient as it is and
    # clears nothing. Bytes: p r/w 4 + gradient read 2, then the defaults'
    # bf16 state r/w 8 (14 B/element), or the 8-bit codes r/w 4 and the scales
    # (10.0625 B/element).
    g16 = g.bfloat16()
    for backend in backends:
        for key, label, bpe, state, scales in (
            ("adamw_bf16_state_bf16_grad", "bf16 state", 14, (mb, vb), {}),
            (
                "adamw_bf16_8bit_bf16_grad",
                "8-bit state",
                10 + 16 / 256,
                (codes_m, codes_v),
                dict(exp_avg_scales=[scales_m], exp_avg_sq_scales=[scales_v]),
            ),
        ):
            _check_bf16_step(device, backend, state[0].dtype, grad_dtype=g16.dtype)
            group.add(
                f"{key}[{backend}]",
                f"adamw_step_and_zero_ bf16 params, {label}, from the bf16 gradient (no buffer) [{backend}]",
                bpe,
                numel,
                lambda state=state, scales=scales, backend=backend: ak.adamw_step_and_zero_(
                    [pb],
                    [g16],
                    [state[0]],
                    [state[1]],
                    [step],
                    **scales,
                    lr=1e-3,
                    zero_buffers=False,
                    stochastic_rounding=True,
                    seed=3,
                    backend=backend,
                ),
            )
    # The same step over a model's 200 tensors, against torch's fused AdamW:
    # GPT d=512 (60M elements) on the CPU, d=2048 (846M) on CUDA.
    d_model = 2048 if device.type == "cuda" and not quick else 512
    shapes = transformer_shapes(d=d_model)
    if quick:
        shapes = [(max(1, s[0] // 8), *s[1:]) for s in shapes]
    model_params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.1) for s in shapes]
    for mp in model_params:
        mp.grad = torch.randn_like(mp) * 1e-3
    list_n = sum(mp.numel() for mp in model_params)
    fused = torch.optim.AdamW(model_params, lr=1e-3, fused=True)

    def torch_list_step():
        fused.step()
        fused.zero_grad(set_to_none=False)

    tag = f"{len(shapes)} tensors, GPT d={d_model}, {list_n / 1e6:.0f}M elements"
    group.add("adamw_list_torch_fused", f"torch AdamW(fused).step() + grad.zero_(), {tag}", 32, list_n, torch_list_step)
    lp = [mp.detach() for mp in model_params]
    lg = [mp.grad for mp in model_params]
    lm, lv = [torch.zeros_like(x) for x in lp], [torch.zeros_like(x) for x in lp]
    ls = [torch.zeros((), device=device) for _ in lp]
    for backend in backends:
        group.add(
            f"adamw_list[{backend}]",
            f"adamw_step_and_zero_, {tag} [{backend}]",
            32,
            list_n,
            lambda backend=backend: ak.adamw_step_and_zero_(lp, lg, lm, lv, ls, lr=1e-3, backend=backend),
        )
    group.time(reps, rows)
    del group, model_params, lp, lg, lm, lv, fused

    group = Group("sgd", device, numel)
    for impl, flags in (
        ("fused", dict(fused=True)),
        ("foreach", dict(foreach=True)),
        ("for-loop", dict(foreach=False)),
    ):
        sgd = torch.optim.SGD(params, lr=1e-3, **flags)

        def torch_sgd(sgd=sgd):
            sgd.step()
            sgd.zero_grad(set_to_none=False)

        group.add(f"sgd_torch_{impl}", f"torch SGD({impl}).step() + grad.zero_()", 16, numel, torch_sgd)
    for backend in backends:
        _check_sgd(device, backend, 100003)
        group.add(
            f"sgd[{backend}]",
            f"sgd_step_and_zero_ [{backend}]",
            16,
            numel,
            lambda backend=backend: ak.sgd_step_and_zero_([p], [g], lr=1e-3, backend=backend),
        )
    group.time(reps, rows)

    # The clipping norm: of the fp32 buffers, and of bf16 gradients held without a buffer
    # (accum_steps=1); beside torch's way to the same float64 sum of a bf16 tensor.
    group = Group("grad_norm", device, numel)
    buffer = torch.randn(numel, device=device)
    grad_bf16 = buffer.bfloat16()
    group.add("norm_torch", "torch vector_norm(fp32 buffer)", 4, numel, lambda: torch.linalg.vector_norm(buffer))
    group.add(
        "norm_torch_bf16_f64",
        "torch vector_norm(bf16 grad, dtype=float64)",
        2,
        numel,
        lambda: torch.linalg.vector_norm(grad_bf16, dtype=torch.float64),
    )
    for backend in backends:
        _check_grad_norm(device, backend, 100003)
        group.add(
            f"norm[{backend}]",
            f"grad_norm(fp32 buffer) [{backend}]",
            4,
            numel,
            lambda b=backend: ak.grad_norm([buffer], backend=b),
        )
        group.add(
            f"norm_bf16[{backend}]",
            f"grad_norm(bf16 grad) [{backend}]",
            2,
            numel,
            lambda b=backend: ak.grad_norm([grad_bf16], backend=b),
        )
    group.time(reps, rows)
    return {"rows": rows, "numel": numel, "list_numel": list_numel}


# The AdamW steps whose arithmetic floor compute_floor measures: (key of the
# same case in run()'s rows, label, param dtype, state: a dtype or "8bit").
FLOOR_CASES = (
    ("adamw", "fp32 params, fp32 state", torch.float32, torch.float32),
    ("adamw_bf16_fp32_state", "bf16 params, fp32 state, stochastic rounding", torch.bfloat16, torch.float32),
    ("adamw_bf16_state", "bf16 params, bf16 state, stochastic rounding (defaults)", torch.bfloat16, torch.bfloat16),
    ("adamw_bf16_8bit", "bf16 params, 8-bit state, stochastic rounding", torch.bfloat16, "8bit"),
)


def compute_floor(backend: str, reps: int, sizes: tuple[int, int] = (2**12, 2**15), inner: int = 32) -> list[dict]:
    """CPU only: each AdamW step's arithmetic cost per element, apart from
    memory: one thread, tensors small enough to stay in the core's cache
    (2^15 elements: under 0.5 MB with fp32 state), as the slope of the call's
    time between two sizes (so the per-call overhead cancels). A step over
    ``numel`` elements on T threads cannot take less than
    ``ns_per_element * numel / T``, however fast the memory: where that exceeds
    the bytes model's time at the ceiling's GB/s, the step is compute-bound."""
    from accumkernels import _state8

    def step_fn(n: int, param_dtype, state):
        p = torch.randn(n).to(param_dtype)
        g = torch.randn(n) * 1e-3
        step = torch.zeros(())
        if state == "8bit":
            m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
            extra = dict(
                exp_avg_scales=[torch.zeros(_state8.scales_numel(n))],
                exp_avg_sq_scales=[torch.zeros(_state8.scales_numel(n))],
            )
        else:
            m, v, extra = torch.zeros(n, dtype=state), torch.zeros(n, dtype=state), {}
        sr = param_dtype == torch.bfloat16

        def fn():
            for _ in range(inner):
                ak.adamw_step_and_zero_(
                    [p], [g], [m], [v], [step], lr=1e-3, stochastic_rounding=sr, seed=3, backend=backend, **extra
                )

        return fn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fns = [step_fn(n, pd, st) for _, _, pd, st in FLOOR_CASES for n in sizes]
        seconds = common.interleaved_medians(fns, torch.device("cpu"), reps=reps)
    finally:
        torch.set_num_threads(threads)
    rows = []
    for i, (key, label, _, _) in enumerate(FLOOR_CASES):
        small, large = seconds[2 * i], seconds[2 * i + 1]
        ns = (large - small) / inner / (sizes[1] - sizes[0]) * 1e9
        rows.append({"key": f"{key}[{backend}]", "name": f"adamw_step_and_zero_ {label}", "ns_per_element": ns})
        print(f"  floor      {label:66s} {ns:9.3f} ns/element (1 thread, in cache)", flush=True)
    return rows


def floor_table(floor_rows: list[dict], rows: list[dict], numel: int, threads: int) -> list[dict]:
    """Each step's measured time beside its arithmetic floor on ``threads``
    threads and its bytes model's time at the same group's ceiling GB/s."""
    by_key = {r["key"]: r for r in rows}
    out = []
    for f in floor_rows:
        r = by_key.get(f["key"])
        if r is None:
            continue
        out.append(
            {
                "name": f["name"],
                "measured_ms": r["median_ms"],
                "floor_compute_ms": f["ns_per_element"] * numel / threads / 1e6,
                "floor_memory_ms": r["bytes_per_element"] * numel / (r["ceiling_gbps"] * 1e9) * 1e3,
            }
        )
    return out


def size_sweep(device: torch.device, sizes: list[int], reps: int) -> list[dict]:
    """accumulate_ (bf16 -> fp32) against torch's mixed-dtype add_ and the
    ceiling, over sizes: GB/s by the same bytes models."""
    rows = []
    for numel in sizes:
        group = Group(f"size-{numel}", device, numel)
        buf = torch.randn(numel, device=device)
        grad = torch.randn(numel, device=device).bfloat16()
        group.add("torch_add_bf16", "torch buf.add_(bf16 grad)", 10, numel, lambda: buf.add_(grad))
        for backend in timed_backends(device):
            group.add(
                f"accumulate_bf16[{backend}]",
                f"accumulate_ bf16 -> fp32 [{backend}]",
                10,
                numel,
                lambda backend=backend: ak.accumulate_([buf], [grad], backend=backend),
            )
        group.time(reps, rows)
        del buf, grad, group
    return rows


# (figure, numerator key, denominator key, compare, target): "gbps" divides
# GB/s (key over key), "time" divides median times (slow key over fast key).
# The targets are those of the issues: CPU (issue 2), CUDA (issue 3), and
# issue 27's for the bf16-state and 8-bit steps on both.
HEADLINE = {
    "cpu": [
        ("accumulate_ bf16 GB/s / ceiling GB/s", "accumulate_bf16[{b}]", "ceiling", "gbps", 0.9),
        ("accumulate_ bf16 speedup vs torch mixed add_", "torch_add_bf16", "accumulate_bf16[{b}]", "time", 4.5),
        ("GPT d=512 list: one call vs Python loop", "list512_loop", "list512[{b}]", "time", 4.0),
        ("GPT d=2048 list: one call vs Python loop", "list2048_loop", "list2048[{b}]", "time", 4.0),
        ("adamw_step_and_zero_ vs torch fused + zero_", "adamw_torch_fused", "adamw[{b}]", "time", 1.1),
        (
            "adamw step, zero_buffers=False vs torch fused + zero_",
            "adamw_torch_fused",
            "adamw_nozero[{b}]",
            "time",
            1.1,
        ),
        ("adamw_step_and_zero_ vs torch foreach + zero_", "adamw_torch_foreach", "adamw[{b}]", "time", 3.0),
        # The "fp32-state step": bf16 params, fp32 state, stochastic rounding (28 B/element).
        (
            "adamw bf16 params: bf16 state GB/s / fp32 state GB/s",
            "adamw_bf16_state[{b}]",
            "adamw_bf16_fp32_state[{b}]",
            "gbps",
            0.9,
        ),
        ("adamw bf16 params + 8-bit state GB/s / ceiling GB/s", "adamw_bf16_8bit[{b}]", "ceiling_adamw", "gbps", 0.85),
        (
            "adamw 8-bit state vs bf16 state (defaults), time",
            "adamw_bf16_state[{b}]",
            "adamw_bf16_8bit[{b}]",
            "time",
            1.0,
        ),
    ],
    "cuda": [
        ("accumulate_ bf16, fraction of copy bandwidth", "accumulate_bf16[{b}]", "ceiling", "gbps", 0.9),
        (
            "accumulate_ 200 tensors (d=2048), fraction of copy bandwidth",
            "list2048[{b}]",
            "ceiling_list2048",
            "gbps",
            0.9,
        ),
        ("accumulate_ 200 tensors vs torch _foreach_add_", "list2048_foreach", "list2048[{b}]", "time", 1.5),
        ("accumulate_ bf16 vs torch mixed add_", "torch_add_bf16", "accumulate_bf16[{b}]", "time", 1.5),
        ("AdamW 200 tensors, fraction of copy bandwidth", "adamw_list[{b}]", "ceiling_adamw", "gbps", 0.9),
        ("AdamW 200 tensors vs torch fused + zero_", "adamw_list_torch_fused", "adamw_list[{b}]", "time", 1.2),
        (
            "AdamW bf16 params + bf16 state, fraction of copy bandwidth",
            "adamw_bf16_state[{b}]",
            "ceiling_adamw",
            "gbps",
            0.9,
        ),
        (
            "AdamW bf16 params + 8-bit state, fraction of copy bandwidth",
            "adamw_bf16_8bit[{b}]",
            "ceiling_adamw",
            "gbps",
            0.85,
        ),
        # Issue #27's item 4, as on the CPU.
        (
            "AdamW bf16 params: bf16 state GB/s / fp32 state GB/s",
            "adamw_bf16_state[{b}]",
            "adamw_bf16_fp32_state[{b}]",
            "gbps",
            0.9,
        ),
        (
            "AdamW 8-bit state vs bf16 state (defaults), time",
            "adamw_bf16_state[{b}]",
            "adamw_bf16_8bit[{b}]",
            "time",
            1.0,
        ),
    ],
}


def headline(result: dict, backend: str, device_type: str) -> list[dict]:
    """The figures the issues set targets for: a's GB/s over b's, or a's time
    over b's (b's speedup), as the median of the per-round ratios where the
    two were timed in the same interleaved rounds (one group), else as the
    ratio of their medians."""
    by_key = {r["key"]: r for r in result["rows"]}
    out = []
    for label, a, b, compare, target in HEADLINE[device_type]:
        ra, rb = by_key.get(a.format(b=backend)), by_key.get(b.format(b=backend))
        if ra is None or rb is None:
            continue
        paired = ra["group"] == rb["group"]
        if compare == "gbps":
            # (bytes_a / t_a) / (bytes_b / t_b) = (t_b / t_a) * bytes_a / bytes_b
            first, second = rb, ra
            scale = ra["bytes_per_element"] * ra["numel"] / (rb["bytes_per_element"] * rb["numel"])
        else:
            first, second, scale = ra, rb, 1.0
        if paired:
            value = common.paired_ratio(first["round_ms"], second["round_ms"]) * scale
        else:
            value = first["median_ms"] / second["median_ms"] * scale
        out.append({"figure": label, "value": value, "target": target, "met": value >= target, "paired": paired})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present, else cpu)")
    parser.add_argument(
        "--numel",
        type=int,
        default=None,
        help="elements of the single-tensor cases (default 32M on the CPU, 64M on CUDA)",
    )
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per case (median reported)")
    parser.add_argument("--quick", action="store_true", help="4M elements, one smaller model list, 5 reps")
    parser.add_argument("--out", default=None, help="results file name (no .json)")
    parser.add_argument("--results-dir", default=None, help="where to write it (default bench/results/local/)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    default_numel = 64 * 2**20 if device.type == "cuda" else 32 * 2**20
    numel, reps = (4 * 2**20, 5) if args.quick else (args.numel or default_numel, args.reps)

    record = common.machine_record(device)
    print(
        f"accumkernels kernel benchmark on {device} ({record['cpu'] if device.type == 'cpu' else record.get('gpu')}), "
        f"{numel} elements, median of {reps}, commit {record['commit']}",
        flush=True,
    )
    result = run(device, numel, reps, args.quick)
    native = "cuda" if device.type == "cuda" else "cpu"
    backend = native if native in ak.available_backends() else None
    heads = headline(result, backend, device.type) if backend else []
    floors = []
    if device.type == "cpu" and backend:
        floor_rows = compute_floor(backend, reps)
        floors = floor_table(floor_rows, result["rows"], numel, torch.get_num_threads())
    payload = {"machine": record, "quick": args.quick, **result, "headline": heads, "floors": floors}
    name = args.out or f"kernels-{device.type}{'-quick' if args.quick else ''}"
    path = common.write_results(name, payload, args.results_dir)

    print()
    print(
        common.table(
            result["rows"],
            [
                ("group", "group", "s"),
                ("name", "path", "s"),
                ("median_ms", "median ms", ".3f"),
                ("bytes_per_element", "B/elem", ".0f"),
                ("gbps", "GB/s", ".1f"),
                ("fraction_of_ceiling", "of ceiling", ".2f"),
            ],
        )
    )
    ceiling = (
        "a device-to-device fp32 copy_ (8 B/element)"
        if device.type == "cuda"
        else "torch's fp32 buf.add_(grad) (12 B/element)"
    )
    print(f"\nceiling: {ceiling}, timed in each group, interleaved with its cases")
    if floors:
        print()
        print(
            common.table(
                floors,
                [
                    ("name", f"AdamW step, {numel} elements, {torch.get_num_threads()} threads", "s"),
                    ("measured_ms", "measured ms", ".2f"),
                    ("floor_compute_ms", "arithmetic floor ms", ".2f"),
                    ("floor_memory_ms", "bytes at ceiling ms", ".2f"),
                ],
            )
        )
        print("arithmetic floor: ns/element on one thread in cache (compute_floor) x elements / threads")
    print()
    print(
        common.table(
            heads,
            [
                ("figure", f"headline [{backend}]", "s"),
                ("value", "value", ".2f"),
                ("target", "target", ".2f"),
                ("met", "met", ""),
            ],
        )
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

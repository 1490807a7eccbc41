"""The installed package as a user gets it (run by .ci/run from outside the
source tree, with the wheel installed into a folder of its own on PYTHONPATH):
it is imported from there, its native ops load, and one window of
accumkernels.AdamW trains with each backend present, equal to torch's AdamW on
the same window gradient within the fused step's rounding (8 fp32 ulps)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # Triton runs on CPU tensors only in its interpreter

import torch

import accumkernels as ak

target = Path(sys.argv[1]).resolve()
where = Path(ak.__file__).resolve()
assert target in where.parents, f"accumkernels was imported from {where}, not from the installed {target}"
from accumkernels import _native  # noqa: E402

_native.require()  # the compiled ops are in the wheel and load
backends = ak.available_backends()
assert {"reference", "cpu"} <= set(backends), backends
for backend in backends:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and backend in ("cuda", "triton", "reference") else [])
    for device in devices:
        if backend == "cuda" and device == "cpu":
            continue
        torch.manual_seed(0)
        models = [
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
            for _ in range(2)
        ]
        models[1].load_state_dict(models[0].state_dict())
        ours = ak.AdamW(models[0].parameters(), lr=1e-2, accum_steps=4, backend=backend)
        plain = torch.optim.AdamW(models[1].parameters(), lr=1e-2)
        batches = [(torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)) for _ in range(4)]
        for x, y in batches:
            torch.nn.functional.mse_loss(models[0](x), y).backward()
            ours.step()
            (torch.nn.functional.mse_loss(models[1](x), y) / 4).backward()
        plain.step()
        assert ours.window_stepped
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            bound = 8 * torch.finfo(torch.float32).eps * b.detach().abs().max()
            assert (a - b).abs().max() <= bound, (backend, device, (a - b).abs().max().item())
        print(
            f"installed accumkernels {ak.__version__ if hasattr(ak, '__version__') else ''} from {where.parent}: "
            f"one window with backend {backend!r} on {device} equals torch AdamW"
        )

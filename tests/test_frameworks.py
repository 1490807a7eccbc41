"""AccumulatingOptimizer inside the frameworks people train with, against the
plain AdamW run through the same framework (tests/framework_runs.py): HF
Trainer (transformers 5.x, and 4.x where installed beside it), PEFT LoRA,
Accelerate, Lightning ("32", "bf16-mixed", "16-mixed", manual optimization,
BackboneFinetuning's add_param_group),
a GradScaler the wrapper was not given, and 2-process runs (DDP on gloo) of
Accelerate and HF Trainer. Clipping is on and active everywhere. The
frameworks' checkpoints also carry 8-bit state (codes and scales) across a
resume.

The framework packages are test dependencies (make test installs them); where
one is missing its tests skip, unless ACCUMKERNELS_REQUIRE_FRAMEWORKS=1 (set
by make test), where that is an error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMERS4 = ROOT / ".venv" / "transformers4"  # transformers 4.x, installed beside 5.x by make test
REQUIRED = os.environ.get("ACCUMKERNELS_REQUIRE_FRAMEWORKS", "") == "1"


def needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing and REQUIRED:
        pytest.fail(f"framework packages missing: {missing} (ACCUMKERNELS_REQUIRE_FRAMEWORKS=1)")
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {missing}")


def run(name: str, *, pythonpath: str | None = None, **options) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pythonpath, str(ROOT)]))}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "framework_runs.py"), name, json.dumps(options)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def launch(name: str, tmp_path, world: int = 2, **options) -> list[dict]:
    """``torchrun --nproc-per-node world`` on the CPU (gloo); every rank's result."""
    result = tmp_path / "result"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AK_RESULT_FILE": str(result), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world}",
        "--standalone",
        str(ROOT / "tests" / "framework_runs.py"),
        name,
        json.dumps(options),
    ]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(Path(f"{result}.rank{r}").read_text()) for r in range(world)]


def rel_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(
        (torch.tensor(x) - torch.tensor(y)).abs().max().item() / max(torch.tensor(y).abs().max().item(), 1e-12)
        for x, y in zip(a, b)
    )


def summation_rtol(n: int) -> float:
    """How far two fp32 computations of the norm of the same n values may differ
    when they sum in other orders (vectorized loops split by alignment and
    ISA): each is within gamma_n = n u / (1 - n u) of the exact sum of squares
    (u = 2^-24, Higham), so their norms within gamma_n of each other."""
    u = 2.0**-24
    return n * u / (1 - n * u)


def assert_same_training(result: dict, norms: str = "grad_norms") -> None:
    plain, ours = result["plain"], result["ours"]
    assert rel_diff(ours["params"], plain["params"]) <= 1e-5
    assert plain[norms] and all(n is not None and n > 0.05 for n in plain[norms]), "clipping must be active"
    torch.testing.assert_close(torch.tensor(ours[norms]), torch.tensor(plain[norms]), rtol=1e-5, atol=0)


@needs("accelerate")
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_clip_grad_norm(mixed_precision):
    assert_same_training(run("accelerate_loop", mixed_precision=mixed_precision))


@needs("accelerate")
def test_accelerate_sees_a_skipped_window():
    result = run("accelerate_skipped_window")
    assert result["ours"]["skipped"] == result["plain"]["skipped"] == [True, False]
    assert result["ours"]["scale"] == result["plain"]["scale"] == 2.0**9
    assert rel_diff(result["ours"]["params"], result["plain"]["params"]) <= 1e-5


@needs("pytorch_lightning")
@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed"])
def test_lightning(precision):
    """Lightning's gradient_clip_val and grad_norm() act on the window's
    gradient, whatever its precision plugin (16-mixed brings its own GradScaler)."""
    result = run("lightning", precision=precision)
    if precision == "16-mixed":
        assert result["ours"]["scaler"] == "GradScaler"
    assert_same_training(result, norms="logged_norms")


@needs("pytorch_lightning")
def test_lightning_manual_clip_through_its_optimizer_proxy():
    """self.optimizers() is Lightning's proxy, which copies the optimizer's
    attributes: clip_grad_norm_ on it must still clip (and return the norm)."""
    result = run("lightning", precision="32", manual=True)
    assert_same_training(result, norms="norms")
    torch.testing.assert_close(
        torch.tensor(result["ours"]["logged_norms"]), torch.tensor(result["plain"]["logged_norms"]), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("loop", ["docs-loop", "wrapper-counts"])
def test_gradscaler_not_given_to_the_wrapper(loop):
    result = run("own_loop_scaler", loop=loop)
    assert result["ours"]["scales"] == result["plain"]["scales"]
    assert result["plain"]["scales"][0] == 2.0**11, "the poisoned window backs the scale off"
    assert rel_diff(result["ours"]["params"], result["plain"]["params"]) <= 1e-5


@needs("pytorch_lightning")
def test_lightning_builds_the_class():
    """configure_optimizers returns accumkernels.AdamW with a scheduler dict;
    resuming from a checkpoint equals the straight run."""
    result = run("lightning_class")
    assert_same_training(result, norms="logged_norms")
    assert rel_diff(result["ours"]["resumed"], result["ours"]["params"]) <= 1e-6
    assert rel_diff(result["plain"]["resumed"], result["plain"]["params"]) <= 1e-6


@needs("pytorch_lightning")
def test_lightning_backbone_finetuning_adds_a_param_group():
    """BackboneFinetuning unfreezes the backbone at the second epoch and adds it
    to the optimizer with add_param_group: the run trains as torch.optim's;
    resumed from Lightning's checkpoint (where the callback assigns the saved
    groups to optimizer.param_groups) it trains as torch.optim's resumed run."""
    result = run("lightning_finetuning")
    assert result["ours"]["groups"] == result["plain"]["groups"] == [[2, 0.01], [4, 0.0015]]
    assert_same_training(result, norms="logged_norms")
    assert result["ours"]["resumed_groups"] == result["plain"]["resumed_groups"]
    assert rel_diff(result["ours"]["resumed"], result["plain"]["resumed"]) <= 1e-5


@needs("accelerate")
def test_accelerate_saves_and_loads_the_class():
    result = run("accelerate_state")
    plain, ours = result["plain"], result["ours"]
    assert rel_diff(ours["params"], plain["params"]) <= 1e-5
    assert rel_diff(ours["resumed"], ours["params"]) <= 1e-6
    assert rel_diff(plain["resumed"], plain["params"]) <= 1e-6


EIGHT_BIT_STATE = [
    "exp_avg_codes:uint8",
    "exp_avg_scales:float32",
    "exp_avg_sq_codes:uint8",
    "exp_avg_sq_scales:float32",
    "step:float32",
]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("hf_trainer_class", marks=needs("transformers", "accelerate")),
        pytest.param("lightning_class", marks=needs("pytorch_lightning")),
        pytest.param("accelerate_state", marks=needs("accelerate")),
    ],
)
def test_8bit_state_resumes_through_the_framework(name):
    """The class with state_dtype="8bit", built and checkpointed by the
    framework (HF Trainer on bf16 params, Lightning, Accelerate): the
    checkpoint holds the codes and scales, and resuming from it trains to the
    straight run's params bit for bit (the moments' codes and the stochastic
    roundings' draws continue where they stopped)."""
    result = run(name, state_dtype="8bit")
    plain, ours = result["plain"], result["ours"]
    assert ours["state"] == EIGHT_BIT_STATE
    assert "exp_avg:float32" in plain["state"] or "exp_avg:bfloat16" in plain["state"]
    assert ours["resumed"] == ours["params"]
    assert ours["params"] != plain["params"]  # the 8-bit moments are not torch's fp32 ones
    if name == "hf_trainer_class":
        assert ours["class"] == "AdamW" and ours["lrs"] == plain["lrs"]
        assert ours["weight_decays"] == plain["weight_decays"] == [0.0, 0.1]


@needs("transformers", "accelerate", "pytorch_lightning")
def test_accum_steps_while_the_framework_counts_is_refused():
    """accum_steps=4 in the wrapper while HF Trainer, Accelerate or Lightning
    accumulate over 4 batches too: a window of 16, the scheduler and clipping at
    the wrong cadence, norms logged as 0. Each run stops at its first step()
    with an error naming accum_steps=None, before any param moved. In
    Lightning's manual optimization, where the framework refuses
    accumulate_grad_batches, the error says to step every N-th batch (before
    2026-12-07 it named only the setting Lightning refuses there)."""
    errors = run("accum_steps_under_frameworks")
    for framework, setting in (
        ("lightning", "accumulate_grad_batches"),
        ("lightning_manual", "in manual optimization, call opt.step() and opt.zero_grad() every N-th batch"),
        ("accelerate", "gradient_accumulation_steps"),
        ("hf_trainer", "gradient_accumulation_steps"),
    ):
        assert errors[framework] is not None and "accum_steps=None" in errors[framework], (framework, errors[framework])
        assert setting in errors[framework]
    assert not errors["lightning_moved"]


@pytest.mark.slow
@needs("accelerate")
def test_accelerate_on_two_processes(tmp_path):
    ranks = launch("accelerate_loop", tmp_path)
    assert ranks[0]["ours"]["world"] == 2
    for r in ranks:
        assert_same_training(r)
    assert ranks[0]["ours"]["params"] == ranks[1]["ours"]["params"]


class TestHuggingFace:
    """HF Trainer (transformers 5.x and 4.x), PEFT, the class built by Trainer,
    two processes. (A class: pytest-xdist runs it apart from the module's other tests.)"""

    @needs("transformers", "accelerate")
    @pytest.mark.parametrize("max_grad_norm", [0.05, 0.0], ids=["clip-staged-unfreezing", "no-clip"])
    def test_hf_trainer(self, max_grad_norm):
        """Trainer clips .grad and logs its norm: both act on the window's
        gradient. With clipping, the embedding is also frozen for the first step
        and unfrozen by a callback (staged fine-tuning): trained as plain AdamW."""
        result = run("hf_trainer", max_grad_norm=max_grad_norm, unfreeze=bool(max_grad_norm))
        assert result["ours"]["intake"] == "grad"
        plain, ours = result["plain"], result["ours"]
        assert rel_diff(ours["params"], plain["params"]) <= 1e-5
        assert ours["lrs"] == plain["lrs"]
        if max_grad_norm:
            assert_same_training(result)
        else:  # what plain logs without clipping, ours logs too: the same gradients, their norm summed in another order
            n = sum(len(p) for p in plain["params"])
            torch.testing.assert_close(
                torch.tensor(ours["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=summation_rtol(n), atol=0
            )

    @pytest.mark.slow
    @needs("accelerate")
    @pytest.mark.skipif(
        not (TRANSFORMERS4 / "transformers").exists() and not REQUIRED,
        reason=f"transformers 4.x is not installed in {TRANSFORMERS4}",
    )
    def test_hf_trainer_transformers_4(self):
        result = run("hf_trainer", pythonpath=str(TRANSFORMERS4), max_grad_norm=0.05)
        assert_same_training(result)

    @needs("transformers", "accelerate", "peft")
    def test_peft_lora_under_hf_trainer(self):
        """Only the adapters are trainable and given to the optimizer."""
        assert_same_training(run("hf_trainer", max_grad_norm=0.05, peft=True))

    @needs("transformers", "accelerate")
    def test_hf_trainer_builds_the_class(self):
        """HF Trainer builds accumkernels.AdamW from optimizer_cls_and_kwargs with its
        own param groups (no decay on biases and norms), cosine schedule with
        warm-up, clipping, bf16; resume_from_checkpoint mid-training equals the
        straight run. Against Trainer's default AdamW through the same path."""
        result = run("hf_trainer_class")
        plain, ours = result["plain"], result["ours"]
        assert ours["class"] == "AdamW" and ours["weight_decays"] == plain["weight_decays"] == [0.0, 0.1]
        assert ours["lrs"] == plain["lrs"] and plain["lrs"][0] < plain["lrs"][1], "warm-up"
        assert_same_training(result)
        assert rel_diff(ours["resumed"], ours["params"]) <= 1e-6
        assert rel_diff(plain["resumed"], plain["params"]) <= 1e-6

    @pytest.mark.slow
    @needs("transformers", "accelerate")
    def test_hf_trainer_on_two_processes(self, tmp_path):
        ranks = launch("hf_trainer", tmp_path, max_grad_norm=0.05)
        for r in ranks:
            assert_same_training(r)
        assert ranks[0]["ours"]["params"] == ranks[1]["ours"]["params"]

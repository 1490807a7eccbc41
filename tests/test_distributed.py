"""AccumulatingOptimizer across processes (gloo on the CPU): W ranks of N
micro-steps equal one process stepping on the W*N micro-batches, in all-reduce
and sharded mode; one collective per bucket per window and none on the other
micro-steps; an inf on one rank skips the window everywhere; resume mid-window.

The scenarios run in tests/distributed_worker.py: one spawn of 2 ranks and one
of 4 run every case (process start-up dominates), and the tests below check
what each rank returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import distributed_worker as worker
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import NATIVE_SKIPPED, SEED
from helpers import assert_windows_within_bound, exact_window_norm

import accumkernels as ak

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

BACKEND = "reference" if NATIVE_SKIPPED else "cpu"
PARITY = {
    f"{mode}-{opt}": dict(scenario="parity", optimizer=opt, sharded=(mode == "sharded"), clip=clip)
    for mode in ("allreduce", "sharded")
    for opt, clip in (("adamw", 0.5), ("sgd", None))
}
CASES_2 = {
    **PARITY,
    "allreduce-items": dict(scenario="parity", optimizer="adamw", normalize="items"),
    # a counted window with intake "grad" (its .grad the buffers the reduction writes into)
    "allreduce-grad-intake": dict(scenario="parity", optimizer="sgd", intake="grad", clip=0.5),
    "sharded-items": dict(scenario="parity", optimizer="sgd", normalize="items", sharded=True, clip=0.5),
    "allreduce-bf16wire": dict(scenario="wire", optimizer="sgd", wire_dtype=torch.bfloat16),
    "sharded-bf16wire": dict(scenario="wire", optimizer="sgd", wire_dtype=torch.bfloat16, sharded=True),
    "count-allreduce": dict(scenario="count", optimizer="adamw"),
    "count-sharded": dict(scenario="count", optimizer="adamw", sharded=True),
    "count-sharded-clip": dict(scenario="count", optimizer="adamw", sharded=True, clip=0.5),
    "count-allreduce-bf16wire": dict(scenario="count", optimizer="sgd", wire_dtype=torch.bfloat16),
    "inf-allreduce": dict(scenario="inf_skip", optimizer="adamw", skip_nonfinite=True),
    "inf-sharded-scaler": dict(scenario="inf_skip", optimizer="adamw", sharded=True, with_scaler=True),
    "resume-allreduce": dict(scenario="resume", optimizer="adamw", clip=0.5),
    "resume-sharded-bf16-master": dict(
        scenario="resume", optimizer="adamw", sharded=True, dtype=torch.bfloat16, master_weights=True
    ),
    # bf16 params with the defaults (stochastic rounding, bf16 state) and with remainders
    "resume-sharded-bf16-defaults": dict(scenario="resume", optimizer="adamw", sharded=True, dtype=torch.bfloat16),
    "resume-allreduce-bf16-remainders": dict(
        scenario="resume", optimizer="sgd", dtype=torch.bfloat16, master_weights="remainders"
    ),
    # 8-bit state under ZeRO-1: each rank's blocks cover its own shard (never a shard boundary)
    "resume-sharded-8bit": dict(
        scenario="resume", optimizer="adamw", sharded=True, dtype=torch.bfloat16, state_dtype="8bit"
    ),
    "ddp": dict(scenario="ddp_taken_over", optimizer="adamw"),
    "framework-loop": dict(scenario="framework_loop", optimizer="adamw", clip=0.05),
    "framework-loop-bucket-views": dict(
        scenario="framework_loop", optimizer="adamw", clip=0.05, ddp_kwargs=dict(gradient_as_bucket_view=True)
    ),
    # the same loop without DDP: each backward is reduced, so the clip sees the global norm too
    "plain-module-loop": dict(scenario="framework_loop", optimizer="adamw", clip=0.05, ddp=False),
    "misuse": dict(scenario="misuse", optimizer="sgd"),
    "dcp": dict(scenario="dcp", optimizer="adamw"),
    "ddp-join": dict(scenario="ddp_join", optimizer="sgd"),
    "ddp-comm-hook": dict(scenario="ddp_comm_hook", optimizer="sgd"),
    "zero-redundancy": dict(scenario="zero_redundancy", optimizer="adamw"),
    "add-group": dict(scenario="add_group", optimizer="adamw"),
    "modes-agree": dict(scenario="modes_agree", optimizer="adamw"),
}
CASES_4 = PARITY
WORKER_SEED = SEED % 2**20  # the workers' micro-batches are drawn from it


def spawn(world: int, cases: dict, main=worker.main) -> list[dict]:
    """Run ``cases`` on ``world`` gloo ranks (``main``: a worker's entry); every rank's results."""
    cases = {k: dict(v, seed=WORKER_SEED, backend=BACKEND) for k, v in cases.items()}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(main, args=(world, os.path.join(tmp, "init"), tmp, cases), nprocs=world)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs():
    return {2: spawn(2, CASES_2), 4: spawn(4, CASES_4)}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def assert_steps_exact_to_fp32(result, case: str, world: int, loss_divisor: int = 1) -> None:
    """Every window of ``result``'s trajectory is the exact step on all ranks'
    micro-batches (clipped as the case clips), to the fp32 error bound
    (tests/helpers.py)."""
    cfg = dict(CASES_2[case], seed=WORKER_SEED)
    assert_windows_within_bound(
        result["trajectory"],
        worker.window_gradients(cfg, world, loss_divisor),
        worker.make_optimizer(cfg["optimizer"], [torch.zeros(1)]),
        clip=cfg.get("clip"),
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(PARITY))
def test_ranks_equal_single_process_big_batch(runs, world, case):
    ranks = runs[world]
    results = [r[case] for r in ranks]
    assert results[0]["buckets"] > 2  # the toy model spans several buckets
    for r in results[1:]:
        assert same(r["params"], results[0]["params"])  # every rank holds the same params
    assert_steps_exact_to_fp32(results[0], case, world)


def test_a_counted_window_with_intake_grad_equals_the_big_batch(runs):
    """accum_steps=N, intake "grad", on ranks whose micro-batches reach
    different params: every window is the exact step on all ranks'
    micro-batches, clipped by max_grad_norm=; the reduction's and the
    clip's own writes into .grad are no edit of the window's sum (nothing
    refused: GradIntake._note_edited_sums)."""
    results = [r["allreduce-grad-intake"] for r in runs[2]]
    assert same(results[1]["params"], results[0]["params"])
    assert_steps_exact_to_fp32(results[0], "allreduce-grad-intake", 2)


@pytest.mark.parametrize("case", ["allreduce-items", "sharded-items"])
def test_items_are_summed_across_ranks(runs, case):
    results = [r[case] for r in runs[2]]
    assert same(results[1]["params"], results[0]["params"])
    assert_steps_exact_to_fp32(results[0], case, 2)


@pytest.mark.parametrize("mode", ["allreduce", "sharded"])
def test_bf16_wire_rounds_each_contribution_once(runs, mode):
    """Each rank's contribution is rounded to bf16 once (relative error <= u =
    2^-8, bf16's unit roundoff: 8 significant bits), the contributions are
    summed in fp32, and in all-reduce mode the sum is rounded to bf16 once more
    to be gathered:
        |got - exact| <= u * sum_r |c_r| (+ u * (|sum| + u * sum_r |c_r|)) + fp32 summation error."""
    results = [r[f"{mode}-bf16wire"] for r in runs[2]]
    world = len(results)
    n = results[0]["flat"].numel()
    contributions = torch.stack([worker.wire_contribution(WORKER_SEED, r, n).double() for r in range(world)])
    exact, magnitude = contributions.sum(0), contributions.abs().sum(0)
    u = 2.0**-8
    bound = u * magnitude + world * 2.0**-24 * magnitude
    if mode == "allreduce":
        bound = bound + u * (exact.abs() + u * magnitude)
    worst = 0.0
    for rank, result in enumerate(results):
        got = result["flat"].double()
        regions = [tuple(s) for s in result["shards"]] if result["shards"] else [(0, n)]
        for lo, hi in regions:
            err = (got[lo:hi] - exact[lo:hi]).abs()
            assert (err <= bound[lo:hi]).all(), f"rank {rank}: error {(err / bound[lo:hi]).max().item():.2f}x the bound"
            worst = max(worst, (err / exact[lo:hi].abs().clamp_min(1e-30)).max().item())
    # fp32 on the wire would leave ~2^-24 relative: bf16 leaves errors near 2^-8.
    assert worst > 2.0**-12, "the wire does not look bf16"


def test_one_collective_per_bucket_per_window(runs):
    for rank in runs[2]:
        for case, per_bucket, extra in (
            ("count-allreduce", {"all_reduce": 1}, {"all_reduce": 1}),  # + the window's flags/counts
            ("count-sharded", {"reduce_scatter": 1, "all_gather": 1}, {"all_reduce": 1}),
            ("count-sharded-clip", {"reduce_scatter": 1, "all_gather": 1}, {"all_reduce": 2}),  # + norm
            ("count-allreduce-bf16wire", {"all_to_all": 1, "all_gather": 1}, {"all_reduce": 1}),
        ):
            result = rank[case]
            buckets = result["buckets"]
            for i, calls in enumerate(result["per_micro"]):
                if (i + 1) % worker.N_MICRO:
                    assert calls == {}, (case, i, calls)  # no communication inside a window
                    continue
                expected = {k: v * buckets for k, v in per_bucket.items()}
                for k, v in extra.items():
                    expected[k] = expected.get(k, 0) + v
                assert calls == expected, (case, i, calls, expected)


def test_buckets_are_reduced_during_the_last_backward(runs):
    """Bucket collectives are launched during the last micro-step's backward as
    soon as a bucket and all before it are complete: on rank 1 (every param gets
    a gradient) all of them; on rank 0 all but the last buckets, which hold the
    head rank 0 never uses and are launched by step()."""
    for rank, results in enumerate(runs[2]):
        result = results["count-allreduce"]
        buckets, side = result["buckets"], result["side_buckets"]
        assert 0 < side < buckets
        expected = buckets if rank % 2 else buckets - side
        assert result["in_backward"] == [0, 0, expected] * 2


@pytest.mark.parametrize("case", ["inf-allreduce", "inf-sharded-scaler"])
def test_inf_on_one_rank_skips_the_window_on_all(runs, case):
    results = [r[case] for r in runs[2]]
    for r in results:
        before, skipped, after = r["after"]
        assert same(skipped, before)  # window 1 (rank 1 saw an inf) left every param as it was
        assert not same(after, skipped)  # window 2 stepped
        assert same(r["after"][2], results[0]["after"][2])
    if case.endswith("scaler"):  # every rank's scaler backed off once, together
        assert [r["scale"] for r in results] == [2.0**9, 2.0**9]


@pytest.mark.parametrize(
    "case",
    [
        "resume-allreduce",
        "resume-sharded-bf16-master",
        "resume-sharded-bf16-defaults",
        "resume-allreduce-bf16-remainders",
        "resume-sharded-8bit",
    ],
)
def test_resume_mid_window_with_two_ranks(runs, case):
    for r in runs[2]:
        result = r[case]
        assert result["micro_steps_saved"] == 2
        assert same(result["resumed"], result["straight"])  # bitwise
    assert same(runs[2][0][case]["straight"], runs[2][1][case]["straight"])  # every rank holds the same params


def test_ddp_is_taken_over(runs):
    """DDP made before or after the wrapper: DDP's reducer sends nothing, the
    wrapper reduces once per window, each window steps on all ranks' micro-batches."""
    results = [r["ddp"] for r in runs[2]]
    for order in ("ddp-first", "optimizer-first"):
        assert all(r[order]["ddp_calls"] == 0 for r in results), order
        assert same(results[1][order]["params"], results[0][order]["params"])
        assert_steps_exact_to_fp32(results[0][order], "ddp", 2)


@pytest.mark.parametrize("case", ["framework-loop", "framework-loop-bucket-views", "plain-module-loop"])
def test_framework_loop_over_ddp(runs, case):
    """no_sync() micro-steps, the loss divided by N, torch's clip_grad_norm_ on
    .grad after the last backward: the clipped norm is the global one and each
    window steps on all ranks' micro-batches (clipping active: norms above 0.05);
    DDP with gradient_as_bucket_view=True too (a param only odd ranks use kept
    DDP's view of a stale copy as .grad on even ranks, which stepped on it);
    and the loop on the plain module, no DDP, whose every backward is reduced
    (before, the reduction waited for step() and the clip used each rank's own
    norm: 0.29 and 0.49 where the global one was 0.27, in test_contract's loop).
    The norm logged is of a sum within gamma_{n+2} of the exact one, computed
    in fp32 over the model's 618 elements: within 1e-5 relative."""
    results = [r[case] for r in runs[2]]
    ours = results[0]
    assert ours["intake"] == "grad"
    assert all(r["ddp_calls"] == 0 for r in results)
    assert same(results[1]["params"], ours["params"])
    gradients = worker.window_gradients(dict(CASES_2[case], seed=WORKER_SEED), 2, worker.N_MICRO)
    exact_norms = [exact_window_norm(*gradients(w, params)) for w, params in enumerate(ours["trajectory"][:-1])]
    assert min(exact_norms) > 0.05
    for r in results:
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(exact_norms), rtol=1e-5, atol=0)
    assert_steps_exact_to_fp32(ours, case, 2, worker.N_MICRO)


def test_sharded_equals_allreduce_bitwise_with_mixed_dtypes(runs):
    for r in runs[2]:
        result = r["modes-agree"]
        assert result["gather_dtypes"] == ["torch.bfloat16", "torch.float32"]  # both gather paths ran
        assert same(result["sharded"], result["allreduce"])
    assert same(runs[2][0]["modes-agree"]["sharded"], runs[2][1]["modes-agree"]["sharded"])


def test_misuse_during_the_reduction_is_refused(runs):
    for r in runs[2]:
        errors = r["misuse"]["errors"]
        for name in ("state_dict", "accumulated_grad"):
            assert "being reduced across ranks" in errors[name], errors[name]
        assert "max_grad_norm=" in errors["clip_grad_norm_"]
        assert "across ranks" in errors["zero_grad"] and "intake='grad'" in errors["zero_grad"], errors["zero_grad"]
        assert "cross-rank reduction has already started" in errors["second_backward"]
        assert "got 2 gradients since the last step()" in errors["step"]
        assert "wire_dtype=torch.bfloat16" in errors["bf16_wire_second_backward"]
        assert r["misuse"]["micro_steps"] == worker.N_MICRO - 1  # nothing stepped


def test_ddp_join_is_refused_on_every_rank(runs):
    for r in runs[2]:
        for order, error in r["ddp-join"].items():
            assert error is not None and "DistributedDataParallel.join()" in error, (order, error)


def test_torchs_zero_redundancy_optimizer_is_refused_naming_sharded(runs):
    """ZeroRedundancyOptimizer(optimizer_class=accumkernels.AdamW) builds the
    optimizer over each rank's share of the params: refused at its
    construction on every rank, naming sharded=True. Before, where the ranks'
    shares held the same shapes and values (two layers that start equal), it
    was built and summed the gradients of different layers: 0.11 off
    torch.optim.AdamW under ZeroRedundancyOptimizer after 6 steps, silently
    (other shares were refused by the replica checks, naming pipeline stages)."""
    for r in runs[2]:
        result = r["zero-redundancy"]
        assert len(result["errors"]) == 3
        for case, error in result["errors"].items():
            assert error is not None and "ZeroRedundancyOptimizer" in error and "sharded=True" in error, (case, error)
        assert result["sharded_steps"]


def test_a_ddp_comm_hook_is_refused_on_every_rank(runs):
    """It would never run (the wrapper reduces the fp32 sums itself): refused
    at construction, at the first forward (again when retried), and at its
    registration after a window, before anything is touched."""
    for r in runs[2]:
        result = r["ddp-comm-hook"]
        assert len(result["errors"]) == 7
        for case, error in result["errors"].items():
            assert error is not None and "comm hook" in error and "wire_dtype=torch.bfloat16" in error, (case, error)
        assert "fp16_compress_hook" in result["errors"]["fp16-ddp-first"]
        assert "FP16_COMPRESS" in result["errors"]["fp16-builtin-optimizer-first-first"]
        assert result["untouched"]


def test_distributed_checkpoint(runs):
    """All-reduce mode resumes bitwise through DCP (fp32 masters of bf16
    params included); ZeRO-1 state is refused by name."""
    for r in runs[2]:
        result = r["dcp"]
        assert result["same"]
        assert "sharded=True (ZeRO-1)" in result["sharded_error"], result["sharded_error"]
        assert result["per_rank"]


def test_add_param_group_across_ranks(runs):
    """Every rank adds the group after the first window: bit for bit the run
    that held it from the start; with sharded=True it is refused, nothing changed."""
    for r in runs[2]:
        result = r["add-group"]
        assert same(result["late"], result["built"])
        assert "sharded=True (ZeRO-1)" in result["sharded_error"] and result["sharded_groups"] == 1
    assert not same(runs[2][0]["add-group"]["late"][:2], [p.detach() for p in worker.Net().side.parameters()])


def test_distributed_options_need_a_process_group():
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="sharded=True and wire_dtype need torch.distributed"):
        ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sharded=True)
    with pytest.raises(ValueError, match="wire_dtype must be"):
        ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), wire_dtype=torch.float16)
    with pytest.raises(ValueError, match="process_group was given"):
        ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), process_group=object())


ROOT = Path(__file__).resolve().parent.parent


def torchrun(args: list[str]) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "train_gpt_distributed.py"),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--sharded", "--fsdp"])
def test_example_runs_under_torchrun_and_resumes_mid_window(tmp_path, mode):
    """The example script, 2 ranks, ZeRO-1 or FSDP2: a run that checkpoints
    mid-window, then a restart from that checkpoint logs the same windows."""
    args = ["--windows", "6", "--width", "32", "--ctx", "16", "--micro-batch", "2", mode, "--checkpoint", str(tmp_path)]
    first = torchrun(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt", "rank1.pt"]
    second = torchrun(args)
    assert "resumed at micro-step 13 (1 into a window)" in second
    last = [line for line in first.splitlines() if line.startswith("window")][-1]
    assert (
        last.startswith("window    6")
        and last == [line for line in second.splitlines() if line.startswith("window")][-1]
    )


@pytest.mark.slow
def test_distributed_benchmark_quick_mode(native_only, tmp_path):
    """`python -m bench.distributed --quick`: correctness first, then the table."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.distributed", "--quick", "--results-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["path"]: r for r in json.loads((tmp_path / "distributed-cpu-quick.json").read_text())["rows"]}
    assert set(rows) == {
        "ddp-no_sync",
        "ours-allreduce",
        "ours-sharded",
        "ours-allreduce-bf16wire",
        "ours-each-backward",
    }
    for path in ("ddp-no_sync", "ours-sharded", "ours-each-backward"):
        assert rows[path]["update_rel_error_vs_ours_allreduce"] <= 1e-5
    assert 1e-6 < rows["ours-allreduce-bf16wire"]["update_rel_error_vs_ours_allreduce"] <= 2e-2
    assert rows["ours-allreduce"]["collectives"]["all_reduce"] >= 2  # buckets + the window's flags
    # sharding halves the optimizer state per rank (2 ranks); a bf16 wire halves the bytes sent
    assert rows["ours-sharded"]["state_mib_per_rank"] < 0.6 * rows["ours-allreduce"]["state_mib_per_rank"]
    assert rows["ours-allreduce-bf16wire"]["sent_mib"] < 0.6 * rows["ours-allreduce"]["sent_mib"]
    # torch's loop without DDP (accum_steps=None): every one of the N backwards is reduced
    n_micro = rows["ours-each-backward"]["n_micro"]
    assert rows["ours-each-backward"]["sent_mib"] > 0.9 * n_micro * rows["ours-allreduce"]["sent_mib"]
    assert all(r["window_ms"] > 0 for r in rows.values())

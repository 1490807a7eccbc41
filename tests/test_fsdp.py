"""AccumulatingOptimizer on FSDP2 (fully_shard) models, 2 and 4 gloo ranks on
the CPU (the scenarios are in tests/fsdp_worker.py): equal to one process
stepping on all W*N micro-batches under every mixed-precision policy, with
FSDP2's no-sync mode, "items" across ranks and clipping; bf16 sharded params
summed in fp32 against FSDP2's own bf16 accumulation; an inf on one rank; a
bitwise resume mid-window; torch.distributed.checkpoint's optimizer state;
the per-rank buffer memory, measured; refusals; torch.optim's loops
(accum_steps=None) as torch.optim on FSDP2, or refused."""

from __future__ import annotations

import os
import tempfile

import fsdp_worker as worker
import pytest
import torch
import torch.distributed as dist
from helpers import U_BF16, assert_windows_within_bound, gamma
from test_distributed import WORKER_SEED, same, spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

POLICIES = {  # param_dtype (compute), reduce_dtype, storage of the sharded params
    "fp32": {},
    "bf16-compute-fp32-reduce": dict(param_dtype="bf16", reduce_dtype="fp32"),
    "bf16-compute-bf16-reduce": dict(param_dtype="bf16", reduce_dtype="bf16"),
    "bf16-storage": dict(storage="bf16", reduce_dtype="fp32"),
}
PARITY = {
    "adamw-clip": dict(scenario="parity", clip=0.5),
    "sgd": dict(scenario="parity", optimizer="sgd"),
    "items": dict(scenario="parity", normalize="items"),
    "no-sync": dict(scenario="parity", no_sync=True, clip=0.5),
    # SGD: the comparison with the fp32 reference is then not at the mercy of
    # Adam's m / sqrt(v) on elements whose bf16-computed gradient is near zero.
    **{f"policy-{k}": dict(scenario="parity", optimizer="sgd", **v) for k, v in POLICIES.items() if k != "fp32"},
}
CASES_2 = {
    **PARITY,
    "bf16-shards": dict(scenario="bf16_shards"),
    "inf": dict(scenario="inf_skip"),
    "resume-fp32": dict(scenario="resume"),
    # bf16 shards with the defaults (stochastic rounding, bf16 DTensor state), and with remainders
    "resume-bf16-defaults": dict(scenario="resume", storage="bf16"),
    "resume-bf16-remainders": dict(scenario="resume", storage="bf16", options=dict(master_weights="remainders")),
    # 8-bit state: codes sharded like the params, scales one (W, blocks) DTensor
    "resume-bf16-8bit": dict(scenario="resume", storage="bf16", options=dict(state_dtype="8bit")),
    "dcp": dict(scenario="dcp_round_trip"),
    "dcp-8bit": dict(scenario="dcp_round_trip", options=dict(state_dtype="8bit")),
    # bf16 shards rounded to nearest (a DCP resume restarts the stochastic-rounding stream),
    # their fp32 masters, their remainders
    "dcp-bf16-nearest": dict(scenario="dcp_round_trip", storage="bf16", options=dict(stochastic_rounding=False)),
    "dcp-bf16-master": dict(scenario="dcp_round_trip", storage="bf16", options=dict(master_weights=True)),
    "dcp-bf16-remainders": dict(scenario="dcp_round_trip", storage="bf16", options=dict(master_weights="remainders")),
    "dcp-bf16-master-full": dict(
        scenario="dcp_round_trip", storage="bf16", options=dict(master_weights=True), full_state_dict=True
    ),
    "memory": dict(scenario="buffer_bytes"),
    "refusals": dict(scenario="refusals"),
    "torch-loops": dict(scenario="torch_loops"),
}
CASES_4 = {"adamw-clip": PARITY["adamw-clip"], "items": PARITY["items"], "memory": dict(scenario="buffer_bytes")}


@pytest.fixture(scope="module")
def runs():
    # An 8-bit DCP checkpoint saved by the 2 ranks, loaded by the 4.
    with tempfile.TemporaryDirectory() as shared:
        checkpoint = os.path.join(shared, "dcp-8bit")
        two = spawn(2, {**CASES_2, "dcp-8bit-save": dict(scenario="dcp_8bit_save", shared=checkpoint)}, worker.main)
        four = spawn(
            4, {**CASES_4, "dcp-8bit-4": dict(scenario="dcp_8bit_other_world", shared=checkpoint)}, worker.main
        )
    return {2: two, 4: four}


@pytest.mark.parametrize("world,case", [(2, c) for c in PARITY] + [(4, c) for c in CASES_4 if c in PARITY])
def test_ranks_equal_one_process(runs, world, case):
    results = [r[case] for r in runs[world]]
    for r in results[1:]:
        assert same(r["params"], results[0]["params"]), "every rank holds the same full params"
    # Every window is the exact step on all ranks' micro-batches, to the fp32
    # error bound (tests/helpers.py), from the params the run held and with the
    # gradients its ranks computed: in bf16 where the policy computes in bf16.
    # A bf16 reduction across ranks adds its gamma; bf16 params (stochastic
    # rounding, bf16 momentum: the defaults) add under an ulp on each store.
    cfg = dict(PARITY[case], seed=WORKER_SEED)
    bf16_reduce = cfg.get("reduce_dtype") == "bf16" or cfg.get("storage") == "bf16"
    stored = 2 * U_BF16 if cfg.get("storage") == "bf16" else 0.0
    assert_windows_within_bound(
        results[0]["trajectory"],
        worker.window_gradients(cfg, world),
        worker.make_optimizer([torch.zeros(1)], cfg.get("optimizer", "adamw")),
        clip=cfg.get("clip"),
        reduce_error=gamma(world + 1, U_BF16) if bf16_reduce else 0.0,
        param_roundoff=stored,
        state_roundoff=stored,
    )


def test_bf16_shards_summed_in_fp32(runs):
    """The shards FSDP2 hands over (bf16 params: in bf16) are summed in fp32:
    against a float64 sum of the same shards the wrapper's window gradient is
    exact to fp32, FSDP2's own accumulation in bf16 .grad is not."""
    for rank in runs[2]:
        errors = rank["bf16-shards"]
        assert errors["ours"] <= 1e-6, errors
        assert errors["ours"] * 100 < errors["plain"], errors


def test_torch_optim_loops_on_fsdp2_train_as_torch_or_are_refused(runs):
    """accum_steps=None on FSDP2 (intake "hooks"): test_contract's loops of
    torch.optim calls (fsdp_worker.TORCH_LOOPS, and random ones) end within
    its bound of plain torch.optim AdamW on FSDP2, with the same logged norms,
    or are refused before a param changed. The known ones end as listed: a
    clip_grad_norm_ after backward, a step() on uncleared gradients and a
    model.zero_grad() before step() are refused (the marker in .grad: before,
    the norm read 0 and the others trained on other gradients than torch's)."""
    for rank in runs[2]:
        outcomes = rank["torch-loops"]
        for name, outcome in outcomes.items():
            expected = worker.TORCH_LOOPS.get(name, (None, outcome[0]))[1]
            assert outcome[0] == expected, (name, outcome)
            if outcome[0] == "refused":
                assert not outcome[2], f"{name}: a param changed before the refusal"
            else:
                _, worst, rel, same_count = outcome
                assert worst <= 1.0 and rel <= 1e-6 and same_count, (name, outcome)
        assert "max_grad_norm=" in outcomes["clip after backward"][1]
        assert sum(o[0] == "torch" for o in outcomes.values()) >= 5


def test_an_inf_on_one_rank_skips_the_window_everywhere(runs):
    for rank in runs[2]:
        assert rank["inf"] == {"skipped": True, "moved": True}


@pytest.mark.parametrize("case", ["resume-fp32", "resume-bf16-defaults", "resume-bf16-remainders", "resume-bf16-8bit"])
def test_resume_mid_window_is_bitwise(runs, case):
    assert all(rank[case]["same"] for rank in runs[2])


@pytest.mark.parametrize(
    "case", ["dcp", "dcp-8bit", "dcp-bf16-nearest", "dcp-bf16-master", "dcp-bf16-remainders", "dcp-bf16-master-full"]
)
def test_distributed_checkpoint(runs, case):
    for rank in runs[2]:
        assert rank[case] == {"refused_mid_window": True, "same": True}


def test_an_8bit_checkpoint_of_another_world_size_is_refused(runs):
    """8-bit FSDP2 state saved by 2 ranks does not load into 4: each rank's
    block scales follow its own shard, so they cannot be resharded; the
    scales' (W, blocks) shape makes the load fail instead of mixing them."""
    for rank in runs[4]:
        error = rank["dcp-8bit-4"]["error"]
        assert error is not None and "scales" in error, error


@pytest.mark.parametrize("world", [2, 4])
def test_buffers_hold_one_shard_per_rank(runs, world):
    """Measured (torch's profiler): the memory the wrapper allocates on each
    rank is about 1/W of the model in fp32 (the local shards, 64-byte aligned),
    in one bucket per fully_shard module, in the order backward reaches them."""
    for rank in runs[world]:
        m = rank["memory"]
        assert m["full_fp32"] / world * 0.95 <= m["allocated"] <= m["full_fp32"] / world * 1.02 + 4096, m
        assert m["buckets"] == [["root"], ["block1"], ["block0"]], "one bucket per fully_shard module"


def test_refusals(runs):
    errors = runs[2][0]["refusals"]
    assert "FSDP2 shards and reduces" in errors["sharded"] and "FSDP2 shards and reduces" in errors["process_group"]
    assert "intake='hooks'" in errors["grad_intake"]
    assert "plain tensors beside" in errors["mixed"]
    assert "2-D device mesh" in errors["hsdp"]
    assert "device meshes" in errors["two_meshes"]
    assert "or on FSDP2 params is not supported" in errors["add_param_group"] and errors["groups_kept"] is True


@pytest.mark.slow
def test_fsdp_benchmark_quick_mode(tmp_path):
    """`python -m bench.fsdp --quick`: every path, the wrapper's buffers at 1/W
    of the model, FSDP2's no-sync path holding the whole unsharded gradient."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "bench.fsdp", "--quick", "--results-dir", str(tmp_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["path"]: r for r in json.loads((tmp_path / "fsdp-cpu-quick.json").read_text())["rows"]}
    assert set(rows) == {"fsdp-bf16", "fsdp-no-sync-fp32", "ours"}
    full_fp32_mib = rows["ours"]["params"] * 4 / 2**20
    assert rows["ours"]["buffers_mib_per_rank"] <= 0.55 * full_fp32_mib
    assert rows["fsdp-no-sync-fp32"]["unsharded_grad_mib_per_rank"] >= 0.95 * full_fp32_mib
    assert all(r["window_ms"] > 0 and 0 < r["grad_rel_error_vs_float64"] < 0.1 for r in rows.values())

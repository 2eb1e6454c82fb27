"""AutoRollback's probe under ModelParallelStrategy + FSDP2: each rank scores its own probe rows through the sharded
module (every forward all-gathers, so every rank scores together), one all-reduce, the same verdict on every rank.

All runs are one launch of the 2 ranks (``tests.sharded._probe_worker``: an MLP with a BatchNorm and RNG noise in its
``training_step``, SGD with momentum unless said otherwise, snapshots every 2 steps, spikes probed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.sharded._launch import run_ranks_many

pytestmark = pytest.mark.distributed

PROBED = {"forensics": "off", "spike_zscore": 3.0, "spike_warmup": 3, "on_spike": "probe"}
ROLLBACK = {"every_n_steps": 2, "quiet_steps": 0}
DIVERGE = {"max_steps": 10, "monitor": PROBED, "rollback": ROLLBACK, "backoff": {}, "lr_jump": [6, 40.0]}
# AdamW (its update stays bounded) and rank 1's batch of step 6 ten times too large: a spike of the batch alone.
HELD = {
    "max_steps": 8,
    "optimizer": "adamw",
    "monitor": PROBED,
    "rollback": ROLLBACK,
    "fault": {"target": "input", "steps": [6], "ranks": [1], "value": 10.0},
}
RUNS: dict[str, dict[str, Any]] = {
    "diverge": DIVERGE,
    "diverge_bf16": {**DIVERGE, "precision": "bf16-mixed"},
    "held": HELD,
    "held_unprobed": {**HELD, "monitor": {**PROBED, "on_spike": "warn"}},  # the same run, nothing ever scored
    "failed_scoring": {**HELD, "fail_scoring": 4},  # the scoring of the step-4 snapshot raises mid-forward
    # From step 8 on, the first of rank 1's probe samples is NaN wherever it comes back: the quarantine takes it.
    "quarantine": {"max_steps": 16, "monitor": PROBED, "rollback": ROLLBACK, "poison": 8},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("probe_fsdp2")
    plan = [(config, str(root / name)) for name, config in RUNS.items()]
    out = run_ranks_many(plan, timeout=150.0, module="tests.sharded._probe_worker")
    return dict(zip(RUNS, out, strict=True))


def _incidents(rank: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (i["step"], i["trigger"], i["cause"], i["actions"], i["values"].get("restored_from_step"))
        for i in rank["incidents"]
    ]


def _same_on_both_ranks(out: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's record, after checking that rank 1 decided, scored and did the same."""
    r0, r1 = out["ranks"]
    assert _incidents(r0) == _incidents(r1)
    assert r0["scores"] == r1["scores"]  # one all-reduced score per scoring
    assert r0["verdict"] == r1["verdict"]
    assert [row["lr"] for row in r0["rows"]] == [row["lr"] for row in r1["rows"]]
    return r0


def _scorings(rank: dict[str, Any]) -> list[dict[str, Any]]:
    return [call for row in rank["rows"] for call in row["calls"] if not call["grad"]]


def test_a_divergence_is_caught_by_the_probe_on_both_ranks_at_the_same_step(runs: dict[str, dict[str, Any]]) -> None:
    out = runs["diverge"]
    rank = _same_on_both_ranks(out)
    # The rate jumps 40x at step 6; the spike of step 7 is the weights (the probe's loss rose with it): rolled back
    # to the snapshot of step 6 and the rate halved, on both ranks.
    first = _incidents(rank)[0]
    assert first == (7, "probe_rose", "weights_diverging", ["rollback", "backoff"], 6)
    evidence = rank["incidents"][0]["diagnosis"]["evidence"][0]
    assert evidence["kind"] == "probe_loss"
    assert [row["lr"] for row in rank["rows"]][5:8] == pytest.approx([2.0, 2.0, 1.0])
    # The snapshot of step 8 is the restored state of step 6: its probe, scored through FSDP2's all-gather of the
    # restored shards, scores exactly what the step-6 snapshot scored.
    assert rank["scores"]["8"] == rank["scores"]["6"]
    assert all(bool(torch.isfinite(p).all()) for p in out["params"].values())


def test_a_spike_whose_probe_held_does_nothing_on_either_rank(runs: dict[str, dict[str, Any]]) -> None:
    rank = _same_on_both_ranks(runs["held"])
    assert _incidents(rank) == []
    verdict = rank["verdict"]
    assert verdict["step"] == 6  # the spike was scored ...
    assert not verdict["rose"]  # ... and the probe held
    assert verdict["probe_after"] < 1.5 * verdict["probe_before"] < verdict["batch_loss"]
    assert _incidents(runs["held_unprobed"]["ranks"][0])[0][:2] == (6, "loss_and_grad_norm_spike")  # it was a spike
    # Every scoring (at each snapshot and at the spike) left no trace: the parameters and the BatchNorm statistics
    # are bit-identical to the same run with nothing scored (the RNG noise of later steps included).
    got, want = runs["held"]["params"], runs["held_unprobed"]["params"]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_scoring_leaves_every_fsdp2_module_sharded(runs: dict[str, dict[str, Any]]) -> None:
    # FSDP2 keeps the root's parameters all-gathered after a forward (for the backward it expects); a scoring has no
    # backward, so it reshards them itself. Otherwise the next snapshot copies the full tensors, and a restore writes
    # into them instead of the shards (the run of the divergence fails in its next forward).
    for name, out in runs.items():
        for r, rank in enumerate(out["ranks"]):
            left = [(row["step"], row["unsharded_at_start"], row["unsharded_at_end"]) for row in rank["rows"]]
            assert all(not start and not end for _, start, end in left), (name, r, left)
    # A scoring that raised midway through the forward scores nothing (no snapshot score of step 4) and still leaves
    # the modules sharded: the run is the unprobed one, bit for bit.
    failed = _same_on_both_ranks(runs["failed_scoring"])
    assert sorted(failed["scores"], key=int) == ["0", "2", "6"]
    assert "the probe batch could not be scored" in runs["failed_scoring"]["output"]
    got, want = runs["failed_scoring"]["params"], runs["held_unprobed"]["params"]
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_bf16_mixed_scores_in_the_training_precision(runs: dict[str, dict[str, Any]]) -> None:
    rank = _same_on_both_ranks(runs["diverge_bf16"])
    assert _incidents(rank)[0] == (7, "probe_rose", "weights_diverging", ["rollback", "backoff"], 6)
    scorings = _scorings(rank)
    assert scorings
    assert all(c["autocast"] and c["dtype"] == "torch.bfloat16" for c in scorings)
    assert all(c["dtype"] == "torch.float32" for c in _scorings(runs["diverge"]["ranks"][0]))


def test_a_probe_the_quarantine_takes_on_one_rank_is_retaken_there_alone(runs: dict[str, dict[str, Any]]) -> None:
    r0, r1 = runs["quarantine"]["ranks"]
    rank = _same_on_both_ranks(runs["quarantine"])
    sample = r1["rows"][0]["samples"][0]  # the first of rank 1's probe samples, poisoned from step 8 on
    (incident,) = rank["incidents"]
    assert f"quarantined dataset sample(s) [{sample}]" in incident["message"]
    step = incident["step"]
    # Rank 0 keeps its probe; rank 1 takes a new one at the next snapshot; both ranks drop every earlier score and
    # score the new pair together (no rank entered the scoring's all-gathers alone: the run did not hang).
    samples = [sorted({tuple(row["samples"]) for row in r["rows"]}) for r in (r0, r1)]
    assert len(samples[0]) == 1
    assert len(samples[1]) == 2
    assert sample not in r1["rows"][-1]["samples"]
    assert rank["scores"]
    assert all(int(s) > step for s in rank["scores"])

"""FSDPStrategy (FSDP1, ``use_orig_params=True``) on 2 ranks: global norms over the ranks' flat-shard pieces, a skip
and a rollback taken by both ranks together, and a spike backed off on both ranks.

On CPU the strategy is ``tests.sharded._fsdp1_worker.CPUFSDPStrategy``: Lightning's FSDPStrategy with the model
wrapped with ``device_id=torch.device("cpu")`` (Lightning refuses FSDP on CPU; torch's FSDP1 runs on gloo). The
``gpu`` variants run the real FSDPStrategy on 2 CUDA devices and are skipped without them.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from tests.sharded._launch import run_ranks_many

ACCELERATORS = [
    pytest.param("cpu", marks=pytest.mark.distributed, id="cpu"),
    pytest.param(
        "gpu",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
        ],
        id="gpu",
    ),
]
# Where each rank's piece of each parameter lies in its flat shard: rank 0 holds all of every weight's first
# part and none of the biases (size-0 views, gradient None), rank 1 the rest (tests.sharded._worker.ShardedMLP,
# one FSDP unit per Linear).
LOCAL_NUMELS = [
    {"body.0.weight": 72, "body.0.bias": 0, "body.2.weight": 136, "body.2.bias": 0, "head.weight": 17, "head.bias": 0},
    {
        "body.0.weight": 56,
        "body.0.bias": 16,
        "body.2.weight": 120,
        "body.2.bias": 16,
        "head.weight": 15,
        "head.bias": 2,
    },
]


def _run(config: dict[str, Any], out_dir: Any, accelerator: str) -> dict[str, Any]:
    return _runs([(config, out_dir)], accelerator)[0]


def _runs(runs: list[tuple[dict[str, Any], Any]], accelerator: str) -> list[dict[str, Any]]:
    """Several runs in one launch of the 2 ranks (their start-up is most of a run's time)."""
    return run_ranks_many(
        [({**config, "accelerator": accelerator}, str(out_dir)) for config, out_dir in runs],
        timeout=150.0,
        module="tests.sharded._fsdp1_worker",
    )


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_global_norms_skip_and_rollback_on_both_ranks_with_the_reference_parameters(
    tmp_path: Any, accelerator: str
) -> None:
    # Rank 1 only: a NaN in its piece of body.0.weight's gradient at step 2 (skip), and a NaN written into its piece
    # of body.0.weight at the start of step 5 (rollback to the snapshot of step 4; snapshots at steps 0, 2, 4).
    faults = [{"target": "grad", "steps": [2], "ranks": [1]}, {"target": "param", "steps": [5], "ranks": [1]}]
    config = {
        "max_steps": 7,
        "faults": faults,
        "monitor": {},  # forensics="first": the step-2 incident is replayed (a forward: FSDP1 all-gathers) on both ranks
        "rollback": {"every_n_steps": 2, "quiet_steps": 0},
        "watchdog": True,  # no GradScaler under 32-true: it joins and changes nothing
    }
    # The clean run (checked last): the run whose updates of steps 2 (skipped), 4 (undone by the rollback) and
    # 5 (dropped) are dropped on every rank by the test itself; both runs in one launch.
    faulty, clean = _runs(
        [(config, tmp_path / "faulty"), ({"max_steps": 7, "drop_steps": [2, 4, 5]}, tmp_path / "ref")], accelerator
    )
    r0, r1 = faulty["ranks"]
    local = [{k.replace("_fsdp_wrapped_module.", ""): v for k, v in r["local_numels"].items()} for r in (r0, r1)]
    assert local == LOCAL_NUMELS  # really sharded: pieces of the flat shards, some empty
    assert r0["steps"] == r1["steps"]  # every reading, drop and learning rate is the same on both ranks
    decisions = [
        [
            (i["step"], i["actions"], i["ranks"], i["values"].get("restored_from_step"), i["cause"])
            for i in r["incidents"]
        ]
        for r in (r0, r1)
    ]
    assert decisions[0] == decisions[1]
    assert decisions[0][0] == (2, ["skip"], [1], None, "transient")  # rank 1 named: its gradient piece was NaN
    assert all(r["incidents"][0]["diagnosis"]["replayed"] for r in (r0, r1))  # not reproduced by the replay
    assert decisions[0][1][:2] == (5, ["skip", "rollback"])
    assert decisions[0][1][3:] == (4, "corrupt_state")
    assert r0["incidents"][1]["diagnosis"]["state_tensors"] == ["body.0.weight"]  # its original path, on rank 0 too
    assert [row["dropped"] for row in r0["steps"]] == [False, False, True, False, False, True, False]
    for row in r0["steps"]:
        if row["dropped"]:
            assert math.isnan(row["grad_norm"])
            continue
        reference = row["reference"]  # norms of the full gradients, gathered by FSDP.summon_full_params
        assert _close(row["grad_norm"], reference["grad_norm"])
        assert row["tensors"].keys() == reference["tensors"].keys() == LOCAL_NUMELS[0].keys()  # original paths
        assert all(_close(row["tensors"][n], v) for n, v in reference["tensors"].items())
        assert row["layers"].keys() == reference["layers"].keys() == {"body", "head"}
        assert all(_close(row["layers"][n], v) for n, v in reference["layers"].items())
    # Against the clean run, bit for bit: parameters and AdamW state were restored exactly.
    got, want = faulty["params"], clean["params"]
    assert got.keys() == want.keys() == LOCAL_NUMELS[0].keys()
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        assert torch.equal(got[name], want[name]), f"{name}: max diff {(got[name] - want[name]).abs().max()}"


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_spike_in_rank1_piece_rolls_back_and_backs_off_on_both_ranks_under_bf16_mixed(
    tmp_path: Any, accelerator: str
) -> None:
    # Rank 1's piece of body.0.weight's gradient x1e4 at step 4: only the reduced norm shows it on rank 0. Under
    # bf16-mixed: FSDP1's MixedPrecision policy (bfloat16 compute and reductions, float32 sharded gradients).
    config = {
        "max_steps": 6,
        "precision": "bf16-mixed",
        "faults": [{"target": "grad", "steps": [4], "ranks": [1], "value": 1e4}],
        "monitor": {"forensics": "off", "spike_zscore": 3.0, "spike_warmup": 3, "on_spike": "rollback"},
        "rollback": {"every_n_steps": 2, "quiet_steps": 0},
        "backoff": {},
    }
    out = _run(config, tmp_path, accelerator)
    incidents = [
        [(i["step"], i["trigger"], i["actions"], i["values"].get("restored_from_step")) for i in r["incidents"]]
        for r in out["ranks"]
    ]
    assert incidents[0] == incidents[1] == [(4, "grad_norm_spike", ["skip", "rollback", "backoff"], 4)]
    rows = [rank["steps"] for rank in out["ranks"]]
    assert rows[0] == rows[1]
    assert [row["dropped"] for row in rows[0]] == [False, False, False, False, True, False]
    assert rows[0][4]["grad_norm"] > 100 * rows[0][3]["grad_norm"]
    assert [row["lr"] for row in rows[0]] == pytest.approx([0.02] * 4 + [0.01] * 2)  # OptimizerBackoff, once
    assert all(torch.isfinite(p).all() for p in out["params"].values())
    for row in rows[0]:
        if not row["dropped"]:  # the global norm under the mixed-precision policy: the full gradients' norm
            assert _close(row["grad_norm"], row["reference"]["grad_norm"])
            assert all(_close(row["layers"][n], v) for n, v in row["reference"]["layers"].items())


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_checkpoint_guard_verifies_sharded_saves_and_falls_back_from_a_corrupted_shard_on_both_ranks(
    tmp_path: Any, accelerator: str
) -> None:
    # state_dict_type="sharded": a directory per checkpoint (torch.distributed.checkpoint shards, meta.pt and
    # nanguard's manifest), written by every rank and loaded by FSDPStrategy itself on every rank, past the
    # CheckpointIO: nanguard verifies on rank 0 and every rank takes the broadcast decision. (state_dict_type="full"
    # is refused: torch's FSDP1 full state dict with offload_to_cpu=True crashes on CPU ranks, so it is untested.)
    from lightning_nanguard.checkpointing.manifest import MANIFEST_NAME
    from lightning_nanguard.checkpointing.verify import verify_checkpoint
    from tests.sharded._launch import run_checkpoint_ranks
    from tests.sharded.test_checkpoint_guard_fsdp2 import _assert_same_params, _flip_a_byte, _params

    base = {"strategy": "fsdp1", "accelerator": accelerator}
    ckpt = tmp_path / "ckpt"
    saved = run_checkpoint_ranks({**base, "ckpt_dir": str(ckpt), "max_steps": 4}, str(tmp_path / "run"))
    step2, step4 = str(ckpt / "epoch=0-step=2.ckpt"), str(ckpt / "epoch=0-step=4.ckpt")
    for rank in saved:
        assert rank["error"] == {}
        assert rank["incidents"] == []
    assert sorted(os.listdir(ckpt)) == [os.path.basename(step2), os.path.basename(step4)]  # no temporary left
    for path in (step2, step4):
        assert verify_checkpoint(path).ok
        files = sorted(os.listdir(path))
        assert files == sorted([".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", MANIFEST_NAME])
    # One flipped byte in rank 1's shard file: FSDPStrategy would load it without a word.
    _flip_a_byte(os.path.join(step4, "__1_0.distcp"))
    assert not verify_checkpoint(step4).ok
    # Resume from it with fallback=True; a NaN in rank 1's piece of body.0.weight just before the step-6 save.
    config = {**base, "ckpt_dir": str(ckpt), "max_steps": 6, "fallback": True, "ckpt_path": step4, "poison": [6, 1]}
    resumed = run_checkpoint_ranks(config, str(tmp_path / "resume"))
    for rank in resumed:
        assert rank["start_step"] == 2  # both ranks fell back to the verified step-2 checkpoint
        fallback = [i for i in rank["incidents"] if i["action"] == "fallback"]
        assert [(i["values"]["file"], i["values"]["loaded"]) for i in fallback] == [(step4, step2)]
        assert "__1_0.distcp" in fallback[0]["values"]["reason"]
    _assert_same_params(
        _params(str(tmp_path / "resume" / "params_start.pt")), _params(str(tmp_path / "run" / "params_step2.pt"))
    )
    # The step-6 save: refused on both ranks (the verdict over the ranks' local ShardedTensor shards is reduced
    # before anything is written), rank 1's piece named on both, nothing published.
    for rank in resumed:
        refused = [i for i in rank["incidents"] if i["action"] == "refuse"]
        assert [(i["step"], i["values"]["nonfinite_tensors"]) for i in refused] == [
            (6, "state_dict.body.0.weight[0] (rank 1)")
        ]
    assert not os.path.exists(str(ckpt / "epoch=0-step=6.ckpt"))


def test_marked_pieces_weigh_their_share_and_empty_pieces_count_as_present_gradients() -> None:
    from torch import nn

    from lightning_nanguard.signals.fsdp1 import SHARE_ATTR
    from lightning_nanguard.signals.sharded import is_sharded, local_grads, original_name, share_of

    empty, piece, plain = nn.Parameter(torch.empty(0)), nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    setattr(empty, SHARE_ATTR, 1.0)  # FULL_SHARD: every element is held by exactly one rank
    setattr(piece, SHARE_ATTR, 0.5)  # HYBRID_SHARD over 2 replicas of the shard group
    assert is_sharded(empty)
    assert is_sharded(piece)
    assert not is_sharded(plain)
    assert (share_of(empty, 4), share_of(piece, 4), share_of(plain, 4)) == (1.0, 0.5, 0.25)
    grad = torch.full((3,), 2.0)
    got = local_grads([empty, piece, plain], [None, grad, None])
    assert got[0] is not None
    assert got[0].numel() == 0
    assert got[1] is grad
    assert got[2] is None
    assert local_grads([empty, piece], [None, None]) == [None, None]  # a dropped step: nothing made up
    assert original_name("body.0._fsdp_wrapped_module._checkpoint_wrapped_module.weight") == "body.0.weight"
    assert original_name("head.weight") == "head.weight"

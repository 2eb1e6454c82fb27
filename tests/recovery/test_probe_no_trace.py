"""A probe scoring leaves no trace in a real fit: what a training_step keeps on the side ends as the unguarded run's.

Each module keeps state beside its weights the way users do, updated inside ``training_step``: an EMA in a dict of
plain tensors, an ``AveragedModel`` EMA, a batch normalised in place, noise drawn from a generator the module owns,
a list of step losses and a counter. Each is fit twice from the same seed, unguarded and under
``default_callbacks()`` with a snapshot (and so a probe scoring) every 5 steps and a sensitive spike detector, so
that the probe is scored many times, at snapshots and at spikes. The guarded run must end bit-identical to the
unguarded one: weights, buffers, and that state.
"""

from __future__ import annotations

import array
import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_nanguard import AutoRollback, default_callbacks
from lightning_nanguard.engine import get_engine

pytestmark = pytest.mark.timeout(120)

STEPS = 60


class Images(Dataset[dict[str, Tensor]]):
    """uint8 images and labels, as a dataset of dicts (the batch a training_step normalises in place)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = (torch.rand(256, 1, 8, 8, generator=g) * 255).to(torch.uint8)
        self.y = (self.x.float().mean((1, 2, 3)) > 127).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"image": self.x[i], "label": self.y[i]}


class SideState(pl.LightningModule):
    """A small CNN whose training_step keeps state on the side (each case switches one on)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(256, 2)
        )
        self.losses: list[float] = []
        self.calls = 0
        self.ema = {k: v.detach().clone() for k, v in self.net.state_dict().items() if v.is_floating_point()}
        self.averaged = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if case == "swa" else None
        self.noise = torch.Generator().manual_seed(1)
        self.opaque = array.array("d")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        batch["image"] = batch["image"].float() / 255.0  # normalised in place, written back into the batch dict
        x = batch["image"]
        if self.case == "noise":  # diffusion-like: noise and a level drawn from the module's own generator
            level = torch.rand((), generator=self.noise)
            x = x + level * torch.randn(x.shape, generator=self.noise)
        loss = nn.functional.cross_entropy(self.net(x), batch["label"])
        self.losses.append(float(loss.detach()))
        self.calls += 1
        if self.case == "ema":
            with torch.no_grad():
                for k, v in self.net.state_dict().items():
                    if k in self.ema:
                        self.ema[k].lerp_(v, 0.1)
        if self.averaged is not None:
            self.averaged.update_parameters(self.net)
        if self.case == "opaque":
            self.opaque.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net.parameters(), lr=3e-3)


def _fit(case: str, callbacks: list[Any], root: str) -> tuple[SideState, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    model = SideState(case)
    trainer = pl.Trainer(
        max_steps=STEPS,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        deterministic=True,
    )
    trainer.fit(model, DataLoader(Images(), batch_size=16, shuffle=True))
    return model, trainer


def _guarded() -> list[Any]:
    return default_callbacks(
        CheckpointGuard=False,
        AutoRollback={"every_n_steps": 5},
        GradNormMonitor={"spike_zscore": 1.5, "spike_warmup": 5},
    )


def _side_state(model: SideState) -> dict[str, Any]:
    return {
        "losses": list(model.losses),
        "calls": model.calls,
        "ema": {k: v.clone() for k, v in model.ema.items()},
        "noise": model.noise.get_state(),
    }


def _assert_identical(a: Any, b: Any) -> None:
    if isinstance(a, Tensor):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_identical(a[k], b[k])
    else:
        assert a == b


@pytest.mark.parametrize("case", ["ema", "swa", "noise", "plain"])
def test_a_healthy_fit_ends_bit_identical_with_the_probe_scoring(case: str, tmp_path: Any) -> None:
    plain, _ = _fit(case, [], str(tmp_path))
    callbacks = _guarded()
    guarded, trainer = _fit(case, callbacks, str(tmp_path))
    rollback = next(c for c in callbacks if isinstance(c, AutoRollback))
    assert get_engine(trainer).sink.records == []
    assert rollback.rollbacks == 0
    snapshots = len(range(0, STEPS, 5))
    assert rollback.probe.scorings > snapshots  # every snapshot and at least one spike were scored
    assert rollback.probe.verdict is not None
    assert rollback.probe.batch.disabled == ""
    _assert_identical(plain.state_dict(), guarded.state_dict())  # the AveragedModel's parameters and count too
    _assert_identical(_side_state(plain), _side_state(guarded))
    assert rollback.probe.batch.batch["image"].dtype == torch.uint8  # the kept rows as captured


def test_a_change_that_cannot_be_put_back_stops_the_scoring(tmp_path: Any, caplog: Any) -> None:
    # An array.array appended to in training_step: no container nanguard can put back in place. The first scoring
    # finds the change, says so naming it, and nothing is scored after it.
    callbacks = _guarded()
    model, _ = _fit("opaque", callbacks, str(tmp_path))
    probe = next(c for c in callbacks if isinstance(c, AutoRollback)).probe
    assert "SideState.opaque" in probe.batch.disabled
    assert probe.scorings == 1
    assert len(model.opaque) == STEPS + 1  # the one scoring that found it


def test_the_walk_reaches_nested_state_and_puts_it_back() -> None:
    """Pure: nested containers, a plain object's attributes, a tensor written in place through a view."""
    from lightning_nanguard.recovery.probe_trace import untouched

    class Tracker:
        def __init__(self) -> None:
            self.count = 0
            self.window: list[float] = []

    module = nn.Linear(2, 2)
    module.stats = {"seen": [torch.zeros(3)], "tracker": Tracker()}  # type: ignore[assignment]
    before = copy.deepcopy(module.stats)
    weight = module.weight.detach().clone()
    with untouched(module) as trace, torch.no_grad():
        module.stats["seen"][0][:2].add_(1.0)  # type: ignore[index]
        module.stats["seen"].append(torch.ones(1))  # type: ignore[index]
        module.stats["tracker"].count += 1  # type: ignore[index]
        module.stats["tracker"].window.append(1.0)  # type: ignore[index]
        module.weight.mul_(2.0)
        module.added = 1  # type: ignore[assignment]
    assert trace.beyond_repair == []
    assert torch.equal(module.stats["seen"][0], before["seen"][0])
    assert len(module.stats["seen"]) == 1
    assert (module.stats["tracker"].count, module.stats["tracker"].window) == (0, [])  # type: ignore[index]
    assert torch.equal(module.weight, weight)
    assert not hasattr(module, "added")


def test_the_private_copy_keeps_tensor_datasets_working(tmp_path: Any) -> None:
    # A tuple batch (TensorDataset): the kept rows are scored on a copy, and the probe still scores.
    class Tuple(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callbacks = _guarded()
    trainer = pl.Trainer(
        max_steps=12,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    trainer.fit(Tuple(), DataLoader(data, batch_size=8))
    probe = next(c for c in callbacks if isinstance(c, AutoRollback)).probe
    assert probe.scorings >= 3
    assert len(probe.book.scores) >= 2

"""The probe batch is scored deterministically and leaves no trace: RNG, buffers, modes, gradients, logged metrics."""

from __future__ import annotations

import math
import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor, nn

from lightning_nanguard.recovery.probe import ProbeBatch, SnapshotProbe


class Diffusion(pl.LightningModule):
    """A denoiser whose training_step samples noise and timesteps (as a diffusion model's does), with BatchNorm and
    dropout, logging its loss and returning a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 4))
        self.logged: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        x = batch["x"]
        noise = torch.randn_like(x)
        t = torch.randint(0, 100, (x.shape[0], 1)).float() / 100
        pred = self.net(torch.cat([x + t * noise, t], dim=1))
        jitter = float(np.random.rand()) + random.random()  # host RNGs drawn too (augmentations often are)
        loss = nn.functional.mse_loss(pred, noise) + 1e-3 * jitter
        self.log("train_loss", loss)
        return {"loss": loss, "pred": pred}

    def log(self, name: str, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.logged.append(name)


def _trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)


def test_a_scoring_is_deterministic_and_leaves_no_trace() -> None:
    torch.manual_seed(0)
    module, trainer = Diffusion().train(), _trainer()
    probe = ProbeBatch(rows=4)
    batch = {"x": torch.randn(32, 4), "ids": torch.arange(32), "scale": torch.tensor(2.0)}
    assert probe.capture(batch, module, None)
    assert probe.batch["x"].shape == (4, 4)
    assert probe.batch["ids"].tolist() == [0, 1, 2, 3]
    assert probe.batch["scale"].shape == ()  # not a batch dimension: kept whole
    bn = module.net[1]
    buffers = [b.clone() for b in module.buffers()]
    first = probe.score(trainer, module)
    torch.manual_seed(123)  # whatever state training is in, the probe sees the same noise and timesteps
    random.seed(7)
    np.random.seed(7)
    rng, host, np_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    second = probe.score(trainer, module)
    assert first == second
    assert torch.equal(torch.get_rng_state(), rng)  # the training streams are left as they were
    assert random.getstate() == host
    assert np.array_equal(np.random.get_state()[1], np_rng[1])
    assert all(torch.equal(a, b) for a, b in zip(buffers, module.buffers(), strict=True))
    assert int(bn.num_batches_tracked) == 0
    assert module.training
    assert all(m.training for m in module.modules())
    assert all(p.grad is None for p in module.parameters())
    assert module.logged == []  # self.log is a no-op while the probe is scored


def test_the_probe_follows_the_weights() -> None:
    torch.manual_seed(0)
    module, trainer = Diffusion(), _trainer()
    probe = ProbeBatch()
    probe.capture({"x": torch.randn(16, 4)}, module, None)
    before = probe.score(trainer, module)
    with torch.no_grad():
        module.net[-1].weight.mul_(30.0)
    assert probe.score(trainer, module) > 10 * before


class Manual(Diffusion):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimization_is_not_probed() -> None:
    probe = ProbeBatch()
    assert not probe.capture({"x": torch.randn(8, 4)}, Manual(), None)
    assert not probe.ready
    assert "manual optimization" in probe.disabled


def test_a_batch_without_a_batch_dimension_gives_no_probe() -> None:
    assert not ProbeBatch().capture({"lr": 0.1, "scale": torch.tensor(1.0)}, Diffusion(), None)


def test_a_training_step_that_returns_no_loss_or_raises_is_not_scored() -> None:
    class NoLoss(Diffusion):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None

    class Raises(Diffusion):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise RuntimeError("shape '[32, -1]' is invalid for input of size 32")

    probe = ProbeBatch()
    probe.capture({"x": torch.randn(8, 4)}, NoLoss(), None)
    assert probe.score(_trainer(), NoLoss()) is None  # nothing measured: not a NaN loss, which would be a rise
    assert probe.score(_trainer(), Raises()) is None
    book = SnapshotProbe()
    book.start(_trainer(), True)
    book.snapshot_taken(_trainer(), Raises(), 0, {"x": torch.randn(8, 4)}, None)
    assert book.book.scores == {}
    assert book.spike(_trainer(), Raises(), 5, [0], None) is None


class _Quarantine:
    """What the probe reads of the quarantine: the quarantined samples, and the samples behind a batch's rows."""

    def __init__(self) -> None:
        self.current = {"train": list(range(100, 132))}
        self.samples: set[int] = set()

    def samples_of(self, batch: Any, rows: list[int]) -> set[int]:
        return {self.current["train"][r] for r in rows}


def test_a_probe_holding_a_quarantined_sample_is_dropped_and_taken_again() -> None:
    torch.manual_seed(0)
    module, trainer, quarantine = Diffusion(), _trainer(), _Quarantine()
    probe = SnapshotProbe()
    probe.start(trainer, True)
    probe.snapshot_taken(trainer, module, 0, {"x": torch.randn(32, 4)}, quarantine)  # type: ignore[arg-type]
    assert probe.batch.samples == frozenset(range(100, 108))
    assert list(probe.book.scores) == [0]
    quarantine.samples = {103}  # one of the probe's samples turned out bad
    assert probe.spike(trainer, module, 10, [0], quarantine) is None  # type: ignore[arg-type]
    assert not probe.batch.ready
    assert probe.book.scores == {}
    quarantine.current = {"train": list(range(200, 232))}
    probe.snapshot_taken(trainer, module, 50, {"x": torch.randn(32, 4)}, quarantine)  # type: ignore[arg-type]
    assert probe.batch.samples == frozenset(range(200, 208))
    assert list(probe.book.scores) == [50]


def test_the_ranks_agree_whether_the_probe_is_scored(monkeypatch: Any) -> None:
    """Under DDP each rank holds other samples, so a quarantine can take one rank's probe only: every rank then drops
    its scores, and none scores (none enters the scoring's all-reduce) until every rank has a probe again."""
    from lightning_nanguard import _distributed

    torch.manual_seed(0)
    module, trainer, quarantine = Diffusion(), _trainer(), _Quarantine()
    probe = SnapshotProbe()
    probe.start(trainer, True)
    probe.snapshot_taken(trainer, module, 0, {"x": torch.randn(32, 4)}, quarantine)  # type: ignore[arg-type]
    assert list(probe.book.scores) == [0]
    other_rank = {"dropped": True, "unready": False}  # the other rank's probe held a quarantined sample

    def agree(trainer: Any, flags: list[Any]) -> list[bool]:
        return [bool(flags[0]) or other_rank["dropped"], bool(flags[1]) or other_rank["unready"]]

    monkeypatch.setattr(_distributed, "any_rank_each", agree)
    probe.snapshot_taken(trainer, module, 10, {"x": torch.randn(32, 4)}, quarantine)  # type: ignore[arg-type]
    assert list(probe.book.scores) == [10]  # this rank's scores were dropped with the other's, then scored again
    other_rank.update(dropped=False, unready=True)  # the other rank has no probe yet
    assert probe.spike(trainer, module, 20, [10], quarantine) is None  # type: ignore[arg-type]
    probe.snapshot_taken(trainer, module, 30, {"x": torch.randn(32, 4)}, quarantine)  # type: ignore[arg-type]
    assert list(probe.book.scores) == [10]
    assert probe.batch.ready  # this rank keeps its own probe


class Bookkeeping(pl.LightningModule):
    """A module whose training_step keeps Python state, as Lightning's docs show: the step outputs gathered for
    ``on_train_epoch_end``, a counter, a dict of seen batches, an attribute set on first call, a torchmetrics mean."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics import MeanMetric

        self.net = nn.Linear(4, 1)
        self.training_step_outputs: list[Tensor] = []
        self.calls = 0
        self.seen: dict[int, float] = {}
        self.train_mean = MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.net(batch["x"]).pow(2).mean()
        self.training_step_outputs.append(loss.detach())
        self.calls += 1
        self.seen[self.calls] = float(loss.detach())
        self.first_loss = getattr(self, "first_loss", float(loss.detach()))
        self.train_mean.update(loss.detach())
        return loss


def test_a_scoring_leaves_the_modules_python_state_as_it_was() -> None:
    torch.manual_seed(0)
    module, trainer = Bookkeeping(), _trainer()
    module.training_step({"x": torch.randn(8, 4)}, 0)  # one training step's worth of state
    outputs, seen, mean = list(module.training_step_outputs), dict(module.seen), module.train_mean.compute()
    probe = ProbeBatch(rows=4)
    assert probe.capture({"x": torch.randn(8, 4)}, module, None)
    assert math.isfinite(probe.score(trainer, module))
    assert module.training_step_outputs == outputs
    assert module.calls == 1
    assert module.seen == seen
    assert module.train_mean.compute() == mean
    assert "log" not in vars(module)
    del module.first_loss
    probe.score(trainer, module)
    assert not hasattr(module, "first_loss")  # an attribute the call added is gone again


def test_fsdp1_is_not_probed() -> None:
    # FSDPStrategy (FSDP1) gathers a module's parameters in its wrapper's forward: a scoring that calls training_step
    # on the module itself would see the flat shards. It is refused at the start of the fit, once, not failed at
    # every scoring.
    class FSDPStrategy:  # what nanguard reads of it: the class name
        pass

    class Trainer:
        strategy = FSDPStrategy()

    probe = SnapshotProbe()
    probe.start(Trainer(), True)  # type: ignore[arg-type]
    assert "FSDPStrategy" in probe.batch.disabled
    assert not probe.batch.capture({"x": torch.randn(8, 4)}, Diffusion(), None)
    probe.start(_trainer(), True)
    assert probe.batch.disabled == ""

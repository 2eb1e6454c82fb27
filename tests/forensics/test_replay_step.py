"""The replay is the step that ran: its own ``global_step``, epoch and batch index, online and offline, and a model
built in ``configure_model`` rebuilt offline (``nanguard replay``, ``replay_bundle``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import BundleError, default_callbacks, replay_bundle
from lightning_nanguard.cli import main


def _line(marker: str) -> int:
    with open(__file__, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# LINE: {marker}"))


class EveryThirdStep(pl.LightningModule):
    """A term added every third step (from the second epoch on) divides by a count that is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step % 3 == 2 and self.current_epoch == 1:
            self.log("outliers", (x > 10).sum().float())
            loss = loss + self.net(x).pow(2).sum() / (x > 10).sum()  # LINE: every-n
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 4, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)


class Deferred(pl.LightningModule):
    """Layers built in ``configure_model``; an all-zero record divides by 0."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body: nn.Module | None = None

    def configure_model(self) -> None:
        if self.body is None:
            self.body, self.head = nn.Linear(4, self.hparams.width), nn.Linear(self.hparams.width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert self.body is not None
        h = self.body(x) / x.norm(dim=-1, keepdim=True)  # LINE: deferred
        return nn.functional.mse_loss(self.head(h), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        x[5] = 0.0
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)


def _fit(model: pl.LightningModule, tmp_path: Path, epochs: int) -> list[dict[str, Any]]:
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=pl.loggers.CSVLogger(str(tmp_path), name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=default_callbacks(),
    )
    trainer.fit(model)
    path = tmp_path / "run" / "version_0" / "nanguard" / "incidents.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_term_added_every_n_steps_reproduces_online_and_offline(tmp_path: Path, capsys: Any) -> None:
    incidents = _fit(EveryThirdStep(), tmp_path, epochs=2)
    first = incidents[0]
    assert (first["step"], first["cause"]) == (2, "division_by_zero"), first  # not "transient": the replay ran at 2
    with open(os.path.join(first["bundle"], "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    assert (manifest["step"], manifest["epoch"], manifest["batch_idx"]) == (2, 1, 0)
    assert manifest["origin"]["frame"]["line"] == _line("every-n")

    capsys.readouterr()
    assert main(["replay", first["bundle"], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    run = out["runs"][0]
    assert run["reproduced"], run
    assert (run["origin"]["op"], run["origin"]["frame"]["line"]) == ("aten.div.Tensor", _line("every-n"))
    assert (out["cause"], out["incident_cause"]) == ("division_by_zero", "division_by_zero")


def test_a_model_built_in_configure_model_is_rebuilt_offline(tmp_path: Path, capsys: Any) -> None:
    incidents = _fit(Deferred(), tmp_path, epochs=1)
    bundle = incidents[0]["bundle"]
    assert bundle, incidents[0]
    capsys.readouterr()
    assert main(["replay", bundle, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"][0]["reproduced"], out
    assert out["runs"][0]["origin"]["frame"]["line"] == _line("deferred")
    assert out["cause"] == out["incident_cause"] == "division_by_zero"

    mine = Deferred()  # the user's own instance, not configured yet: configured on a copy, never changed
    found = replay_bundle(bundle, model=mine)
    assert found.runs[0].reproduced
    assert mine.body is None


def test_state_the_module_does_not_have_is_refused(tmp_path: Path) -> None:
    """A module whose layers are not where the bundle's state is (another class, a changed class) is refused, never
    replayed with the stored weights dropped."""
    bundle = _fit(Deferred(), tmp_path, epochs=1)[0]["bundle"]
    with pytest.raises(BundleError, match=r"the bundle's state lacks \['net.weight', 'net.bias'\]"):
        replay_bundle(bundle, model=EveryThirdStep())
    with pytest.raises(BundleError, match=r"has \['body.weight', 'body.bias', 'head.weight', 'head.bias'\]"):
        replay_bundle(bundle, model=pl.LightningModule())

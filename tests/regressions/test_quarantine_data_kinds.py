"""The quarantine on the data people really train on (issues 24 and 25): iterable datasets, custom batch samplers,
clustered bad records, several training loaders, a collate function that reorders rows.

Every dataset here holds real bad records (a NaN feature), and the model writes down the dataset index of every row
it trains on (stored in feature 0), so each test checks which samples were trained, not only the incident log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, TensorDataset

from lightning_nanguard import GradNormMonitor, default_callbacks
from lightning_nanguard.engine import get_engine
from tests.helpers import all_finite, make_trainer


def indexed_data(n: int, bad: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows whose feature 0 is the row's own index (so a batch says which samples it holds); ``bad`` rows hold
    a NaN in feature 2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x[:, 1:2] * 0.5 - x[:, 3:4] * 0.25
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    x[bad, 2] = float("nan")
    return x, y


class Recorder(pl.LightningModule):
    """A small regression that records, per epoch, the sample indices of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 1))
        self.seen: dict[int, list[list[int]]] = {}

    def record(self, x: torch.Tensor) -> None:
        self.seen.setdefault(self.current_epoch, []).append([int(v) for v in x[:, 0].tolist()])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x[:, 1:]), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.record(x)
        return self.step(x, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(
    tmp_path: Any, model: pl.LightningModule, epochs: int, extra: list[pl.Callback] | None = None
) -> tuple[pl.Trainer, GradNormMonitor]:
    monitor = GradNormMonitor()
    logger = CSVLogger(str(tmp_path), name="logs", version=0)
    callbacks = [*(extra or []), monitor]
    trainer = make_trainer(tmp_path, logger=logger, max_steps=-1, max_epochs=epochs, callbacks=callbacks)
    trainer.fit(model)
    assert all_finite(model)
    return trainer, monitor


def quarantine_file(tmp_path: Any) -> dict[str, Any]:
    with open(os.path.join(tmp_path, "logs", "version_0", "nanguard", "quarantine.json"), encoding="utf-8") as f:
        return dict(json.load(f))


def incidents(trainer: pl.Trainer) -> list[tuple[int, int, str, list[str]]]:
    return [(r.epoch, r.step, r.cause, r.actions) for r in get_engine(trainer).sink.records]


# ---------------------------------------------------------------------------------------------- no sample indices
class Stream(IterableDataset):
    """A stream of 32 records (the same each epoch), record 13 broken."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = indexed_data(32, bad=[13])
        yield from zip(x, y, strict=True)


class StreamModel(Recorder):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Stream(), batch_size=8)


# repro: iterable_dataset_bad_sample_crashes_fit.py
def test_an_iterable_dataset_bad_record_is_skipped_and_its_batch_kept_out_by_fingerprint(tmp_path: Any) -> None:
    # An IterableDataset has no sample indices (its BatchSampler yields None): the batch is quarantined by its
    # fingerprint, and when it comes back its update is dropped, without a new incident.
    trainer, monitor = fit(tmp_path, StreamModel(), epochs=3)
    assert incidents(trainer) == [(0, 1, "input_data", ["skip", "quarantine"])]
    saved = quarantine_file(tmp_path)
    assert (saved["samples"], len(saved["fingerprints"]), saved["dropped_batches"]) == ([], 1, 2)
    assert get_engine(trainer).skipped_steps == 3  # the incident's and the two returns'
    assert monitor.quarantined_samples == []


class LastBatchStream(IterableDataset):
    """A stream of 32 records (the same each epoch) in 4 batches, record 29 broken: the epoch's last batch."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = indexed_data(32, bad=[29])
        yield from zip(x, y, strict=True)


class StreamNormModel(Recorder):
    """Through a BatchNorm layer: the bad record's forward writes NaN into the running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(7, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(LastBatchStream(), batch_size=8)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_a_fingerprint_quarantined_batch_that_poisons_the_statistics_is_an_incident(
    tmp_path: Any, precision: str
) -> None:
    # The quarantined batch's update is dropped when it comes back, but its forward has already written NaN into the
    # BatchNorm statistics: a damaged state, an incident at that step (rolled back), whichever path drops the update
    # (the host path under 32-true, the GradScaler's device path under 16-mixed), not one the next step or the
    # end-of-fit check finds.
    trainer = make_trainer(tmp_path, precision, max_steps=-1, max_epochs=3, callbacks=default_callbacks())
    trainer.fit(StreamNormModel())
    assert [(epoch, step) for epoch, step, _cause, _actions in incidents(trainer)] == [(0, 3), (1, 7), (2, 11)]
    assert [cause for _e, _s, cause, actions in incidents(trainer) if "rollback" in actions][-2:] == [
        "corrupt_state",
        "corrupt_state",
    ]
    assert get_engine(trainer).ledger.final_state == "finite (checked at the end of fit)"


class FixedBatches(Sampler[list[int]]):
    """A custom batch sampler (bucketing, say): lists of indices, not a torch BatchSampler."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(0, self.n, self.size):
            yield list(range(k, min(k + self.size, self.n)))

    def __len__(self) -> int:
        return (self.n + self.size - 1) // self.size


class CustomSamplerModel(Recorder):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*indexed_data(32, bad=[21])), batch_sampler=FixedBatches(32, 8))


# repro: fingerprint_quarantine_recurs_as_new_incident.py
def test_a_fingerprint_quarantined_batch_is_one_incident_and_its_returns_are_counted(tmp_path: Any) -> None:
    trainer, _ = fit(tmp_path, CustomSamplerModel(), epochs=4)
    assert incidents(trainer) == [(0, 2, "input_data", ["skip", "quarantine"])]  # not one per epoch
    saved = quarantine_file(tmp_path)
    assert (len(saved["fingerprints"]), saved["dropped_batches"]) == (1, 3)
    with open(os.path.join(tmp_path, "logs", "version_0", "nanguard", "summary.txt"), encoding="utf-8") as f:
        assert "1 batch fingerprint(s); replaced 0 time(s), 3 batch update(s) dropped" in f.read()


# ---------------------------------------------------------------------------------------------- a corrupt shard
class ShardModel(Recorder):
    """64 samples in batches of 4; samples 16..23 (two whole batches) are broken: a corrupt shard."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*indexed_data(64, bad=list(range(16, 24)))), batch_size=4)


# repro: fully_quarantined_batch_becomes_one_sample_repeated.py
def test_a_fully_quarantined_batch_is_refilled_with_the_samplers_next_healthy_samples(tmp_path: Any) -> None:
    model = ShardModel()
    trainer, monitor = fit(tmp_path, model, epochs=2)
    assert [(epoch, cause) for epoch, _, cause, _ in incidents(trainer)] == [(0, "input_data")] * 2
    assert monitor.quarantined_samples == list(range(16, 24))
    second = model.seen[1]
    assert len(second) == 16  # as many batches as the sampler gives: Lightning's batch count holds
    assert all(len(set(batch)) == 4 for batch in second)  # four distinct samples each, never one sample repeated
    flat = [i for batch in second for i in batch]
    assert not set(flat) & set(range(16, 24))
    # The order the sampler gives, the quarantined samples left out; the pass's first healthy samples fill the end.
    assert flat == [*range(16), *range(24, 64), *range(8)]
    assert quarantine_file(tmp_path)["replaced"] == 8


# ---------------------------------------------------------------------------------------------- several loaders
BAD_B = 21


class TwoLoaders(Recorder):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = torch.zeros(())
        for key in ("a", "b"):
            x, y = batch[key]
            self.seen.setdefault(self.current_epoch, []).append([int(v) for v in x[:, 0].tolist()] + [ord(key)])
            loss = loss + self.step(x, y)
        return loss

    def train_dataloader(self) -> dict[str, DataLoader]:
        return {
            "a": DataLoader(TensorDataset(*indexed_data(64, bad=[])), batch_size=8),
            "b": DataLoader(TensorDataset(*indexed_data(32, bad=[BAD_B], seed=1)), batch_size=8),
        }


# repro: quarantine_multiple_train_loaders_wrong_samples.py
def test_two_training_loaders_each_keep_their_own_samples_out(tmp_path: Any) -> None:
    model = TwoLoaders()
    trainer, monitor = fit(tmp_path, model, epochs=3)
    assert incidents(trainer) == [(0, 2, "input_data", ["skip", "quarantine"])]
    saved = quarantine_file(tmp_path)
    assert (saved["samples"], saved["loaders"]) == ([BAD_B], {"b": [BAD_B]})
    assert monitor.quarantined_samples == [BAD_B]
    later = [batch for epoch in (1, 2) for batch in model.seen[epoch]]
    a_seen = {i for batch in later if batch[-1] == ord("a") for i in batch[:-1]}
    b_seen = {i for batch in later if batch[-1] == ord("b") for i in batch[:-1]}
    assert a_seen == set(range(64))  # sample 21 of loader "a" is healthy and still trained
    assert b_seen == set(range(32)) - {BAD_B}
    assert all(len(batch) == 9 for batch in later)  # every batch kept its size


# ---------------------------------------------------------------------------------------------- reordering collate
class Sequences(Dataset):
    """Variable-length sequences (feature 0: the sample index): one record holds a NaN."""

    BAD = 2  # the longest sequence of the first batch: row 0 once sorted

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(24):
            length = 2 + (i * 7) % 5
            x = torch.randn(length, 8, generator=g)
            x[:, 0] = float(i)
            if i == self.BAD:
                x[-1, 2] = float("nan")
            self.items.append((x, x[:, 1:2].mean(0) * 0.5))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[i]


def longest_first(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort by length, longest first (as ``pack_padded_sequence`` wants) and pad: the rows are not the sampler's
    order."""
    samples = sorted(samples, key=lambda s: -s[0].shape[0])
    x = nn.utils.rnn.pad_sequence([s[0] for s in samples], batch_first=True)
    return x, torch.stack([s[1] for s in samples])


class SequenceModel(Recorder):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.record(x[:, 0])
        return nn.functional.mse_loss(self.net(x[:, :, 1:]).mean(1), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Sequences(), batch_size=6, collate_fn=longest_first)


def test_a_collate_that_reorders_rows_quarantines_the_bad_sample_not_the_row(tmp_path: Any) -> None:
    model = SequenceModel()
    trainer, monitor = fit(tmp_path, model, epochs=3)
    first = model.seen[0][0]
    assert first.index(Sequences.BAD) != Sequences.BAD  # the bad sample is not at its sampler position
    assert incidents(trainer) == [(0, 0, "input_data", ["skip", "quarantine"])]
    assert monitor.quarantined_samples == [Sequences.BAD]
    later = {i for epoch in (1, 2) for batch in model.seen[epoch] for i in batch}
    assert later == set(range(24)) - {Sequences.BAD}  # every healthy sample still trained


# ---------------------------------------------------------------------------------------------- the file
class BadRowModel(Recorder):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*indexed_data(32, bad=[13])), batch_size=8, shuffle=False)


class FileProbe(pl.Callback):
    """Reads quarantine.json at each epoch end (what a user watching the run would see)."""

    def __init__(self, tmp_path: Any) -> None:
        self.path = os.path.join(tmp_path, "logs", "version_0", "nanguard", "quarantine.json")
        self.read: list[tuple[list[int], int]] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                saved = json.load(f)
            self.read.append((saved["samples"], saved["replaced"]))


def test_quarantine_json_is_true_after_each_change_and_at_the_end(tmp_path: Any) -> None:
    probe = FileProbe(tmp_path)
    _, monitor = fit(tmp_path, BadRowModel(), epochs=3, extra=[probe])
    assert probe.read == [([13], 0), ([13], 1), ([13], 2)]
    assert quarantine_file(tmp_path)["replaced"] == 2
    assert monitor.quarantined_samples == [13]

"""Models people really train: sparse buffers and gradients, lazy modules, caches that grow during fit. Each trains
under every callback as under plain Lightning, and a fault in it ends finite or with a documented error.

One test per script of ``../shared/repros/round3/`` on these kinds (``sparse_buffer_crashes_every_callback.py``,
``sparse_embedding_grad_crashes_fit.py``, ``lazy_module_autorollback_crashes_step0.py``,
``rollback_crashes_after_cache_buffer_grows.py``), each a real ``Trainer.fit`` of a tiny model.
"""

from __future__ import annotations

import pathlib
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuardError, default_callbacks, preset
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import make_trainer

N = 16  # graph nodes


def finite(module: nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return all(bool(torch.isfinite(t.coalesce().values() if t.is_sparse else t).all()) for t in tensors)


def rollbacks(trainer: pl.Trainer) -> list[int]:
    return [
        i.values["restored_from_step"] for i in get_engine(trainer).sink.records if "restored_from_step" in i.values
    ]


def _loader(*tensors: torch.Tensor, batch_size: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size)


class GCN(pl.LightningModule):
    """One graph convolution over a sparse normalised adjacency registered as a buffer, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, N, (2, 48), generator=g)
        adj = torch.sparse_coo_tensor(idx, torch.rand(48, generator=g) / 4, (N, N), check_invariants=True).coalesce()
        self.register_buffer("adj", adj)
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.autocast("cpu", enabled=False):  # sparse matmul has no autocast rule: in float32, as GCNs do
            h = torch.tanh(torch.sparse.mm(self.adj, self.lin(x[0]).float()))
        return nn.functional.mse_loss(self.head(h).float(), y[0].float())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        return _loader(torch.randn(16, N, 4, generator=g), torch.randn(16, N, 1, generator=g), batch_size=1)


class SparseEmbedding(pl.LightningModule):
    """A recommender's sparse embedding (sparse gradients) under SGD with momentum (sparse optimizer state)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)
        self.emb = nn.Embedding(100, 8, sparse=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, y = batch
        return nn.functional.mse_loss(self.head(self.emb(idx)).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return _loader(torch.randint(0, 100, (160,), generator=g), torch.randn(160, 1, generator=g))


class LazyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(160, 8, generator=g)
        return _loader(x, x[:, :1] - x[:, 1:2])


class RotaryCache(nn.Module):
    """A LLaMA-style cos cache, a non-persistent buffer rebuilt larger when a longer sequence arrives."""

    def __init__(self) -> None:
        super().__init__()
        self._build(4)

    def _build(self, n: int) -> None:
        self.register_buffer("cos_cached", torch.cos(torch.arange(n).float()), persistent=False)

    def forward(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        if seq_len > self.cos_cached.numel():
            self._build(seq_len)
        return x * self.cos_cached[:seq_len].mean()


class GrowingCacheModel(pl.LightningModule):
    def __init__(self, grow_at: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.rot = RotaryCache()
        self.grow_at = grow_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        seq_len = 8 if self.global_step >= self.grow_at else 4
        return nn.functional.mse_loss(self.rot(self.net(x), seq_len), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(160, 8, generator=g)
        return _loader(x, x[:, :1] - x[:, 1:2])


def fit(tmp_path: pathlib.Path, model: pl.LightningModule, callbacks: list[pl.Callback], **kw: Any) -> pl.Trainer:
    trainer = make_trainer(tmp_path, callbacks=callbacks, **{"max_steps": 14, **kw})
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize("name", [cls.__name__ for cls in preset.CALLBACKS])
def test_a_sparse_buffer_trains_under_every_callback(tmp_path: pathlib.Path, name: str) -> None:
    model = GCN()
    trainer = fit(tmp_path, model, default_callbacks(**{c.__name__: c.__name__ == name for c in preset.CALLBACKS}))
    assert finite(model)
    assert get_engine(trainer).ledger.final_state == "finite (checked at the end of fit)"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_a_sparse_buffer_rolls_back_with_the_model(tmp_path: pathlib.Path, precision: str) -> None:
    model = GCN()
    callbacks = [FaultInjector("param", steps=[7], value="nan"), *default_callbacks(AutoRollback={"every_n_steps": 2})]
    trainer = fit(tmp_path, model, callbacks, precision=precision)
    assert finite(model)
    assert rollbacks(trainer) == [6]
    assert model.adj.is_sparse


def test_sparse_gradients_are_read_and_their_momentum_rolls_back(tmp_path: pathlib.Path) -> None:
    model = SparseEmbedding()
    callbacks = [FaultInjector("param", steps=[9], value="nan"), *default_callbacks(AutoRollback={"every_n_steps": 4})]
    trainer = fit(tmp_path, model, callbacks)
    assert finite(model)
    assert rollbacks(trainer) == [8]
    momentum = trainer.optimizers[0].state[model.emb.weight]["momentum_buffer"]
    assert momentum.is_sparse
    assert bool(torch.isfinite(momentum.coalesce().values()).all())
    assert get_engine(trainer).ledger.finite_steps > 0  # the steps were read, not skipped over


def test_a_nan_sparse_gradient_is_a_dropped_update(tmp_path: pathlib.Path) -> None:
    class PoisonSparseGrad(pl.Callback):
        def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.global_step == 5:
                grad = pl_module.emb.weight.grad
                assert grad is not None
                assert grad.is_sparse
                grad = grad.coalesce()
                nan = torch.full_like(grad.values(), float("nan"))
                pl_module.emb.weight.grad = torch.sparse_coo_tensor(
                    grad.indices(), nan, grad.shape, check_invariants=True
                )

    model = SparseEmbedding()
    trainer = fit(tmp_path, model, [PoisonSparseGrad(), *default_callbacks()])
    assert finite(model)
    (incident,) = get_engine(trainer).sink.records
    assert incident.step == 5
    assert "skip" in [str(a) for a in incident.actions]


def test_a_lazy_module_trains_and_rolls_back_after_materializing(tmp_path: pathlib.Path) -> None:
    model = LazyModel()
    callbacks = [FaultInjector("param", steps=[7], value="nan"), *default_callbacks(AutoRollback={"every_n_steps": 2})]
    trainer = fit(tmp_path, model, callbacks)
    assert finite(model)
    assert rollbacks(trainer) == [6]


def test_a_lazy_module_is_snapshotted_again_once_materialized(tmp_path: pathlib.Path) -> None:
    # The step-0 snapshot predates the first forward; AutoRollback takes another at step 1, not 50 steps later.
    model = LazyModel()
    callbacks = [FaultInjector("param", steps=[3], value="nan"), *default_callbacks()]  # every_n_steps=50
    trainer = fit(tmp_path, model, callbacks)
    assert finite(model)
    assert rollbacks(trainer) == [1]


def test_a_snapshot_taken_before_a_lazy_module_materialized_is_passed_over(tmp_path: pathlib.Path) -> None:
    # The step-0 snapshot holds no value for the lazy layer (it had none yet): a rollback cannot use it, and with
    # nothing else to restore the fit ends with a documented error, never with torch's ValueError.
    model = LazyModel()
    callbacks = [FaultInjector("param", steps=[1], value="nan"), *default_callbacks(AutoRollback={"every_n_steps": 50})]
    with pytest.raises(NanGuardError):
        fit(tmp_path, model, callbacks)


@pytest.mark.parametrize("fault_step", [8, 12])
def test_a_rollback_restores_a_cache_that_grew_since_the_snapshot(tmp_path: pathlib.Path, fault_step: int) -> None:
    # Snapshots every 5 steps; the cache grows at step 6: the fault at step 8 restores step 5 (the cache as it was,
    # 4 entries, reallocated), the one at step 12 step 10 (the grown cache in place).
    model = GrowingCacheModel(grow_at=6)
    callbacks = [
        FaultInjector("param", steps=[fault_step], value="nan"),
        *default_callbacks(AutoRollback={"every_n_steps": 5}),
    ]
    trainer = fit(tmp_path, model, callbacks, max_steps=16)
    assert finite(model)
    assert rollbacks(trainer) == [5 if fault_step == 8 else 10]
    assert model.rot.cos_cached.numel() == 8  # grown again by the forwards after the rollback
    assert "cos_cached" not in model.state_dict()  # still non-persistent: re-registered, not added


def test_a_nan_in_a_grown_cache_is_restored_at_its_snapshot_size(tmp_path: pathlib.Path) -> None:
    model = GrowingCacheModel(grow_at=6)

    class PoisonCache(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            pl_module.rot.cos_cached[0] = float("nan")

    trainer = fit(tmp_path, model, [*default_callbacks(AutoRollback={"every_n_steps": 5}), PoisonCache()], max_steps=8)
    assert finite(model)
    assert model.rot.cos_cached.numel() == 4  # the step-5 snapshot's cache, reallocated
    assert rollbacks(trainer) == [5]


def test_a_buffer_registered_again_is_watched_from_the_next_epoch(tmp_path: pathlib.Path) -> None:
    # A running histogram re-registered larger at step 2 (epoch 0); a NaN written into it at step 6 (epoch 1) never
    # reaches the loss: only the step check of the buffers sees it, and only if it watches the new tensor.
    class Histogram(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)
            self.register_buffer("hist", torch.zeros(4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.global_step == 2:
                self.register_buffer("hist", torch.zeros(8))
            if self.global_step == 6:
                self.hist[0] = float("nan")
            return nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            return _loader(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))

    model = Histogram()
    trainer = make_trainer(tmp_path, callbacks=default_callbacks(AutoRollback={"every_n_steps": 1}), max_steps=10)
    trainer.fit(model)
    assert finite(model)
    steps = [i.step for i in get_engine(trainer).sink.records]
    assert steps[:1] == [6]

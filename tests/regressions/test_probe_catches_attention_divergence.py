"""A small Transformer whose attention logits run away is caught while finite, before its second snapshot.

A language model with hand-written attention (no QK layer norm) under AdamW, warmed up over 40 steps to a peak 10x
too high: at step ~40 its loss climbs from ~2.3 back to ~4, its untrained level, and stays there (2.9x the same model
at a sound peak at the end), nothing ever non-finite. The newest sound snapshot is then the untrained model (probe
loss 4.3), which weights that gave back everything they learned only reach again, never twice. The yardstick from the
recent past catches it: the probe's lowest score of the last 50 steps (at a spike it held), from which it gave back
a third or more of what it had learned, while the training loss (a median of five steps) gave back half of its own;
the first sign is a spike in four data orders and the training loss's climb alone in one. The
preset rolls back and ends within 1.25x of the model trained at a sound peak, over five data orders; the healthy twin
(the sound peak) gets no intervention and ends bit-identical.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import default_callbacks
from lightning_nanguard.engine import get_engine
from lightning_nanguard.policies.probe import LOST
from lightning_nanguard.signals.loss_climb import CLIMB_LOST

pytestmark = pytest.mark.timeout(180)

V, T, D, H = 64, 16, 32, 2  # vocabulary, context, width, heads
STEPS, WARMUP = 200, 40
SOUND, TOO_HIGH = 0.03, 0.3
ORDERS = (0, 1, 2, 3, 4)


def _markov(n: int, seed: int) -> Tensor:
    """Sequences of a Markov chain in which each token has 3 successors (a loss floor of log 3)."""
    g = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, V, (V, 3), generator=g)
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, T + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (n,), generator=g)
    for t in range(T):
        x[:, t + 1] = successors[x[:, t], torch.randint(0, 3, (n,), generator=g)]
    return x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(D, -1))
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)  # no QK norm: these grow at too high a rate
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attention = logits.masked_fill(causal, float("-inf")).softmax(-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, D))
        return x + self.mlp(self.ln2(x))


class LM(pl.LightningModule):
    def __init__(self, peak: float) -> None:
        super().__init__()
        self.peak = peak
        self.emb, self.pos = nn.Embedding(V, D), nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.Sequential(Block(), Block())
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V)
        self.losses: list[float] = []

    def loss(self, x: Tensor) -> Tensor:
        h = self.blocks(self.emb(x[:, :-1]) + self.pos)
        return nn.functional.cross_entropy(self.head(self.ln(h)).reshape(-1, V), x[:, 1:].reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss(batch[0])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.peak, weight_decay=0.0)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / WARMUP))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _fit(peak: float, callbacks: list[Any], order: int, root: Any) -> tuple[pl.Trainer, LM, float]:
    pl.seed_everything(0, verbose=False)
    module = LM(peak)
    trainer = pl.Trainer(
        max_steps=STEPS,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    loader = DataLoader(
        TensorDataset(_markov(2048, 0)), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(order)
    )
    trainer.fit(module, loader)
    with torch.no_grad():
        final = float(module.loss(_markov(512, 1)))  # held-out sequences of the same chain
    return trainer, module, final


def test_an_attention_divergence_is_caught_while_finite_and_ends_near_the_sound_peak(tmp_path: Any) -> None:
    ratios, probed_for = [], set()
    for order in ORDERS:
        _, unguarded, ruined = _fit(TOO_HIGH, [], order, tmp_path / f"unguarded-{order}")
        _, _, healthy = _fit(SOUND, [], order, tmp_path / f"healthy-{order}")
        assert all(math.isfinite(v) for v in unguarded.losses), order  # nothing is ever non-finite
        assert ruined > 2 * healthy, order  # but the run is ruined
        trainer, module, final = _fit(TOO_HIGH, default_callbacks(CheckpointGuard=False), order, tmp_path / f"p{order}")
        records = get_engine(trainer).sink.records
        assert [(str(r.trigger), str(r.cause)) for r in records] == [("probe_rose", "weights_diverging")], order
        first = records[0]
        assert [str(a) for a in first.actions] == ["rollback", "backoff"], order
        verdict = first.diagnosis["evidence"][0]
        assert verdict["probe_by_recent"] is True, (order, verdict)
        assert verdict["probe_lost"] >= LOST, (order, verdict)
        assert verdict["loss_lost"] >= CLIMB_LOST, (order, verdict)
        assert all(math.isfinite(v) for v in module.losses), order
        probed_for.add(verdict["probed_for"])
        if order == 0:  # the case: before the second snapshot, whose newest sound one is the untrained model
            assert first.step < 50, first
            assert first.values["restored_from_step"] == 0, first
            assert verdict["probe_after"] < 2 * verdict["probe_before"]  # no 2x rise over the untrained level
        ratios.append(final / healthy)
    assert max(ratios) <= 1.25, ratios
    # The first sign reaches the probe whichever it is: a spike, or the training loss's climb alone (order 3, at step
    # 36: the loss gave back half of what it had learned, the gradient norm no spike).
    assert probed_for == {"spike", "loss_climb"}, probed_for


def test_the_healthy_twin_gets_no_intervention_and_ends_bit_identical(tmp_path: Any) -> None:
    _, plain, _ = _fit(SOUND, [], 0, tmp_path / "unguarded")
    trainer, guarded, _ = _fit(SOUND, default_callbacks(CheckpointGuard=False), 0, tmp_path / "preset")
    assert get_engine(trainer).sink.records == []
    assert trainer.optimizers[0].param_groups[0]["lr"] == SOUND
    assert guarded.losses == plain.losses
    for (name, a), b in zip(guarded.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

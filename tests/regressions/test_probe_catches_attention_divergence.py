"""A small Transformer whose attention logits run away is caught before its second snapshot, while finite.

A language model with hand-written attention (no QK layer norm) under AdamW, warmed up over 40 steps to a peak 10x
too high: at step ~39 its loss jumps from ~2.2 to ~4.7 and stays near 3.7 (2.8x the same model at a sound peak),
nothing ever non-finite. The newest sound snapshot is the untrained model (probe loss 4.3), which weights that lost
everything only reach again, never twice; the probe's scores at the spikes it held earlier in the fit are the
yardstick from the recent past: back three quarters of the way from there to the untrained level is a rise. The preset
rolls back and ends within 1.25x of the model trained at a sound peak; the healthy twin (the sound peak) gets no
intervention.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import AutoRollback, default_callbacks
from lightning_nanguard.engine import get_engine

pytestmark = pytest.mark.timeout(120)

V, T, D, H = 64, 16, 32, 2  # vocabulary, context, width, heads
STEPS, WARMUP = 200, 40
SOUND, TOO_HIGH = 0.03, 0.3


def _markov(n: int, seed: int, vocab: int = V) -> Tensor:
    """Sequences of a Markov chain in which each token has 3 successors (a loss floor of log 3)."""
    g = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, vocab, (vocab, 3), generator=g)
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, T + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
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
    def __init__(self, peak: float, vocab: int = V) -> None:
        super().__init__()
        self.peak, self.vocab = peak, vocab
        self.emb, self.pos = nn.Embedding(vocab, D), nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.Sequential(Block(), Block())
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, vocab)
        self.losses: list[float] = []

    def loss(self, x: Tensor) -> Tensor:
        h = self.blocks(self.emb(x[:, :-1]) + self.pos)
        return nn.functional.cross_entropy(self.head(self.ln(h)).reshape(-1, self.vocab), x[:, 1:].reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss(batch[0])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.peak, weight_decay=0.0)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / WARMUP))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _fit(peak: float, callbacks: list[Any], root: Any, vocab: int = V) -> tuple[pl.Trainer, LM, float]:
    pl.seed_everything(0, verbose=False)
    module = LM(peak, vocab)
    trainer = pl.Trainer(
        max_steps=STEPS,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    data = TensorDataset(_markov(2048, 0, vocab))
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        final = float(module.loss(_markov(512, 1, vocab)))  # held-out sequences of the same chain
    return trainer, module, final


def test_an_attention_divergence_before_the_second_snapshot_is_caught_while_finite(tmp_path: Any) -> None:
    _, unguarded, unguarded_final = _fit(TOO_HIGH, [], tmp_path / "unguarded")
    _, _, healthy = _fit(SOUND, [], tmp_path / "healthy")
    assert all(math.isfinite(v) for v in unguarded.losses)  # nothing is ever non-finite
    assert unguarded_final > 2 * healthy  # but the run is ruined
    callbacks = default_callbacks(CheckpointGuard=False)
    trainer, module, final = _fit(TOO_HIGH, callbacks, tmp_path / "preset")
    records = get_engine(trainer).sink.records
    assert records, "nothing was caught"
    first = records[0]
    assert (str(first.trigger), str(first.cause)) == ("probe_rose", "weights_diverging")
    assert first.step < 50  # before the second snapshot: the newest sound one was the untrained model
    assert [str(a) for a in first.actions] == ["rollback", "backoff"]
    assert first.values["restored_from_step"] == 0
    verdict = first.diagnosis["evidence"][0]
    assert verdict["probe_recent"] is not None
    assert verdict["probe_after"] < 2 * verdict["probe_before"]  # no 2x rise over the untrained level
    assert all(math.isfinite(v) for v in module.losses)
    assert next(c for c in callbacks if isinstance(c, AutoRollback)).rollbacks >= 1
    assert final <= 1.25 * healthy, (final, healthy)


def test_the_healthy_twin_gets_no_intervention(tmp_path: Any) -> None:
    _, _, unguarded = _fit(SOUND, [], tmp_path / "unguarded")
    callbacks = default_callbacks(CheckpointGuard=False)
    trainer, _, final = _fit(SOUND, callbacks, tmp_path / "preset")
    assert get_engine(trainer).sink.records == []
    assert trainer.optimizers[0].param_groups[0]["lr"] == SOUND
    assert final == unguarded

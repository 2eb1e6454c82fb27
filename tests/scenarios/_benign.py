"""Healthy runs whose dynamics look alarming: the no-fault suite's tasks (``test_no_fault.py``).

Each task is a tiny model on data laid out in order (``shuffle=False``), so the alarming moment lands on a chosen
step: a domain switch, rare hard batches, a loss that falls by orders of magnitude, LR restarts, additive ``-inf``
attention masks, a warmup from a learning rate of 0. ``fit_task`` runs one under a list of callbacks and returns
what the suite judges: the final model's loss on the data it ends on (and the module, with its per-step losses).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import precision_kwargs

BATCH = 32
# AutoRollback's snapshot cadence in the preset: each alarming moment is placed so that a snapshot reads it.
EVERY = 50


@dataclass
class Task:
    """A healthy run: ``build(seed)`` gives the module and its training data; ``steps`` optimizer steps."""

    name: str
    build: Callable[[int], tuple[pl.LightningModule, TensorDataset]]
    steps: int
    eval_rows: slice  # the rows of the training data the final loss is measured on (the data the run ends on)


class SideState:
    """What a training_step keeps beside the weights, as users do: a list of step losses, a counter, an EMA of the
    weights in plain tensors and one in an ``AveragedModel`` (a submodule), a generator of the module's own drawn
    from each step. None of it feeds the loss: a guarded healthy run must end with all of it as the unguarded one."""

    losses: list[float]

    def keep_side_state(self, core: nn.Module, seed: int = 0) -> None:
        self.losses = []
        self.calls = 0
        self.ema = {k: v.detach().clone() for k, v in core.state_dict().items() if v.is_floating_point()}
        self.swa = AveragedModel(core, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        self.noise = torch.Generator().manual_seed(1000 + seed)
        self.draws: list[float] = []
        self._core = [core]  # a plain list: not registered twice

    def update_side_state(self, loss: Tensor) -> None:
        core = self._core[0]
        self.losses.append(float(loss.detach()))
        self.calls += 1
        with torch.no_grad():
            for k, v in core.state_dict().items():
                if k in self.ema:
                    self.ema[k].lerp_(v.float(), 0.1)
        self.swa.update_parameters(core)
        self.draws.append(float(torch.rand((), generator=self.noise)))

    def side_state(self) -> dict[str, Any]:
        """The side state as plain values (tensors cloned), for comparison."""
        return {
            "losses": list(self.losses),
            "calls": self.calls,
            "ema": {k: v.clone() for k, v in self.ema.items()},
            "swa": {k: v.clone() for k, v in self.swa.state_dict().items()},
            "noise": self.noise.get_state(),
            "draws": list(self.draws),
        }

    def trained_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer trains (not the averaged copy's)."""
        averaged = {id(p) for p in self.swa.parameters()}
        return [p for p in self.parameters() if id(p) not in averaged]  # type: ignore[attr-defined]


class Regression(SideState, pl.LightningModule):
    """An MLP (or a linear model, ``hidden=0``) under MSE; ``schedule`` builds a per-step LR scheduler."""

    def __init__(
        self,
        inputs: int,
        *,
        hidden: int = 32,
        lr: float = 1e-2,
        optimizer: str = "adamw",
        schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        super().__init__()
        self.net: nn.Module = (
            nn.Linear(inputs, 1)
            if hidden == 0
            else nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        )
        self.lr, self.optimizer_name, self.schedule = lr, optimizer, schedule
        self.keep_side_state(self.net)

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.update_side_state(loss)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.trained_parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.trained_parameters(), lr=self.lr)
        if self.schedule is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.schedule(opt), "interval": "step"}}


def _teacher(seed: int, inputs: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, 16), nn.Tanh(), nn.Linear(16, 1))


SWITCH = 97  # the first step of the new domain: the step-100 snapshot reads its fourth step


@torch.no_grad()
def _domain_switch(seed: int) -> tuple[pl.LightningModule, TensorDataset]:
    # A new data domain (a curriculum stage, a fine-tuning set): inputs drawn elsewhere, a second teacher added to the
    # targets. The loss jumps ~100x and the gradient norm ~20x, stay up a few steps, and fall as the model learns.
    g = torch.Generator().manual_seed(seed)
    first, second = SWITCH * BATCH, (200 - SWITCH) * BATCH
    xa = torch.randn(first, 8, generator=g)
    xb = torch.randn(second, 8, generator=g) + 0.5
    ya, yb = _teacher(seed, 8)(xa), _teacher(seed, 8)(xb) + 1.5 * _teacher(seed + 1, 8)(xb)
    return Regression(8), TensorDataset(torch.cat([xa, xb]), torch.cat([ya, yb]))


@torch.no_grad()
def linear_domain_switch(seed: int, input_scale: float) -> tuple[pl.LightningModule, TensorDataset]:
    """A linear model under SGD with momentum, switched at ``SWITCH`` to a new teacher on inputs ``input_scale`` x
    larger. At 1x the loss jumps ~30000x, the gradient norm ~100x, and they fall back; at 4x the curvature puts the
    learning rate past the stability edge and the loss grows by orders of magnitude without turning (a divergence)."""
    g = torch.Generator().manual_seed(seed)
    first, second = SWITCH * BATCH, (200 - SWITCH) * BATCH
    xa, xb = torch.randn(first, 8, generator=g), torch.randn(second, 8, generator=g) * input_scale
    wa, wb = torch.randn(8, 1, generator=g) / math.sqrt(8), torch.randn(8, 1, generator=g) * 3 / math.sqrt(8)
    return Regression(8, hidden=0, lr=0.05, optimizer="sgd"), TensorDataset(
        torch.cat([xa, xb]), torch.cat([xa @ wa, xb @ wb])
    )


@torch.no_grad()
def _hard_batches(seed: int) -> tuple[pl.LightningModule, TensorDataset]:
    # A few rare hard batches (their targets far off the usual ones, as a noisy or rare slice of the data would be):
    # one at a snapshot step, two between; each lifts the loss ~500x and the gradient norm ~30x for one step.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(160 * BATCH, 8, generator=g)
    y = _teacher(seed, 8)(x)
    for step in (37, EVERY * 2, 131):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        y[rows] = y[rows] * 4.0 + torch.randn(BATCH, 1, generator=g)
    return Regression(8), TensorDataset(x, y)


@torch.no_grad()
def _heavy_tailed(seed: int) -> tuple[pl.LightningModule, TensorDataset]:
    # Valid inputs with a heavy tail (a Student-t with 1.5 degrees of freedom): most batches are ordinary, a few hold
    # a row tens of times larger than the rest, and their gradient norm jumps 20-100x for one step.
    g = torch.Generator().manual_seed(seed)
    n = 160 * BATCH
    normal = torch.randn(n, 8, generator=g)
    chi = torch.distributions.Chi2(torch.tensor(1.5)).sample((n, 1)) / 1.5
    x = normal / chi.sqrt().clamp_min(1e-3)
    w = torch.randn(8, 1, generator=g) / math.sqrt(8)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return Regression(8, hidden=0), TensorDataset(x, y)


@torch.no_grad()
def _solved(seed: int) -> tuple[pl.LightningModule, TensorDataset]:
    # A task the model solves exactly (a noiseless linear target): the loss falls from ~1 to ~1e-8.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200 * BATCH, 8, generator=g)
    w = torch.randn(8, 1, generator=g) / math.sqrt(8)
    return Regression(8, hidden=0, lr=0.05, optimizer="sgd"), TensorDataset(x, x @ w)


def _restarts(seed: int) -> tuple[pl.LightningModule, TensorDataset]:
    # Cosine annealing with warm restarts every 25 steps: the learning rate jumps back to its peak at each restart.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(160 * BATCH, 8, generator=g)
    with torch.no_grad():
        y = _teacher(seed, 8)(x)

    def schedule(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=25)

    return Regression(8, lr=5e-2, schedule=schedule), TensorDataset(x, y)


def _warmup(seed: int) -> tuple[pl.LightningModule, TensorDataset]:
    # A linear warmup from a learning rate of 0 over 40 steps, SGD with momentum.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(160 * BATCH, 8, generator=g)
    with torch.no_grad():
        y = _teacher(seed, 8)(x)

    def schedule(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 40))

    return Regression(8, lr=0.1, optimizer="sgd", schedule=schedule), TensorDataset(x, y)


class Attention(SideState, pl.LightningModule):
    """One causal self-attention layer over padded token sequences: each batch carries an additive key-padding mask
    (``0`` or ``-inf``), and the causal mask is a buffer of ``-inf`` above the diagonal. The task: predict the token
    before each position (a copy the attention can learn)."""

    def __init__(self, vocab: int = 16, dim: int = 32, length: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(length, dim) * 0.1)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, vocab)
        self.register_buffer("causal", torch.full((length, length), float("-inf")).triu(1))
        self.keep_side_state(self.qkv)

    def forward(self, tokens: Tensor, pad_mask: Tensor) -> Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]) + self.causal + pad_mask
        return self.out(torch.softmax(scores, dim=-1) @ v + h)

    def loss(self, batch: Any) -> Tensor:
        tokens, pad_mask, targets = batch
        logits = self(tokens, pad_mask)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.update_side_state(loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.trained_parameters(), lr=1e-2)


def _masked_attention(seed: int) -> tuple[pl.LightningModule, TensorDataset]:
    g = torch.Generator().manual_seed(seed)
    n, length = 120 * BATCH, 12
    tokens = torch.randint(0, 16, (n, length), generator=g)
    lengths = torch.randint(3, length + 1, (n,), generator=g)
    padded = torch.arange(length)[None, :] >= lengths[:, None]  # padding at the end: every query sees key 0
    pad_mask = torch.zeros(n, 1, length).masked_fill(padded[:, None, :], float("-inf"))
    targets = torch.full((n, length), -100)
    targets[:, 1:] = tokens[:, :-1]
    targets[padded] = -100
    tokens = tokens.masked_fill(padded, 0)
    torch.manual_seed(seed)
    return Attention(length=length), TensorDataset(tokens, pad_mask, targets)


TASKS = {
    task.name: task
    for task in (
        Task("domain-switch", _domain_switch, 200, slice(SWITCH * BATCH, None)),
        Task("domain-switch-sgd", lambda seed: linear_domain_switch(seed, 1.0), 200, slice(SWITCH * BATCH, None)),
        Task("hard-batches", _hard_batches, 160, slice(None)),
        Task("heavy-tailed", _heavy_tailed, 160, slice(None)),
        Task("solved", _solved, 200, slice(None)),
        Task("lr-restarts", _restarts, 160, slice(None)),
        Task("masked-attention", _masked_attention, 120, slice(None)),
        Task("warmup", _warmup, 160, slice(None)),
    )
}


@dataclass
class Fit:
    """One run: the trainer, the module, and the final model's loss on the task's ``eval_rows`` (float32)."""

    trainer: pl.Trainer
    module: Any
    final_loss: float


def fit_task(task: str | Task, callbacks: list[Callback], root: str, seed: int = 0, precision: str = "32-true") -> Fit:
    """Fit ``task`` (or ``TASKS[task]``) from ``seed`` with ``callbacks`` (``"16-mixed"``: a real float16 autocast
    and GradScaler)."""
    task = TASKS[task] if isinstance(task, str) else task
    pl.seed_everything(seed, verbose=False)
    module, data = task.build(seed)
    trainer = pl.Trainer(
        **precision_kwargs(precision),
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        max_steps=task.steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=True,
        callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(data, batch_size=BATCH, shuffle=False))
    rows = TensorDataset(*(t[task.eval_rows] for t in data.tensors))
    module.eval()
    with torch.no_grad():
        final = float(module.loss(rows[:]))
    return Fit(trainer, module, final)

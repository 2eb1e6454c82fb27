"""The two GPTs the benchmarks measure (PERFORMANCE.md): a small one and a deep, few-tokens-per-step one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True)
class GPTConfig:
    name: str
    layers: int
    d: int
    heads: int
    seq: int
    batch: int
    vocab: int


SMALL = GPTConfig("gpt_small", layers=4, d=256, heads=4, seq=128, batch=16, vocab=4096)  # ~4.2M params, 52 tensors
DEEP = GPTConfig("gpt_deep", layers=24, d=288, heads=4, seq=64, batch=4, vocab=8192)  # ~26M params, 292 tensors


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class GPT(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, steps: int = 64) -> None:
        super().__init__()
        self.cfg, self.steps = cfg, steps
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Parameter(torch.zeros(1, cfg.seq, cfg.d))
        self.blocks = nn.ModuleList(Block(cfg.d, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()  # tied head

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, foreach=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Tokens(self.cfg, self.steps * self.cfg.batch), batch_size=self.cfg.batch)


class _Tokens(Dataset):
    def __init__(self, cfg: GPTConfig, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, cfg.vocab, (n, cfg.seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

torch.set_num_threads(1)
os.environ.setdefault("PL_DISABLE_FORK", "1")


@pytest.fixture(autouse=True)
def _seed_and_rank() -> None:
    rank_zero_only.rank = 0  # type: ignore[attr-defined]
    pl.seed_everything(1234, verbose=False)

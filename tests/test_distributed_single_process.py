from __future__ import annotations

from typing import Any

import torch

from lightning_nanguard._distributed import any_rank, any_rank_each
from tests.helpers import make_trainer


def test_flags_on_one_device(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path)
    assert any_rank_each(trainer, [True, False, torch.tensor(True), torch.tensor(0.0)]) == [True, False, True, False]
    assert any_rank_each(trainer, []) == []
    assert any_rank(trainer, torch.tensor(False)) is False

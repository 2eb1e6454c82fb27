"""The evidence readers (``signals.batch``, ``signals.state``, ``signals.history``) on plain tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_nanguard.signals.batch import read_batch, target_tensor
from lightning_nanguard.signals.history import read_history
from lightning_nanguard.signals.state import eps_underflows, read_state, trial_adam_update


def test_batch_rows_outliers_and_targets() -> None:
    x = torch.randn(6, 4)
    x[1, 2] = float("nan")
    x[4] = 5e4
    y = torch.tensor([0, 1, 2, 12, -1, 3])
    f = read_batch((x, y), 10)
    assert f.nonfinite_rows == (1,)
    assert f.magnitude_rows == (4,)
    assert f.target_rows == (3, 4)
    assert (f.target_min, f.target_max, f.output_size) == (-1, 12, 10)


def test_targets_come_from_a_label_key_not_integer_inputs() -> None:
    ids = torch.randint(0, 30000, (2, 5))
    labels = target_tensor({"input_ids": ids, "labels": torch.tensor([1, 0])})
    assert labels is not None
    assert labels.tolist() == [1, 0]
    assert target_tensor({"input_ids": ids}) is None
    assert read_batch({"input_ids": ids}, 2).target_rows == ()


def test_a_whole_batch_at_another_scale_is_not_an_outlier_row() -> None:
    assert read_batch((torch.randn(8, 4) * 1e4,)).magnitude_rows == ()


def test_eps_underflow_is_found_per_dtype() -> None:
    p16, p32 = nn.Parameter(torch.zeros(2, dtype=torch.float16)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [p16]}, {"params": [p32]}], eps=1e-8)
    assert eps_underflows([opt]) == ["optimizer0 group 0: eps=1e-08 is 0 in torch.float16"]
    assert eps_underflows([torch.optim.AdamW([p16], eps=1e-4)]) == []


@pytest.mark.parametrize("amsgrad", [False, True])
def test_trial_adam_update_is_the_update_adamw_made(amsgrad: bool) -> None:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5))
    opt = torch.optim.Adam([p], lr=0.1, amsgrad=amsgrad, foreach=False)
    for _ in range(3):
        before = p.detach().clone()
        p.grad = torch.randn(5)
        opt.step()
    update = trial_adam_update(opt, p)
    assert update is not None
    torch.testing.assert_close(before + update, p.detach())


def test_trial_update_is_nonfinite_in_fp16_with_eps_1e8_and_reads_only() -> None:
    p = nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.AdamW([p], lr=1e-3, eps=1e-8)
    p.grad = torch.tensor([1e-4, 0.0, 0.5, 1.0], dtype=torch.float16)
    state_before = None
    opt.step()
    state_before = copy.deepcopy(opt.state[p])
    with torch.no_grad():
        p.fill_(float("nan"))
    assert not bool(torch.isfinite(trial_adam_update(opt, p)).all())  # type: ignore[arg-type]
    model = nn.Module()
    model.w = p
    found = read_state(model, [opt])
    assert found.parameters == ("w",)
    assert found.update_nonfinite == ("w",)
    assert all(torch.equal(state_before[k], opt.state[p][k]) for k in state_before)


def test_history_rising_needs_a_climb_not_one_jump() -> None:
    assert read_history([(0, 1.0, 1.0), (1, 1.0, 1.0), (2, 1.0, 1.0), (3, 9.0, 1.0)]).rising is False
    climb = read_history([(0, 1.0, 1.0), (1, 2.0, 1.1), (2, 4.0, 1.2), (3, 9.0, 1.3)])
    assert climb.grad_norm_rising
    assert "rising" in climb.summary()
    assert read_history([]).summary() == "no finite step recorded yet"


def test_targets_are_checked_only_against_a_known_output_size_and_ignore_index_is_fine() -> None:
    y = torch.tensor([[1, 2, -100], [3, 40, -100]])
    assert read_batch((torch.zeros(2, 3), y)).target_rows == ()  # no size: not checked, only described
    f = read_batch((torch.zeros(2, 3), y), 10)
    assert f.target_rows == (1,)
    assert (f.target_min, f.target_max) == (1, 40)

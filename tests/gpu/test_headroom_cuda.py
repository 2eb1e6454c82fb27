"""PrecisionHeadroom on CUDA under 16-mixed: a module headed for a float16 overflow is promoted before it overflows,
the loss scale is lowered before the backward overflows, and a sample adds no CUDA synchronization to the step.

On a GPU (``-m gpu``, ``benchmarks/gpu_check.sh``); skipped without one. ``NANGUARD_GPU_TESTS_ON=cpu`` runs the first
two on the CPU (the GradScaler's CPU stand-in): a check of their logic, not a substitute. The models are the CPU
tests' (``tests/callbacks/test_precision_headroom.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_nanguard import PrecisionHeadroom, default_callbacks
from lightning_nanguard.engine import get_engine
from tests.callbacks.test_precision_headroom import ClassHead, GrowingAttention
from tests.gpu._helpers import ACCELERATOR, gpu, gpu_trainer, needs_cuda
from tests.gpu.test_device_paths import SyncsPerStep
from tests.helpers import TinyModel

pytestmark = gpu


@pytest.mark.parametrize(("model_cls", "expected"), [(ClassHead, "head"), (GrowingAttention, "scores")])
def test_a_module_headed_for_overflow_is_promoted_before_it_overflows(
    tmp_path: Any, model_cls: type, expected: str
) -> None:
    torch.manual_seed(0)
    unguarded = model_cls()
    gpu_trainer(tmp_path / "plain", "16-mixed", max_steps=80).fit(unguarded)
    assert unguarded.nonfinite > 5  # the overflow is real on this device too
    torch.manual_seed(0)
    guarded, callbacks = model_cls(), default_callbacks()
    trainer = gpu_trainer(tmp_path / "guarded", "16-mixed", max_steps=80, callbacks=callbacks)
    trainer.fit(guarded)
    assert guarded.nonfinite == 0
    headroom = next(c for c in callbacks if isinstance(c, PrecisionHeadroom))
    assert headroom.promoted == [expected]
    assert [(r.trigger, r.where) for r in get_engine(trainer).sink.records] == [("headroom_forecast", expected)]


def test_the_loss_scale_is_lowered_before_the_backward_overflows(tmp_path: Any) -> None:
    # TinyModel at the GradScaler's 65536: its loss-scaled gradient keeps less than 4 bits of float16 headroom, so
    # the first sample lowers the scale; nothing is an incident and no update is dropped.
    callbacks = default_callbacks()
    # The GradScaler as Lightning builds it on CUDA (65536); the CPU stand-in's helper default starts at 1024.
    kw = (
        {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
        if ACCELERATOR == "cpu"
        else {}
    )
    trainer = gpu_trainer(tmp_path, "16-mixed", max_steps=12, callbacks=callbacks, **kw)
    trainer.fit(TinyModel())
    headroom = next(c for c in callbacks if isinstance(c, PrecisionHeadroom))
    assert headroom.watch.scaled.lowerings.count >= 1, "the scale was not lowered"
    assert get_engine(trainer).sink.records == []
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


@needs_cuda
def test_a_sample_adds_no_cuda_synchronization(tmp_path: Any) -> None:
    # A sample every 2 steps (so that the counted steps hold several), against the same fit without the callback:
    # the reduction, the MAX all-reduce (none on one device), the non-blocking copy and the read two steps later add
    # no synchronization, nor does a loss-scale cut.
    def syncs(callbacks: list[Any], root: str) -> list[int]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            counter = SyncsPerStep(caught)
            trainer = gpu_trainer(
                tmp_path / root, "16-mixed", max_steps=10, log_every_n_steps=50, callbacks=[*callbacks, counter]
            )
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.fit(TinyModel())
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return counter.per_step[1:]

    plain = syncs([], "plain")
    sampled = syncs([PrecisionHeadroom(every_n_steps=2)], "sampled")
    assert sampled == plain, (plain, sampled)

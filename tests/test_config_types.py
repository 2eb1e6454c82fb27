"""One configuration type per callback (lightning_nanguard.config): each callback's arguments are declared once, with
the callback's signature, validated once at construction, and read from there by the callback and the engine."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_nanguard
import lightning_nanguard.callbacks
from lightning_nanguard import GradNormMonitor, NanGuardConfigError
from lightning_nanguard.config import CONFIGS, GradNormMonitorConfig, argument_rows
from lightning_nanguard.engine import get_engine
from tests.helpers import make_trainer

CALLBACKS = sorted(lightning_nanguard.callbacks.__all__)


@pytest.mark.parametrize("callback", CALLBACKS)
def test_the_configuration_declares_the_signature(callback: str) -> None:
    cls = getattr(lightning_nanguard, callback)
    params = inspect.signature(cls).parameters
    rows = argument_rows(CONFIGS[callback])
    assert [(name, default) for name, default, _, _ in rows] == [(n, repr(p.default)) for n, p in params.items()]
    built = cls()
    assert isinstance(built.config, CONFIGS[callback])
    for name in set(params) - {"triggers"}:  # an argument reads as an attribute (triggers: the parsed set)
        assert getattr(built, name) == getattr(built.config, name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.config.owner = "other"


def test_the_configuration_validates_as_the_callback_does() -> None:
    with pytest.raises(NanGuardConfigError, match=r"GradNormMonitor\(spike_warmup=0\): must be an int >= 1\."):
        GradNormMonitorConfig(spike_warmup=0)
    with pytest.raises(NanGuardConfigError, match=r"^GradNormMonitor\(on_spike='skip', spike_zscore=None\)"):
        GradNormMonitor(on_spike="skip")

    class Mine(GradNormMonitor):
        pass

    with pytest.raises(NanGuardConfigError, match=r"^Mine\(spike_warmup=0\)"):
        Mine(spike_warmup=0)
    config = GradNormMonitorConfig(max_replay_steps=3, bundle_mb=1)
    assert isinstance(config.max_replay_steps, float)
    assert isinstance(config.bundle_mb, float)


class _SeeGuard(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard = get_engine(trainer).registry.guard


def test_the_engine_reads_the_monitors_configuration(tmp_path: Path) -> None:
    monitor, spy = GradNormMonitor(spike_zscore=6.0, max_consecutive_skips=7), _SeeGuard()
    make_trainer(tmp_path, callbacks=[monitor, spy], max_steps=2).fit(BoringModel())
    assert spy.guard is monitor.config  # no copy: the engine holds the configuration the monitor was built with
    assert spy.guard.owner == "GradNormMonitor"
    assert spy.guard.max_consecutive_skips == 7


@pytest.mark.parametrize(
    ("callback", "arguments"),
    [("OptimizerBackoff", {"lr_factor": 2.0}), ("AutoRollback", {"max_rollbacks": -1})],
)
def test_a_refusal_traceback_ends_under_the_constructor(callback: str, arguments: dict[str, object]) -> None:
    """A bad argument's traceback is the caller, the constructor and ``from_arguments``: none of the frames of the
    rules that found it (LightningCLI prints every frame of an error in a config file)."""
    import traceback

    with pytest.raises(NanGuardConfigError) as caught:
        getattr(lightning_nanguard, callback)(**arguments)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert [f.name for f in frames][-2:] == ["__init__", "from_arguments"]
    assert len(frames) == 3
    assert callback in str(caught.value)

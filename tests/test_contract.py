"""Checks every exported callback passes, discovered from ``__all__`` (adding a callback opts it in)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_nanguard
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer

CALLBACKS = [
    obj
    for obj in (getattr(lightning_nanguard, n) for n in lightning_nanguard.__all__)
    if isinstance(obj, type) and issubclass(obj, Callback)
]


@pytest.mark.parametrize("cb_cls", CALLBACKS, ids=lambda c: c.__name__)
def test_default_constructible_copyable_picklable(cb_cls: type[Callback]) -> None:
    cb = cb_cls()
    copy.deepcopy(cb)
    pickle.loads(pickle.dumps(cb))


@pytest.mark.parametrize("cb_cls", CALLBACKS, ids=lambda c: c.__name__)
def test_state_round_trip_is_weights_only_safe(cb_cls: type[Callback], tmp_path: Any) -> None:
    a, b = cb_cls(), cb_cls()
    path = tmp_path / "state.pt"
    torch.save(a.state_dict(), path)
    b.load_state_dict(torch.load(path, weights_only=True))
    assert b.state_dict() == a.state_dict()
    b.load_state_dict({})  # tolerant of older/empty state


@pytest.mark.parametrize("cb_cls", CALLBACKS, ids=lambda c: c.__name__)
def test_healthy_fit_has_no_incidents_and_no_warnings(cb_cls: type[Callback], tmp_path: Any) -> None:
    # 16-mixed (the CPU GradScaler) is a precision every callback has work to do in. Any warning fails the test
    # (pytest runs with filterwarnings=error; only third-party noise is allowlisted in pyproject.toml).
    trainer = make_trainer(tmp_path, "16-mixed", callbacks=[cb_cls()], limit_val_batches=2)
    trainer.fit(TinyModel())
    assert len(get_engine(trainer).sink.records) == 0


def test_cli_yaml_can_configure_every_callback() -> None:
    """Each callback is settable from a LightningCLI-style YAML (class_path/init_args), defaults only."""
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    entries = "\n".join(f"  - class_path: lightning_nanguard.{c.__name__}" for c in CALLBACKS)
    cfg = parser.parse_string(f"callbacks:\n{entries}\n")
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    built = instantiate(cfg).callbacks
    assert [type(cb) for cb in built] == CALLBACKS


def test_incident_records_load_weights_only(tmp_path: Any) -> None:
    # Users save what nanguard hands them (an incident's action and cause) next to tensors and load it back with
    # torch.load(weights_only=True), as they do every checkpoint.
    trainer = make_trainer(
        tmp_path,
        callbacks=[FaultInjector("loss", steps=[2]), *lightning_nanguard.default_callbacks()],
    )
    trainer.fit(TinyModel())
    records = get_engine(trainer).sink.records
    assert records
    torch.save([(r.step, r.action, r.cause) for r in records], tmp_path / "incidents.pt")
    loaded = torch.load(tmp_path / "incidents.pt", weights_only=True)
    assert loaded == [(r.step, r.action, r.cause) for r in records]
    assert loaded[0][1] is records[0].action

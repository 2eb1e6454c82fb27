"""PrecisionHeadroom on a ``torch.compile``d LightningModule (inductor, CPU, 16-mixed).

A graph torch.compile traced without a forward hook does not guard on one being added later: a hook registered for
one sample only would run at the first compile and never again. On a compiled module the probe's hooks therefore
stay registered and gate on an armed flag, which the graphs guard: one recompile (armed and disarmed), then every
sample holds the same values as in eager mode, and the run's parameters are those of the same compiled run without
the callback. The per-op headroom of a compiled module is taken by the first step's trial only, an eager forward
(``torch.compiler.set_stance("force_eager")``): a dispatch mode sees no aten op inside a compiled graph.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch._dynamo.utils import counters

from lightning_nanguard import PrecisionHeadroom
from tests.helpers import TinyModel, make_trainer, params_of

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning"),  # inductor's imports
]


class Tiny(TinyModel):
    """TinyModel without its per-step host read (``float(loss)`` would split every compiled graph in two)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y.float())


def _fit(tmp_path: Any, callbacks: list[Any], *, compiled: bool) -> tuple[Tiny, dict[str, int]]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    model = Tiny()
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    trainer = make_trainer(tmp_path, "16-mixed", callbacks=callbacks, max_steps=16, plugins=plugins)
    trainer.fit(torch.compile(model) if compiled else model)  # type: ignore[arg-type]
    return model, dict(counters["stats"])


def test_samples_of_a_compiled_module_hold_the_eager_values_and_change_nothing(tmp_path: Any) -> None:
    eager = PrecisionHeadroom(every_n_steps=4)
    _fit(tmp_path / "eager", [eager], compiled=False)
    plain, _ = _fit(tmp_path / "plain", [], compiled=True)
    callback = PrecisionHeadroom(every_n_steps=4)
    guarded, stats = _fit(tmp_path / "guarded", [callback], compiled=True)

    book, reference = callback.watch.book, eager.watch.book
    outputs = {"body.0", "body.1", "head"}
    assert set(book.modules) == outputs | {f"{name} (ops)" for name in outputs}
    for name in outputs:  # the ops of a compiled module are seen by the first step's eager trial only
        assert [s for s, _, _ in book.modules[f"{name} (ops)"]] == [0]
        assert book.modules[f"{name} (ops)"][0][1] == pytest.approx(reference.modules[f"{name} (ops)"][0][1])
    for name in outputs:  # every sample, at the same steps, with the eager values
        samples = reference.modules[name]
        assert [s for s, _, _ in book.modules[name]] == [s for s, _, _ in samples]
        assert [a for _, a, _ in book.modules[name]] == pytest.approx([a for _, a, _ in samples], rel=1e-3)
    assert len(reference.modules["head"]) >= 4
    assert callback.watch.scaled.bits == pytest.approx(eager.watch.scaled.bits, abs=0.01)
    assert callback.watch.scaled.lowerings.count == eager.watch.scaled.lowerings.count == 1
    assert stats["unique_graphs"] <= 2  # the step with the hooks armed, and without
    for name, value in params_of(guarded).items():
        assert torch.equal(value, params_of(plain)[name]), name

"""The first half-precision step of a fit, tried before it runs: one traced forward of its batch, leaving no trace.

The riskiest step of a ``16-mixed`` fit is its first: a model trained in float32 (or resumed from one) may overflow
float16 at once, before any sample of the headroom forecast has a history. ``trial_forward`` runs the
LightningModule's own ``training_step`` on the step's batch once, under ``no_grad`` and the training precision's
context, with an ``OpProbe`` armed (every half-precision op's abs-max, by module), before the step's forward; the
forecast reads it and promotes a module that cannot run in float16 before the real forward overflows. It leaves no
trace, as the probe batch's scoring does (``recovery.probe``): buffers run on copies, the RNG streams (torch's,
Python's, NumPy's), modes, autocast and grad mode are put back, ``self.log`` is a no-op for the call and the modules'
own Python state is restored. It runs eagerly on a compiled module (``torch.compiler.set_stance("force_eager")``): a
traced eager forward, no graph compiled for it. The per-module vector is reduced across ranks (MAX: every rank runs the trial at the same
step, and reduces even when its ``training_step`` raised) and read on the host once by the caller: the one
synchronization the trial costs, once per fit. Manual optimization is not tried (its ``training_step`` steps the optimizers).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_nanguard import _distributed, _notices
from lightning_nanguard._lightning_compat import AttributePatches
from lightning_nanguard.forensics.isolation import preserved_attributes, preserved_state, swapped
from lightning_nanguard.signals.op_headroom import OpProbe

try:  # NumPy's global RNG is a training stream too where a training_step draws from it
    import numpy as np
except ImportError:  # pragma: no cover - torch installs it
    np = None  # type: ignore[assignment]

__all__ = ["trial_forward"]


def trial_forward(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, probe: OpProbe) -> torch.Tensor:
    """``probe.reduce``'s vector for one traced ``training_step`` of ``batch``, reduced across ranks, on the device;
    every entry -1 where nothing was measured (``training_step`` raised, or ran no half-precision op in a watched
    module)."""
    size = 2 * len(probe.names)
    local: torch.Tensor | None = None
    if pl_module.automatic_optimization:
        local = _traced(trainer, pl_module, batch, probe)
    if local is None:
        local = torch.full((size,), -1.0, device=pl_module.device)
    return _distributed.max_across_ranks(trainer, local.to(pl_module.device))


def _traced(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, probe: OpProbe) -> torch.Tensor | None:
    patches = AttributePatches()
    with preserved_attributes(pl_module):
        try:
            with preserved_state(pl_module), _host_rngs_kept(), swapped(pl_module, float32=False), torch.no_grad():
                patches.set(pl_module, "log", _no_log)
                patches.set(pl_module, "log_dict", _no_log)
                # Eager, on a compiled module too: a dispatch mode sees every op of an eager forward (a compiled
                # graph's kernels are not aten ops), and no graph is compiled for the trial's no-grad forward.
                with torch.compiler.set_stance("force_eager"), trainer.precision_plugin.train_step_context():
                    probe.arm()
                    try:
                        pl_module.training_step(batch, 0)
                    finally:
                        probe.disarm()
        except Exception as exc:  # a trial must never take training down with it
            probe.reduce()
            _notices.note(f"nanguard: the first half-precision step could not be tried ({type(exc).__name__}: {exc}).")
            return None
        finally:
            patches.restore()
    return probe.reduce()


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _host_rngs_kept() -> Iterator[None]:
    """Python's and NumPy's global RNG states put back after the block."""
    state = random.getstate()
    np_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        random.setstate(state)
        if np is not None and np_state is not None:
            np.random.set_state(np_state)

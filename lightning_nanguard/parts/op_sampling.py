"""PrecisionHeadroom's view inside the forward: the op probe on sampled steps and the first step's trial.

``HeadroomWatch`` drives it: ``arm`` at a sampled step's batch start (not on a compiled module, whose kernels are no
aten ops), ``collect`` at its ``on_before_backward``, ``take`` at its batch end (the op entries join the sampled
vector: one all-reduce, one host mirror, a fixed size on every rank), ``add`` at its read; ``trial`` once, at the
first ``16-mixed`` step's batch start, before its forward (``recovery.first_step_trial``: one host read, once per
fit). Each module's entry goes into the headroom book as ``"<module> (ops)"`` (``signals.op_headroom``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_nanguard.engine.reading import HostMirror
from lightning_nanguard.policies.headroom import HeadroomBook
from lightning_nanguard.recovery.first_step_trial import trial_forward
from lightning_nanguard.signals.headroom import watched_modules
from lightning_nanguard.signals.op_headroom import OPS, OpProbe

__all__ = ["OpSampling"]


class OpSampling:
    """The op probe of one fit, its pending sample, and the op each module was last judged by."""

    def __init__(self) -> None:
        self.probe: OpProbe | None = None  # None outside half precision
        self.on_samples = False  # False on a compiled module: its samples see the module outputs only
        self.trial_due = False
        self.worst_ops: dict[str, str] = {}  # module -> the op with the least headroom at its last op sample
        self._vec: tuple[torch.Tensor, list[str]] | None = None  # the sampled step's vector and op names

    def start(self, pl_module: pl.LightningModule, *, half: bool, compiled: bool, trial: bool) -> None:
        """A fit starts: a probe over the module's submodules under half precision; ``trial``: the first step is
        tried (``16-mixed``, where a module can be promoted)."""
        self.stop()
        self.probe = OpProbe(watched_modules(pl_module)) if half else None
        self.on_samples = self.probe is not None and not compiled
        self.trial_due = self.probe is not None and trial

    def stop(self) -> None:
        if self.probe is not None:
            self.probe.disarm()
        self._vec = None

    def arm(self) -> None:
        if self.probe is not None and self.on_samples:
            self.probe.arm()

    def collect(self) -> None:
        """``on_before_backward`` of the sampled step (and its batch end, for a step with no backward): the
        forward's ops reduced on the device."""
        probe = self.probe
        if probe is not None and probe.armed:
            probe.disarm()
            reduced = probe.reduce()
            self._vec = None if reduced is None else (reduced, list(probe.last_ops))

    def take(self, device: torch.device) -> tuple[torch.Tensor, list[str]] | None:
        """The sampled step's entries (two per module, -1 where none was measured: the same size on every rank) and
        its op names; ``None`` where samples see no op. Cleared."""
        probe, vec = self.probe, self._vec
        self._vec = None
        if probe is None or not self.on_samples:
            return None
        if vec is None:
            return torch.full((2 * len(probe.names),), -1.0, device=device), []
        return vec[0].to(device), vec[1]

    def trial(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, scale: torch.Tensor | None
    ) -> list[float]:
        """The first step tried (``recovery.first_step_trial``), read on the host: the op entries, then, with the
        GradScaler's ``scale``, the largest parameter gradient at scale 1 and that scale."""
        assert self.probe is not None
        self.trial_due = False
        vec = trial_forward(trainer, pl_module, batch, self.probe, gradient=scale is not None)
        if scale is not None:
            vec = torch.cat([vec, scale.to(device=vec.device, dtype=torch.float32).reshape(1)])
        mirror = HostMirror(vec.numel(), vec.device)
        mirror.fill(vec)
        return mirror.values(vec.numel())

    def add(self, book: HeadroomBook, step: int, values: list[float], op_names: list[str], limit: float) -> None:
        """A reading's op entries (``OpProbe.reduce``: per module its worst op's fraction of the limit, then that
        op's index) into ``book``, as that fraction of the training precision's ``limit``."""
        assert self.probe is not None
        names = self.probe.names
        for i, name in enumerate(names):
            fraction, worst = values[i], int(values[len(names) + i])
            if fraction < 0:
                continue
            book.add(step, name + OPS, fraction * limit, limit)
            if 0 <= worst < len(op_names):
                self.worst_ops[name] = op_names[worst]

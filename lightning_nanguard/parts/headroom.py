"""PrecisionHeadroom's mechanics: sample the modules' output abs-max every few steps, forecast, promote, report.

One sample, over two steps, with no host read of device memory on the step path:

1. batch start of a due step (``tick``): the probe's forward hooks are registered (``signals.headroom.OutputProbe``);
2. ``on_before_backward`` of that step: the hooks are removed and the kept outputs reduced in one fused pass;
3. its batch end: the per-module vector is all-reduced (MAX, one collective, every rank samples the same steps) and
   copied into a ``HostMirror`` (pinned, non-blocking);
4. the next batch start (the one after on an accelerator): the mirror is read (its copy was queued a step or more
   earlier: nothing to wait for), the history updated, the forecast decided (``policies.headroom.decide``) and acted
   on before that step's forward, and the next sample scheduled: ``every_n_steps`` away, sooner while a module is
   close to the limit and falling.

Under ``16-mixed`` the sampled step's largest gradient times its loss scale rides on the same vector, and its read
may lower the scale before the step (``parts.scaled_gradient``).

Between samples a step costs one integer comparison at its batch start. Decisions come from the rank-reduced vector:
every rank promotes the same module, and lowers the scale alike, at the same step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.contract import Action, Notice
from lightning_nanguard.engine.reading import HostMirror
from lightning_nanguard.parts.op_sampling import OpSampling
from lightning_nanguard.parts.scaled_gradient import ENTRIES, ScaledGradient
from lightning_nanguard.policies.headroom import Forecast, HeadroomBook, HeadroomSettings, decide
from lightning_nanguard.precision import FULL_PRECISION, Precision, classify_precision
from lightning_nanguard.recovery.eval_precision import autocast_device
from lightning_nanguard.recovery.promote import demote, is_promoted, promote_submodule
from lightning_nanguard.reporting import keys
from lightning_nanguard.reporting.incidents import Incident
from lightning_nanguard.signals.headroom import GradProbe, OutputProbe, dtype_max, watched_modules
from lightning_nanguard.signals.op_headroom import OPS, module_of

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_nanguard.engine.engine import Engine

__all__ = ["HeadroomWatch"]

SHOWN = 8  # modules logged per logging step: the lowest headroom
LOSS_STEPS = 8  # steps whose mean loss is kept with each sample (the divergence test)


class HeadroomWatch:
    """The sampling clock, the probe, the history and the promotions of one callback."""

    def __init__(self, settings: HeadroomSettings, owner: str) -> None:
        self.settings = settings
        self.owner = owner
        size = max(settings.history, settings.trend_samples, settings.demote_after or 0)
        self.book = HeadroomBook(size=size)
        self.promoted: list[str] = []  # by the forecast, in order
        self.pinned: set[str] = set()  # promoted again after a demotion: stays in float32
        self.demoted: set[str] = set()
        self.promotions = 0
        self.precision: Precision = FULL_PRECISION
        self.probe: OutputProbe | None = None
        self.ops = OpSampling()  # every half-precision op inside the forward: the first step's trial, and samples
        self.grads: GradProbe | None = None  # under 16-true only: no GradScaler covers the gradients there
        self._grad_vec: torch.Tensor | None = None
        self.scaled = ScaledGradient(settings.scale_margin_bits)  # under 16-mixed: the loss-scaled gradient
        self._names: list[str] = []  # the entries of the pending vector
        self._due = 0
        self._armed_at = 0  # the step of the sample being taken
        self._mirror: HostMirror | None = None
        self._reduced: tuple[torch.Tensor, int] | None = None  # (per-module vector, step) awaiting the batch end
        # (step, n, dtypes, whether the loss-scaled gradient's entries end it, the op names when the op entries
        # follow the outputs) in the mirror
        self._pending: tuple[int, int, dict[int, torch.dtype], bool, list[str] | None] | None = None
        self._dtypes: dict[int, torch.dtype] = {}
        self.idle = ""  # why nothing is measured in this fit (an untested strategy), "" when it is

    # ------------------------------------------------------------------ the fit
    @property
    def half_limit(self) -> float:
        return dtype_max(self.precision.dtype)

    @property
    def can_promote(self) -> bool:
        """float16 under autocast only: bfloat16 has float32's range (report only), ``16-true`` has no autocast."""
        return (
            self.precision.mixed
            and self.precision.dtype is torch.float16
            and self.promotions < self.settings.max_promotions
        )

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        """Training starts: the probe over the module's submodules, promotions re-applied, a first sample due now,
        and a resumed history judged against this run's precision before its first step."""
        self.precision = classify_precision(trainer)
        self._due = trainer.global_step
        self._reduced = self._pending = None
        if self.probe is not None:
            self.probe.release()
        compiled = _lightning_compat.is_compiled(pl_module)
        self.probe = None if self.idle else OutputProbe(watched_modules(pl_module), resident=compiled)
        half = self.precision.half and not self.idle
        self.ops.start(pl_module, half=half, compiled=compiled, trial=self.can_promote)
        no_scaler = self.precision.true_half and self.precision.dtype is torch.float16
        self.grads = GradProbe(pl_module) if no_scaler and not self.idle else None
        self.scaled.start(trainer, pl_module, self.precision, bool(self.idle))
        if self.idle:
            self.precision = FULL_PRECISION  # nothing reported either
            return
        if self.precision.mixed:
            device = autocast_device(trainer.precision_plugin)
            for path in self.promoted:
                promote_submodule(pl_module, path, device, mixed=True, precision=str(trainer.precision))
        if self.precision.half:
            self.book.rebase(self.half_limit)
            self._decide(trainer, pl_module, engine)

    def stop(self) -> None:
        if self.probe is not None:
            self.probe.release()
        self.ops.stop()
        self._reduced = None

    # ------------------------------------------------------------------ the step
    def tick(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine, batch: object = None) -> bool:
        """Batch start: read the last sample (if any), then arm the probe when a sample is due. True when armed.

        A sample is read one step after it was taken on a CPU (the copy was synchronous) and two steps after on an
        accelerator: the copy queued at its batch end has completed by then (a whole step ran since, with its own
        synchronizations), so the read waits for nothing, and every rank reads it at the same step."""
        pending = self._pending
        if pending is not None and (
            self._mirror is None or not self._mirror.cuda or trainer.global_step >= pending[0] + 2
        ):
            self._read(trainer, pl_module, engine)
        if self.ops.trial_due:
            self._try_first_step(trainer, pl_module, engine, batch)
        probe = self.probe
        if probe is None or trainer.global_step < self._due:
            return False
        probe.arm()
        self.ops.arm()
        self._armed_at = trainer.global_step
        return True

    def _try_first_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine, batch: object
    ) -> None:
        """The fit's first half-precision step, tried before its forward (``recovery.first_step_trial``): its ops'
        headroom into the book and decided on now, so a module that cannot run in float16 is promoted before the
        step overflows; where the scale can be cut, its gradient at the GradScaler's scale lowers the scale before
        the first backward (never raised). One host read, once per fit."""
        scaler = _lightning_compat.active_scaler(trainer) if self.scaled.can_cut else None
        scale = _lightning_compat.scale_tensor(scaler) if scaler is not None else None
        values = self.ops.trial(trainer, pl_module, batch, scale)
        assert self.ops.probe is not None
        self.ops.add(self.book, trainer.global_step, values, list(self.ops.probe.last_ops), self.half_limit)
        if scale is not None and values[-2] > 0:  # the scale starts where the gradient's headroom says
            self.scaled.read(trainer, engine, values[-2] * values[-1], values[-1], act=True)
        self._decide(trainer, pl_module, engine)

    def collect(self, step: int) -> None:
        """``on_before_backward`` of the sampled step: the forward is done; one fused reduction, no host read."""
        self.ops.collect()
        probe = self.probe
        if probe is None or not probe.armed:
            return
        probe.disarm()
        reduced = probe.reduce()
        self._dtypes = dict(probe.dtypes)
        if reduced is None:
            return
        values, slots = reduced
        full = torch.full((len(probe.names),), -1.0, device=values.device)
        full[torch.tensor(slots, device=values.device)] = values
        self._reduced = (full, step)

    def collect_grads(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        """``on_before_optimizer_step`` of the sampled step: each module's gradients where no GradScaler covers them
        (16-true), the loss-scaled gradient under 16-mixed; on the device, no host read."""
        if self.grads is not None:
            self._grad_vec = self.grads.reduce()
        self.scaled.collect(trainer, optimizer)

    def end_sample(self, trainer: pl.Trainer) -> None:
        """The sampled step's batch end: one MAX all-reduce and a non-blocking copy to the host."""
        if self.probe is not None:
            self.probe.disarm()  # a step with no backward never reached ``collect``
        self.ops.collect()  # (nor the op probe's)
        self._due = trainer.global_step + self.settings.every_n_steps  # until the next read says sooner
        grads, self._grad_vec = self._grad_vec, None
        scaled = self.scaled.take()
        reduced, self._reduced = self._reduced, None
        if self.probe is None:
            return
        if reduced is None:  # no module output seen (none ran in floating point): the gradient's entries alone
            if scaled is None:
                return
            self._dtypes = {}
            reduced = (torch.full((len(self.probe.names),), -1.0, device=scaled.device), self._armed_at)
        vec, step = reduced
        self._names = list(self.probe.names)
        op_names: list[str] | None = None
        ops = self.ops.take(vec.device)  # every rank's vector has the op entries, measured or not
        if ops is not None:
            vec, op_names = torch.cat([vec, ops[0]]), ops[1]  # the op entries follow the outputs
        if grads is not None and self.grads is not None and grads.device == vec.device:
            vec = torch.cat([vec, grads])  # one vector, one all-reduce
            self._names += self.grads.names
        tail = False  # the loss-scaled gradient's entries end the vector
        if scaled is not None and scaled.device == vec.device:
            vec, tail = torch.cat([vec, scaled]), True
        vec = _distributed.max_across_ranks(trainer, vec)
        if self._mirror is None or self._mirror.size < vec.numel():
            self._mirror = HostMirror(vec.numel(), vec.device)
        self._mirror.fill(vec)
        self._pending = (step, vec.numel(), self._dtypes, tail, op_names)

    def finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        """Training ends: the last sample's values into the history (for the summary and a resume), no decision."""
        if self._pending is not None:
            self._read(trainer, pl_module, engine, act=False)

    def _read(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine, *, act: bool = True) -> None:
        assert self._pending is not None
        assert self._mirror is not None
        assert self.probe is not None
        step, n, dtypes, tail, op_names = self._pending
        self._pending = None
        values = self._mirror.values(n)  # a copy queued a step ago: host memory, no device read
        if tail:
            values, (amax, ran_with) = values[:-ENTRIES], values[-ENTRIES:]
            self.scaled.read(trainer, engine, amax, ran_with, act=act)
        if op_names is not None:
            outputs = len(self.probe.names)
            self.ops.add(self.book, step, values[outputs : 3 * outputs], op_names, self.half_limit)
            values = values[:outputs] + values[3 * outputs :]
        names = self._names
        for i, amax in enumerate(values):
            if amax < 0:
                continue  # the module did not run (on any rank)
            dtype = dtypes.get(i, self.precision.dtype)
            limit = min(dtype_max(dtype), self.half_limit) if self.precision.half else dtype_max(dtype)
            self.book.add(step, names[i], amax, limit)
        self.book.add_loss(step, _recent_loss(engine))
        if self.precision.half and act:
            self._decide(trainer, pl_module, engine)

    # ------------------------------------------------------------------ decisions
    def _decide(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        decision = decide(
            self.book,
            self.settings,
            can_promote=self.can_promote,
            promoted=set(self.promoted),
            pinned=self.pinned,
            half_limit=self.half_limit,
        )
        self._due = min(self._due, trainer.global_step + decision.next_in)
        for name, fc, why in decision.promote:
            self._promote(trainer, pl_module, engine, name, why, fc)
        for name in decision.demote:
            self._demote(trainer, pl_module, engine, name)

    def _promote(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine, name: str, why: str, fc: Forecast
    ) -> None:
        device = autocast_device(trainer.precision_plugin)
        done, message = promote_submodule(pl_module, name, device, mixed=True, precision=str(trainer.precision))
        if not done and not is_promoted(pl_module.get_submodule(name)):
            return
        self.promotions += 1
        if name in self.demoted:
            self.pinned.add(name)  # it relapsed after a demotion: it stays in float32 now
        if name not in self.promoted:
            self.promoted.append(name)
        ops = self.book.bits(name + OPS)
        by_op = bool(ops) and ops[-1][1] == fc.bits  # the forecast that fired is the op entry's
        op = self.ops.worst_ops.get(name, "") if by_op else ""
        history = [[s, round(b, 3)] for s, b in (ops if by_op else self.book.bits(name))]
        where = f" in {op}" if op else ""
        text = (
            f"{name} is about to overflow float16{where}: {why}. Before it does, {message}. Headroom history (step, "
            f"bits): {history[-6:]}"
        )
        values = {
            "module": name,
            "op": op,
            "bits": fc.bits,
            "slope_bits_per_step": fc.slope,
            "steps_to_overflow": fc.steps_to_zero,
            "history": history,
            "margin_bits": self.settings.margin_bits,
            "horizon_steps": self.settings.horizon_steps,
        }
        incident = self._incident(trainer, Notice.HEADROOM_FORECAST, Action.PROMOTE, name, text, values)
        engine.incidents.report(trainer, incident)

    def _demote(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine, name: str) -> None:
        promoter = engine.registry.promoter
        if promoter is not None and name in promoter.promoted:
            return  # an overflow promoted it too (FP32Evaluation(promote_after=...)): it stays in float32
        if not demote(pl_module.get_submodule(name)):
            return
        self.book.forget(name)
        self.promoted.remove(name)
        self.demoted.add(name)
        bits = self.book.bits(name, self.half_limit)
        text = (
            f"{name} runs in {self.precision.dtype_name} again: its output kept {bits[-1][1]:.2f} bits of headroom "
            f"or more over its last {self.settings.demote_after} samples in float32. If it comes close to the limit "
            "again it is promoted again, for good."
        )
        values: dict[str, object] = {"module": name, "history": [[s, round(b, 3)] for s, b in bits]}
        incident = self._incident(trainer, Notice.HEADROOM_RECOVERED, Action.DEMOTE, name, text, values)
        engine.incidents.report(trainer, incident)

    def _incident(
        self, trainer: pl.Trainer, trigger: Notice, action: Action, where: str, message: str, values: dict[str, object]
    ) -> Incident:
        return Incident(
            step=int(trainer.global_step),
            epoch=int(trainer.current_epoch),
            batch_idx=-1,
            ranks=list(range(trainer.world_size)),
            trigger=trigger,
            action=action,
            source=self.owner,
            values=values,
            message=message,
            actions=[action],
            where=where,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, object]:
        return {
            "book": self.book.state_dict(),
            "promoted": list(self.promoted),
            "pinned": sorted(self.pinned),
            "demoted": sorted(self.demoted),
            "promotions": self.promotions,
            "scale_lowerings": self.scaled.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.book.load_state_dict(dict(state.get("book", {})))
        self.promoted = [str(p) for p in state.get("promoted", [])]
        self.pinned = {str(p) for p in state.get("pinned", [])}
        self.demoted = {str(p) for p in state.get("demoted", [])}
        self.promotions = int(state.get("promotions", len(self.promoted)))
        self.scaled.load_state_dict(dict(state.get("scale_lowerings", {})))

    # ------------------------------------------------------------------ reports
    def lowest(self, count: int) -> list[tuple[str, float]]:
        """The ``count`` modules running in the training precision with the least headroom at their last sample,
        lowest first (a module the forecast promoted, and its submodules, run in float32: not listed)."""
        worst: dict[str, float] = {}
        newest = max((e[-1][0] for e in self.book.modules.values() if e), default=0)
        for entry, bits in self.book.latest().items():  # a module's output and its ops: the lower
            name = module_of(entry)
            if name != entry and self.book.modules[entry][-1][0] < newest:
                continue  # ops no longer sampled (a compiled module's, after its first step's trial)
            worst[name] = min(bits, worst.get(name, math.inf))
        promoted = set(self.promoted)
        shown = [(n, b) for n, b in worst.items() if not any(n == p or n.startswith(p + ".") for p in promoted)]
        return sorted(shown, key=lambda kv: kv[1])[:count]

    def metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        out = self.scaled.metrics()
        if not self.precision.half or not self.book.modules:
            return out
        shown = self.lowest(SHOWN)
        out[keys.PROMOTED_MODULES] = float(len(self.promoted))
        if shown:
            out[keys.HEADROOM_MIN] = shown[0][1]
        for name, bits in shown:
            out[keys.key("headroom", name)] = bits
        return out

    def summary_lines(self) -> list[str]:
        if not self.precision.half or not self.book.modules:
            return self.scaled.summary_lines()
        lowest = self.lowest(1)
        line = "closest to overflow: " + (
            f"{lowest[0][0]}, {lowest[0][1]:.1f} bits ({self.precision.dtype_name} headroom at the last sample)"
            if lowest
            else "no module left in half precision"
        )
        if self.promoted:
            line += f"; run in float32 by the headroom forecast: {', '.join(self.promoted)}"
        return [line, *self.scaled.summary_lines()]


def _recent_loss(engine: Engine, steps: int = LOSS_STEPS) -> float | None:
    """The mean finite loss of the engine's last ``steps`` readings (one batch's loss is too noisy to compare)."""
    history = engine.history
    losses = [loss for _, _, loss in list(history)[-steps:] if loss is not None and math.isfinite(loss)]
    return sum(losses) / len(losses) if losses else None

"""The probe batch: a few training samples kept on the device, scored with the current weights, leaving no trace.

Whether a spike is the weights going wrong or just an unusual batch is measured, not guessed: the probe (the first
``rows`` samples of an early training batch, never quarantined ones) is scored when each snapshot is taken and again
at a spike (``policies.probe`` judges the scores). A scoring is one forward of the LightningModule's own
``training_step`` under ``no_grad``, in the training precision (the precision plugin's ``train_step_context``), and
it is deterministic and side-effect free:

* the torch, Python ``random`` and NumPy RNGs are seeded with ``PROBE_SEED`` for the call (noise and timesteps a
  diffusion ``training_step`` samples are the same at every scoring) and the training streams (torch's CPU one and
  every CUDA device's once CUDA is initialised, Python's, NumPy's global one) are put back afterwards, as are the
  modules' train/eval modes and the autocast and grad modes;
* every buffer runs on a copy (BatchNorm statistics and counters are never written), the originals put back;
* ``self.log``/``self.log_dict`` are no-ops for the call (the probe's loss is not a training metric);
* the call runs on a private deep copy of the kept rows: a ``training_step`` that edits its batch in place
  (``batch["image"] = batch["image"].float() / 255``) never touches them;
* everything else the module can reach is put back as it was (``recovery.probe_trace.untouched``: one walk, not a
  list of types): parameters of every submodule (an ``AveragedModel``'s included), tensors in attributes and inside
  dicts, lists and tuples of attributes (an EMA in plain tensors), plain Python values (a list of step losses, a
  counter, an attribute added), torchmetrics states, random generators the module owns. Where the call changed
  something that cannot be put back, the fit is not probed from then on, and a notice names it, once.

Under DDP each rank scores its own probe rows on the bare LightningModule (no DDP wrapper: no gradient reduction can
start) and the ranks' losses are averaged in one all-reduce, so every rank reads the same value. Under FSDP2
(``ModelParallelStrategy``, ``fully_shard``) the LightningModule is the sharded module, and its forward all-gathers
the parameters: every rank scores or none does (the ranks agree first, ``SnapshotProbe``), and afterwards every
``fully_shard`` module is resharded (FSDP2 keeps the root's parameters all-gathered for a backward that a scoring
never runs; a restore or a snapshot would otherwise see the full tensors in place of the shards). Manual optimization
is not probed: its ``training_step`` calls the optimizers itself, and a scoring must never step them (a notice says
so once).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_nanguard import _distributed, _lightning_compat, _notices
from lightning_nanguard._lightning_compat import AttributePatches
from lightning_nanguard.forensics.isolation import preserved_state, swapped
from lightning_nanguard.policies.probe import ProbeBook, ProbeVerdict
from lightning_nanguard.recovery.probe_trace import host_rngs_kept, untouched
from lightning_nanguard.recovery.quarantine import Quarantine
from lightning_nanguard.signals import fsdp1
from lightning_nanguard.signals.loss_climb import LossTrend

__all__ = ["PROBE_ROWS", "PROBE_SEED", "ProbeBatch", "SnapshotProbe", "WeightsOf"]

PROBE_ROWS = 8  # samples in the probe: enough to average out one sample's quirks, a fraction of a batch's forward
PROBE_SEED = 20_261_128  # the RNG state of every scoring

# A snapshot's step -> a block in which the module carries that snapshot's weights (yields False: it cannot).
WeightsOf = Callable[[int], AbstractContextManager[bool]]


class ProbeBatch:
    """A few training samples, on the device, and their loss under the current weights.

    Args:
        rows: the samples taken from the batch the probe is captured from (all of them when it has fewer).
    """

    def __init__(self, rows: int = PROBE_ROWS) -> None:
        self.rows = rows
        self.batch: object = None
        self.samples: frozenset[int] = frozenset()  # the dataset indices of the probe's rows, where known
        self.disabled = ""  # why this fit is not probed ("" while it is)

    @property
    def ready(self) -> bool:
        return self.batch is not None and not self.disabled

    def clear(self) -> None:
        self.batch, self.samples = None, frozenset()

    def reset(self) -> None:
        """A new fit: nothing captured, nothing disabled."""
        self.clear()
        self.disabled = ""

    def disable(self, why: str) -> None:
        """This fit is not probed, because of ``why`` (said once)."""
        self.disabled = why
        _notices.note(f"nanguard: spikes are not probed under {why}; they are only counted.")

    def capture(self, batch: object, pl_module: pl.LightningModule, quarantine: Quarantine | None) -> bool:
        """Keep the first ``rows`` samples of ``batch`` (detached copies, on the batch's device). False when nothing
        could be taken (no tensor with a batch dimension) or this fit is not probed."""
        if self.disabled:
            return False
        if not pl_module.automatic_optimization:
            self.disable("manual optimization (its training_step steps the optimizers)")
            return False
        size = _batch_size(batch)
        if size is None:
            return False
        take = min(self.rows, size)

        def cut(t: Tensor) -> Tensor:
            return t[:take].detach().clone() if t.dim() and t.shape[0] == size else t.detach().clone()

        self.batch = apply_to_collection(batch, Tensor, cut)
        self.samples = _samples(batch, take, quarantine)
        return True

    def holds_any(self, samples: set[int]) -> bool:
        """Some of the probe's samples are among ``samples`` (the quarantine's)."""
        return not self.samples.isdisjoint(samples)

    def score(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float | None:
        """The probe's loss under the current weights, averaged over the ranks (every rank calls it: one
        all-reduce under DDP). ``None`` when ``training_step`` raised or returned no loss on any rank: nothing was
        measured. (A NaN loss is a measurement: the weights make the probe non-finite.)"""
        value = self._local(trainer, pl_module)
        if trainer.world_size > 1:
            zero = torch.zeros((), device=pl_module.device)
            vec = torch.stack([zero if value is None else value, zero + (value is None)])
            total, unscored = _distributed.sum_across_ranks(trainer, vec).tolist()
            return None if unscored else total / trainer.world_size
        return None if value is None else float(value)

    def _local(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Tensor | None:
        device = pl_module.device
        patches = AttributePatches()
        failed = False
        rows = _private_copy(self.batch)  # training_step may edit its batch in place: the kept rows never see it
        # Outermost: what the call (and the patches) left in the module's reachable state is put back last.
        with untouched(pl_module) as trace:
            try:
                with (
                    preserved_state(pl_module),
                    host_rngs_kept(PROBE_SEED),
                    swapped(pl_module, float32=False),
                    torch.no_grad(),
                ):
                    patches.set(pl_module, "log", _no_log)
                    patches.set(pl_module, "log_dict", _no_log)
                    torch.manual_seed(PROBE_SEED)  # preserved_state puts the training streams back
                    with trainer.precision_plugin.train_step_context():
                        loss = _loss_of(pl_module.training_step(rows, 0))
            except Exception as exc:  # a scoring must never take training down with it
                failed = True
                _notices.note(f"nanguard: the probe batch could not be scored ({type(exc).__name__}: {exc}).")
                loss = None
            finally:
                patches.restore()
                # FSDP2 leaves the root's parameters all-gathered after a forward with no backward: sharded again,
                # or a restore or the next snapshot would see the full tensors in place of the shards.
                _lightning_compat.reshard_fsdp2(pl_module, failed=failed)
        if trace.beyond_repair:
            self.disable_traced(trace.beyond_repair)
            return None
        if loss is None or loss.numel() != 1:
            return None
        return loss.detach().float().reshape(()).to(device)

    def disable_traced(self, where: list[str]) -> None:
        """A scoring changed what cannot be put back (``where``): this fit is not probed from now on (said once)."""
        shown = ", ".join(where[:5]) + (f" and {len(where) - 5} more" if len(where) > 5 else "")
        self.disabled = f"a training_step whose call changes what nanguard cannot put back ({shown})"
        _notices.note(
            f"nanguard: the probe batch is not scored in this fit: calling training_step changed {shown}, which "
            "cannot be put back, and a probe must leave no trace. Spikes are only counted; to have them probed, keep "
            "that state in tensors, containers or plain attributes of the module."
        )


def _no_log(*args: object, **kwargs: object) -> None:
    return None


def _private_copy(batch: object) -> Any:
    """A deep copy of the kept rows (their tensors and the containers holding them) for one scoring."""
    try:
        return copy.deepcopy(batch)
    except Exception:  # an object in the batch that cannot be copied: the tensors and standard containers are
        return apply_to_collection(batch, Tensor, lambda t: t.clone())


def _loss_of(out: object) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("loss"), Tensor):
        loss: Tensor = out["loss"]
        return loss
    return None


def _batch_size(batch: object) -> int | None:
    """The leading dimension of the batch's first tensor (``None``: no tensor with one)."""
    found: list[int] = []

    def first(t: Tensor) -> Tensor:
        if t.dim() and not found:
            found.append(int(t.shape[0]))
        return t

    apply_to_collection(batch, Tensor, first)
    return found[0] if found and found[0] > 0 else None


def _samples(batch: object, take: int, quarantine: Quarantine | None) -> frozenset[int]:
    """The dataset indices of the batch's first ``take`` rows, where the quarantine knows them."""
    if quarantine is None or not quarantine.current:
        return frozenset()
    try:
        return frozenset(quarantine.samples_of(batch, list(range(take))))
    except Exception:  # the rows cannot be mapped: the probe is then never matched against the quarantine
        return frozenset()


class SnapshotProbe:
    """AutoRollback's probe: the batch, scored at each snapshot and at each spike (``policies.probe`` judges).

    Active only where spikes are probed (``GradNormMonitor(on_spike="probe")``); otherwise it costs nothing. The
    probe is taken from the batch of the first snapshot whose data is not quarantined; if the quarantine later takes
    one of its samples, it is dropped with its scores and taken again at the next snapshot.
    """

    def __init__(self) -> None:
        self.batch = ProbeBatch()
        self.book = ProbeBook()
        self.active = False
        self.verdict: ProbeVerdict | None = None  # the last spike's
        self.scorings = 0  # forwards of the probe in this fit (snapshots and spikes)

    def start(self, trainer: pl.Trainer, active: bool) -> None:
        """A new fit: nothing captured or scored; ``active``: spikes are probed in it."""
        self.batch.reset()
        self.book.reset()
        self.active, self.verdict, self.scorings = active, None, 0
        if active and fsdp1.is_fsdp1(trainer.strategy):
            self.batch.disable(
                "FSDPStrategy (FSDP1 gathers a module's parameters in its wrapper's forward, which a call of "
                "training_step on the module itself bypasses)"
            )

    def _agreed(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        quarantine: Quarantine | None,
        batch: object = None,
        *,
        capture: bool,
    ) -> bool:
        """Every rank's probe is ready to be scored (the same answer on every rank, so that each calls the scoring's
        all-reduce or none does). A probe that holds a quarantined sample is dropped, and where it is dropped on any
        rank every rank drops its scores, so the ranks' books stay the same; where ``capture``, a rank without a
        probe takes one from ``batch`` (``None`` when its data is quarantined). One all-reduce of two flags under
        DDP, at a snapshot or a spike only."""
        holds = self.batch.ready and quarantine is not None and self.batch.holds_any(quarantine.samples)
        if holds:
            self.batch.clear()
        if capture and not self.batch.ready and batch is not None:
            self.batch.capture(batch, pl_module, quarantine)
        dropped, unready = _distributed.any_rank_each(trainer, [holds, not self.batch.ready])
        if dropped:
            self.book.reset()
        return not unready

    def snapshot_taken(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        batch: object,
        quarantine: Quarantine | None,
    ) -> None:
        """Score the probe with the weights of the snapshot of ``step`` just taken (capturing it from ``batch``
        first, where there is none yet; ``batch`` is ``None`` when its data is quarantined)."""
        if not (self.active and self._agreed(trainer, pl_module, quarantine, batch, capture=True)):
            return
        self.scorings += 1
        score = self.batch.score(trainer, pl_module)
        if score is not None:
            self.book.record(step, score)

    def spike(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        kept: Collection[int],
        quarantine: Quarantine | None,
        batch_loss: float | None = None,
        weights: WeightsOf | None = None,
        trend: LossTrend | None = None,
    ) -> ProbeVerdict | None:
        """At a spike of ``step`` (whose batch lost ``batch_loss``): the probe re-scored with the current weights,
        judged against the newest sound snapshot among ``kept``, whose weights are scored again now where
        ``weights`` (a snapshot's step -> a block with its weights in the module) can load them: the same rows, the
        same objective, the same moment. ``None`` when there is no probe."""
        if not (self.active and self._agreed(trainer, pl_module, quarantine, capture=False)):
            return None
        self.scorings += 1
        score = self.batch.score(trainer, pl_module)
        # Not scored (it raised, or returned no loss): nothing was measured, so no verdict; the spike is only counted.
        if score is None:
            self.verdict = None
            return None
        reference, then = self.book.reference(kept), None
        if reference is not None and weights is not None and self.batch.ready:
            with weights(reference) as loaded:  # the same answer on every rank: the ring's steps are the same
                if loaded:
                    self.scorings += 1
                    then = self.batch.score(trainer, pl_module)
        self.verdict = self.book.judge(step, score, kept, batch_loss, then, trend)
        return self.verdict

    def restored(self, step: int) -> None:
        self.book.restored(step)

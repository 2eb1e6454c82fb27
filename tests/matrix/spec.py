"""The fault matrix of issue 12 (part F), with the model kinds of issue 25: its dimensions, what is pruned and why,
and the case lists.

A case is one ``Trainer.fit`` of a tiny model with a BatchNorm layer, of one kind (``tests/matrix/kinds.py``: the
plain model, or one with an ``IterableDataset``, sparse tensors, a lazy layer, a growing cache buffer, a ``-inf``
mask buffer, or a weight-averaging callback after the suite), with one fault (one-off or recurring) at one site,
under one precision, process layout, optimization mode and callback set. ``all_cases()`` is the pruned product,
``full_cases()`` the part of it the full run executes (see ``FULL_PLAN``), ``subset_cases()`` the representative
subset CI runs.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_nanguard import preset
from tests.matrix.kinds import KINDS

__all__ = [
    "CALLBACKS",
    "DIMENSIONS",
    "FULL_PLAN",
    "PRUNED",
    "Case",
    "all_cases",
    "full_cases",
    "full_plan",
    "kinds_cases",
    "pruned_reason",
    "subset_cases",
]

VALUES = ("nan", "inf", "spike")
RECURRENCES = ("once", "recurring")
SITES = ("loss", "grad", "param", "buffer", "input")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "16-true")
PROCESSES = ("single", "ddp-rank0", "ddp-rank1", "ddp-both")
OPTIMIZATIONS = ("automatic", "manual-2opt", "accumulation")
CALLBACK_NAMES = tuple(cls.__name__ for cls in preset.CALLBACKS)
CALLBACKS = ("suite", *CALLBACK_NAMES)

DIMENSIONS: dict[str, tuple[str, ...]] = {
    "value": VALUES,
    "recurrence": RECURRENCES,
    "site": SITES,
    "precision": PRECISIONS,
    "process": PROCESSES,
    "optimization": OPTIMIZATIONS,
    "callbacks": CALLBACKS,
    "model": KINDS,
}

SPIKE = 1e4  # the finite multiplier of a "spike" fault
STEPS = 12  # optimizer steps per run
FIRST_FAULT = 3  # the one-off fault's step; a recurring fault hits every step from here to the end

# (what, why): combinations left out of the product. Each is checked by ``pruned_reason``.
PRUNED: list[tuple[str, str]] = [
    (
        "value=spike x site=buffer",
        "a finite multiplier on a BatchNorm running mean is finite state: no detector watches the size of running "
        "statistics and nothing is promised about it, so the only invariant (finite or a documented error) holds by "
        "construction; running it would only add rows that cannot fail.",
    ),
    (
        "site=buffer x process=ddp-rank1",
        "DDP's `broadcast_buffers=True` (Lightning's default) copies rank 0's buffers over every other rank's at the "
        "start of each forward, so a value written into rank 1's running mean at the batch start is gone before any "
        "code runs on it: nothing exists to detect (a preview run: finite, no incident, every time). `ddp-both` "
        "stays (rank 0's bad buffer is broadcast to rank 1).",
    ),
    (
        "model=lazy x DDP",
        "torch's DistributedDataParallel refuses a module with uninitialized parameters (plain Lightning fails the "
        "same way at setup): a lazy model is materialized before DDP wraps it, which makes it the plain model.",
    ),
    (
        "model=swa x manual-2opt",
        "Lightning's StochasticWeightAveraging refuses more than one optimizer (`MisconfigurationException` at fit "
        "start, with or without nanguard).",
    ),
    (
        "manual-2opt x gradient accumulation",
        "not a product to prune but a note: Lightning refuses `accumulate_grad_batches` under manual optimization "
        "(the user accumulates by hand), so the optimization dimension has three values, not a 2 x 2 product.",
    ),
]


@dataclass(frozen=True, order=True)
class Case:
    """One run of the matrix. ``str(case)`` is its stable id (also the pytest id)."""

    value: str = "nan"
    recurrence: str = "once"
    site: str = "loss"
    precision: str = "32-true"
    process: str = "single"
    optimization: str = "automatic"
    callbacks: str = "suite"
    model: str = "mlp"

    def __post_init__(self) -> None:
        for f in fields(self):
            allowed = DIMENSIONS[f.name]
            if getattr(self, f.name) not in allowed:
                raise ValueError(f"Case.{f.name}={getattr(self, f.name)!r}: one of {allowed}.")

    def __str__(self) -> str:
        return "-".join(str(getattr(self, f.name)) for f in fields(self))

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @property
    def ddp(self) -> bool:
        return self.process != "single"

    @property
    def nonfinite(self) -> bool:
        return self.value != "spike"

    @property
    def fault_ranks(self) -> list[int] | None:
        """Global ranks the fault hits (``None``: every rank, i.e. the only one)."""
        return {"single": None, "ddp-rank0": [0], "ddp-rank1": [1], "ddp-both": [0, 1]}[self.process]

    @property
    def fault_steps(self) -> list[int]:
        """Optimizer steps (0-based) at which the fault is injected."""
        return [FIRST_FAULT] if self.recurrence == "once" else list(range(FIRST_FAULT, STEPS))

    @property
    def injector_value(self) -> float | str:
        return SPIKE if self.value == "spike" else self.value

    @property
    def counts_incidents(self) -> bool:
        """Whether "incidents == faults" is an invariant of this case (else the column is informational).

        Non-finite faults with the whole suite: every one is an event the suite must see and record once. A spike
        is not an incident unless spike detection is configured (the preset leaves it off); a lone callback that
        does not watch training steps records nothing by design.
        """
        return self.nonfinite and self.callbacks == "suite"


def pruned_reason(case: Case) -> str | None:
    """Why ``case`` is left out of the matrix, or ``None`` when it is run."""
    if case.value == "spike" and case.site == "buffer":
        return PRUNED[0][1]
    if case.site == "buffer" and case.process == "ddp-rank1":
        return PRUNED[1][1]
    if case.model == "lazy" and case.ddp:
        return PRUNED[2][1]
    if case.model == "swa" and case.optimization == "manual-2opt":
        return PRUNED[3][1]
    return None


def _product(**dims: Iterable[str]) -> Iterator[Case]:
    names = list(DIMENSIONS)
    axes = [tuple(dims.get(n, DIMENSIONS[n])) for n in names]
    for combo in itertools.product(*axes):
        case = Case(**dict(zip(names, combo, strict=True)))
        if pruned_reason(case) is None:
            yield case


def all_cases() -> list[Case]:
    """The whole pruned product."""
    return list(_product())


# The full run: what it executes out of ``all_cases()``. Every single-process case of the plain model (~0.2 s each,
# two at a time); DDP cases cost ~8 s each (two spawned ranks import torch), so the 6,720 DDP combinations of the plain
# model would take ~8 hours on the shared 2-core CPU: the full run takes a slice of them (the suite on every site and
# rank layout) and a sample. The model kinds: every fault under every precision with the suite, each callback alone,
# manual optimization and accumulation, and DDP (a stratified slice of their product: each kind's whole product is as
# large as the plain model's).
_MLP = {"model": ("mlp",)}
_KINDS = {"model": KINDS[1:]}
FULL_PLAN: list[tuple[str, dict[str, tuple[str, ...]], int | None]] = [
    # (label, the dimensions' restriction, sample size or None for all of them); run in this order
    (
        "plain model, single process: every combination (the whole pruned product)",
        {**_MLP, "process": ("single",)},
        None,
    ),
    (
        "model kinds, single process, whole suite, automatic: every fault (value x recurrence x site) under every "
        "precision",
        {**_KINDS, "process": ("single",), "callbacks": ("suite",), "optimization": ("automatic",)},
        None,
    ),
    (
        "model kinds, single process, each callback alone, automatic: one-off NaN at every site, 32-true and 16-mixed",
        {
            **_KINDS,
            "process": ("single",),
            "callbacks": CALLBACK_NAMES,
            "value": ("nan",),
            "recurrence": ("once",),
            "optimization": ("automatic",),
            "precision": ("32-true", "16-mixed"),
        },
        None,
    ),
    (
        "model kinds, single process, whole suite, manual with two optimizers and gradient accumulation: one-off NaN "
        "and inf at every site, 32-true and 16-mixed",
        {
            **_KINDS,
            "process": ("single",),
            "callbacks": ("suite",),
            "value": ("nan", "inf"),
            "recurrence": ("once",),
            "optimization": ("manual-2opt", "accumulation"),
            "precision": ("32-true", "16-mixed"),
        },
        None,
    ),
    (
        "plain model, DDP, whole suite, automatic, one-off NaN and inf at every site on rank 0 / rank 1 / both, "
        "32-true and 16-mixed",
        {
            **_MLP,
            "process": PROCESSES[1:],
            "callbacks": ("suite",),
            "value": ("nan", "inf"),
            "recurrence": ("once",),
            "optimization": ("automatic",),
            "precision": ("32-true", "16-mixed"),
        },
        None,
    ),
    (
        "plain model, DDP, whole suite, automatic, recurring NaN at every site on rank 0 / rank 1 / both, 32-true",
        {
            **_MLP,
            "process": PROCESSES[1:],
            "callbacks": ("suite",),
            "value": ("nan",),
            "recurrence": ("recurring",),
            "optimization": ("automatic",),
            "precision": ("32-true",),
        },
        None,
    ),
    (
        "plain model, DDP, whole suite, manual with two optimizers and gradient accumulation, one-off NaN at every "
        "site on rank 0 / rank 1 / both, 32-true",
        {
            **_MLP,
            "process": PROCESSES[1:],
            "callbacks": ("suite",),
            "value": ("nan",),
            "recurrence": ("once",),
            "optimization": ("manual-2opt", "accumulation"),
            "precision": ("32-true",),
        },
        None,
    ),
    (
        "model kinds (but lazy: DDP refuses it), DDP, whole suite, automatic: one-off NaN at every site on rank 1 and "
        "on both ranks, 32-true",
        {
            **_KINDS,
            "process": ("ddp-rank1", "ddp-both"),
            "callbacks": ("suite",),
            "value": ("nan",),
            "recurrence": ("once",),
            "optimization": ("automatic",),
            "precision": ("32-true",),
        },
        None,
    ),
    ("plain model, DDP: a seeded sample of every other DDP combination", {**_MLP, "process": PROCESSES[1:]}, 80),
    (
        "plain model, DDP: a second seeded sample of the rest (the time left of the budget)",
        {**_MLP, "process": PROCESSES[1:]},
        150,
    ),
]


def full_plan(seed: int = 12) -> list[tuple[str, list[Case]]]:
    """Each ``FULL_PLAN`` entry with the cases it adds (none twice; sampling is seeded: the same lists every time,
    and an entry appended to the plan leaves the earlier entries' cases as they were)."""
    rng = random.Random(seed)
    chosen: dict[Case, None] = {}
    out: list[tuple[str, list[Case]]] = []
    for label, dims, sample in FULL_PLAN:
        pool = [c for c in _product(**dims) if c not in chosen]
        if sample is not None and sample < len(pool):
            pool = rng.sample(pool, sample)
        chosen.update(dict.fromkeys(pool))
        out.append((label, pool))
    return out


def full_cases(seed: int = 12) -> list[Case]:
    """The cases of the full run, in ``FULL_PLAN`` order."""
    return [case for _label, cases in full_plan(seed) for case in cases]


def kinds_cases(seed: int = 12) -> list[Case]:
    """The cases of the full run's model-kind entries (``FULL_PLAN`` labels starting "model kinds"), in order."""
    return [case for label, cases in full_plan(seed) if label.startswith("model kinds") for case in cases]


def subset_cases() -> list[Case]:
    """The representative subset (CI): each value, site, precision, process layout, optimization mode, callback and
    model kind appears at least once, with the suite on the known-hard combinations (fp16 scaler, BatchNorm, manual,
    DDP)."""
    c = Case
    return [
        # every site, non-finite one-off, whole suite, fp32
        c("nan", "once", "loss"),
        c("nan", "once", "grad"),
        c("nan", "once", "param"),
        c("nan", "once", "buffer"),
        c("nan", "once", "input"),
        c("inf", "once", "grad"),
        # spikes (finite)
        c("spike", "once", "loss"),
        c("spike", "once", "param"),
        # recurring: the budget path must end in a documented error or finish finite, never skip silently
        c("nan", "recurring", "loss"),
        c("nan", "recurring", "param"),
        c("nan", "recurring", "buffer"),
        # precisions
        c("nan", "once", "grad", "bf16-mixed"),
        c("inf", "once", "loss", "16-mixed"),
        c("nan", "once", "input", "16-mixed"),
        c("nan", "once", "grad", "16-true"),
        # optimization modes
        c("nan", "once", "grad", optimization="manual-2opt"),
        c("nan", "once", "loss", "16-mixed", optimization="manual-2opt"),
        c("nan", "once", "grad", optimization="accumulation"),
        c("nan", "once", "buffer", optimization="accumulation"),
        # each callback alone
        *(c("nan", "once", "grad", callbacks=name) for name in CALLBACK_NAMES),
        c("nan", "once", "param", callbacks="AutoRollback"),
        c("nan", "once", "loss", "16-mixed", callbacks="LossScaleWatchdog"),
        # DDP (2 ranks): the fault on one rank, on the other, on both
        c("nan", "once", "grad", process="ddp-rank1"),
        c("inf", "once", "loss", "16-mixed", process="ddp-rank0"),
        c("nan", "once", "param", process="ddp-rank1"),
        c("spike", "once", "param", process="ddp-rank0"),
        c("nan", "once", "input", "bf16-mixed", process="ddp-both"),
        # 16-mixed DDP with a member that senses no step: the GradScalers' skips are still agreed across ranks
        c("nan", "once", "grad", "16-mixed", process="ddp-rank1", callbacks="OptimizerBackoff"),
        # the model kinds (single process): a bad batch of an IterableDataset, a rollback with a sparse buffer and
        # sparse gradients, after a lazy layer's first forward, across a cache's growth; an intended -inf buffer;
        # a weight average after the suite
        c("nan", "once", "input", model="iterable"),
        c("nan", "once", "param", "16-mixed", model="sparse"),
        c("nan", "once", "param", model="lazy"),
        c("nan", "recurring", "param", model="growing"),
        c("nan", "once", "buffer", "16-true", callbacks="AutoRollback", model="inf-buffer"),
        c("nan", "once", "param", model="ema"),
        c("nan", "once", "grad", "bf16-mixed", model="swa"),
    ]

"""The trace's record: a status per tensor, the events that made non-finite values, and their resolution to an
``Origin`` (the data model of ``forensics.origin``)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_nanguard.policies.origin import Origin, SourceFrame, Stat
from lightning_nanguard.signals.tensors import iter_tensors

__all__ = [
    "FINITE",
    "VALUE_FREE",
    "Event",
    "Status",
    "batch_fields",
    "chain_of",
    "check",
    "copy_args",
    "float_tensors",
    "nonfinite_scalar",
    "to_origin",
]


class Status(NamedTuple):
    """What the trace knows of a tensor: finite, or which event its non-finite values came from."""

    finite: bool
    nan: bool = False
    tag: int | None = None


FINITE = Status(True)


@dataclass
class Event:
    """An op (or a source: a batch field, a parameter, a constant) that made non-finite values."""

    index: int
    kind: str  # "birth" | "intended" | "input" | "state"
    op: str = ""
    phase: str = "forward"
    produced: str = "nan"
    parent: int | None = None
    frame: SourceFrame | None = None
    node: str = ""
    module: str = ""
    stats: dict[str, Stat] = field(default_factory=dict)
    rows: tuple[int, ...] = ()
    fields: tuple[str, ...] = ()
    input_dtypes: tuple[str, ...] = ()
    output_dtype: str = ""
    masked_by: str = ""
    masked_frame: SourceFrame | None = None
    call: tuple[str, Any, Any] | None = None


def float_tensors(obj: object) -> list[Tensor]:
    # Only plain tensors: checking a tensor subclass (a DTensor) could start a collective.
    return [t for t in iter_tensors(obj) if type(t) in (Tensor, nn.Parameter) and t.is_floating_point()]


def batch_fields(batch: object, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    if isinstance(batch, Tensor):
        yield prefix or "batch", batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from batch_fields(v, f"{prefix}[{k!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            yield from batch_fields(v, f"{prefix}[{i}]")


# Ops whose output does not depend on their input's values: a finite output is no masking.
VALUE_FREE = (
    "aten.ones_like",
    "aten.zeros_like",
    "aten.empty_like",
    "aten.full_like",
    "aten.rand_like",
    "aten.randn_like",
    "aten.new_",
    "aten.empty",
    "aten.zeros",
    "aten.ones",
    "aten.full",
)


def _leaves(obj: object) -> Iterator[object]:
    """The Python values of a nested op argument (``iter_tensors`` walks its tensors)."""
    if isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _leaves(v)
    else:
        yield obj


def nonfinite_scalar(obj: object) -> bool:
    return any(isinstance(v, float) and not math.isfinite(v) for v in _leaves(obj))


def check(tensors: Sequence[Tensor]) -> list[tuple[bool, bool]]:
    """(all finite, any NaN) of each tensor, in one host read."""
    rows: list[Tensor] = []
    for t in tensors:
        if t.numel() == 0:
            rows.append(torch.zeros(2, device=t.device))
        else:
            lo, hi = torch.aminmax(t.detach())
            rows.append(torch.stack([lo, hi]).float())
    if not rows:
        return []
    device = rows[0].device
    values = torch.stack([r.to(device) for r in rows]).tolist()
    return [(math.isfinite(lo) and math.isfinite(hi), math.isnan(lo) or math.isnan(hi)) for lo, hi in values]


def copy_args(obj: object) -> Any:
    """``obj`` with every tensor detached and copied."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_args(v) for v in obj)
    if isinstance(obj, dict):
        return {k: copy_args(v) for k, v in obj.items()}
    return obj


def chain_of(events: list[Event], tag: int) -> list[Event]:
    """The events from ``tag`` back to its root: through real events, stopping before an intended one."""
    chain = [events[tag]]
    while chain[-1].parent is not None and events[chain[-1].parent].kind != "intended":
        chain.append(events[chain[-1].parent])
    return chain


def to_origin(
    chain: list[Event], events: list[Event], *, ops_checked: int, truncated: str, batch_size: int | None = None
) -> Origin:
    """The ``Origin`` of a chain (its root; where it surfaced, when that is another op)."""
    root, top = chain[-1], chain[0]
    phase = root.phase if root.kind == "birth" else "state" if root.kind == "state" else "input"
    note = ""
    if root.parent is not None:
        cause = events[root.parent]
        where = ", ".join(cause.fields) or cause.op or "an intended source"
        note = f"its input carried {cause.produced} from {where}"
    surfaced = top if top is not root else None
    return Origin(
        op=root.op,
        phase=phase,
        produced=root.produced,
        input_dtypes=root.input_dtypes,
        output_dtype=root.output_dtype,
        frame=root.frame,
        node=root.node,
        module=root.module,
        stats=tuple(root.stats.items()),
        rows=root.rows,
        batch_size=batch_size or 0,
        fields=root.fields,
        masked_by=root.masked_by,
        masked_frame=root.masked_frame,
        surfaced_op=surfaced.op if surfaced else "",
        surfaced_phase=surfaced.phase if surfaced else "",
        surfaced_node=surfaced.node if surfaced else "",
        note=note,
        ops_checked=ops_checked,
        truncated=truncated,
    )

"""One row per run, as Markdown and CSV: the outcome table ``nanguard demo`` and ``nanguard ablate`` print."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COLUMNS", "LEGEND", "Row", "markdown", "write_csv"]

LEGEND = """\
finished: "yes" when the run returned normally AND its final weights are finite (and its losses, where measured);
  "NO" when it raised, or ended with non-finite weights or loss: the last column says which. A run that exits 0 with
  NaN weights is not finished.
skipped: updates dropped (by nanguard, a quarantine or the GradScaler); rollbacks: states restored; LR scale: the
  learning rate at the end over the configured one."""

_NOTE_WIDTH = 70  # the printed table's note column (the CSV holds the whole sentence)


@dataclass
class Row:
    """What one run did (every column of the table).

    ``finished`` is True only for a run that returned normally with finite final weights (and losses, where
    measured); ``note`` says why a run did not finish, or how a finished one was judged where its weights could not
    be read (``why`` derives it from ``error`` and the losses where it is empty).
    """

    task: str
    config: str
    seed: int
    finished: bool
    train_loss: float = math.nan
    val_loss: float = math.nan
    incidents_by_cause: dict[str, int] = field(default_factory=dict)
    skipped_steps: int = 0
    rollbacks: int = 0
    lr_scale: float = 1.0
    wall_time: float = math.nan
    log_dir: str = ""
    error: str = ""
    note: str = ""

    def why(self) -> str:
        """Why the run did not finish (or how a finished one was judged), in one line."""
        if self.note:
            return self.note
        if self.finished:
            return ""
        if self.error:
            return self.error.strip().splitlines()[0] if self.error.strip() else "failed"
        if not math.isfinite(self.train_loss):
            return "ended with a non-finite training loss"
        if not math.isfinite(self.val_loss):
            return "ended with a non-finite validation loss"
        return "ended with non-finite weights"

    def cells(self, width: int | None = None) -> list[str]:
        causes = ", ".join(f"{k}={v}" for k, v in sorted(self.incidents_by_cause.items())) or "-"
        why = self.why()
        if width is not None and len(why) > width:
            why = why[: width - 3] + "..."
        return [
            self.task,
            self.config,
            str(self.seed),
            "yes" if self.finished else "NO",
            _num(self.train_loss),
            _num(self.val_loss),
            causes,
            str(self.skipped_steps),
            str(self.rollbacks),
            f"{self.lr_scale:.3g}",
            f"{self.wall_time:.1f}",
            why.replace("|", "/") if width is not None else why,
        ]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


COLUMNS = [
    "task",
    "config",
    "seed",
    "finished",
    "train loss",
    "val loss",
    "incidents by cause",
    "skipped",
    "rollbacks",
    "LR scale",
    "wall s",
    "note",
]


def _num(value: float) -> str:
    return "nan" if not math.isfinite(value) else f"{value:.4g}"


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r.cells(_NOTE_WIDTH)) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: str, rows: Sequence[Row]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([*COLUMNS, "log dir", "error"])
        for r in rows:
            writer.writerow([*r.cells(), r.log_dir, r.error.splitlines()[0] if r.error else ""])

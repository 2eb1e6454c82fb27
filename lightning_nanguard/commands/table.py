"""One row per run, as Markdown and CSV: the outcome table ``nanguard demo`` and ``nanguard ablate`` print."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COLUMNS", "Row", "markdown", "write_csv"]


@dataclass
class Row:
    """What one run did (every column of the table)."""

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

    def cells(self) -> list[str]:
        causes = ", ".join(f"{k}={v}" for k, v in sorted(self.incidents_by_cause.items())) or "-"
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
]


def _num(value: float) -> str:
    return "nan" if not math.isfinite(value) else f"{value:.4g}"


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: str, rows: Sequence[Row]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([*COLUMNS, "log dir", "error"])
        for r in rows:
            writer.writerow([*r.cells(), r.log_dir, r.error.splitlines()[0] if r.error else ""])

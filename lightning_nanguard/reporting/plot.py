"""``nanguard report --plot``: a run's curves with its incidents marked, as a self-contained SVG (no dependencies).

Four panels share the step axis: loss, gradient norm, loss scale, learning-rate scale (a panel whose series the run
never logged is left out). Each incident is a vertical line at its step, coloured by its main action; its cause is
the line's tooltip. ``.png`` needs matplotlib (``pip install "lightning-nanguard[plot]"``).
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
from collections.abc import Sequence
from html import escape

from lightning_nanguard.reporting import keys
from lightning_nanguard.reporting.incidents import Incident

__all__ = ["PANELS", "read_series", "render_svg", "write_plot"]

PANELS: tuple[tuple[str, str], ...] = (
    ("loss", keys.LOSS),
    ("gradient norm", keys.GRAD_NORM),
    ("loss scale", keys.LOSS_SCALE),
    ("learning-rate scale", keys.LR_SCALE),
)
_COLOURS = {
    "stop": "#d62728",
    "rollback": "#ff7f0e",
    "backoff": "#9467bd",
    "quarantine": "#8c564b",
    "promote": "#17becf",
}
_W, _PANEL_H, _PAD = 760, 150, 48

Series = dict[str, list[tuple[int, float]]]


def read_series(run_dir: str) -> Series:
    """The panels' scalars of a run directory: TensorBoard event files, else Lightning's CSV ``metrics.csv`` (a row
    that does not parse is left out). ``RuntimeError`` saying which file when the event files cannot be read."""
    wanted = {tag for _, tag in PANELS}
    if glob.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        try:
            acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
            acc.Reload()
            return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"] if t in wanted}
        except Exception as err:  # a damaged event file: whatever tensorboard's reader raises
            raise RuntimeError(f"the TensorBoard event files in {run_dir} cannot be read ({str(err)[:200]})") from err
    csv_path = os.path.join(run_dir, "metrics.csv")
    out: Series = {}
    if os.path.isfile(csv_path):
        import csv

        with open(csv_path, newline="", encoding="utf-8", errors="replace") as f:
            try:
                for row in csv.DictReader(line.replace("\0", "") for line in f):
                    for tag in wanted:
                        if row.get(tag) not in (None, ""):
                            with contextlib.suppress(ValueError, TypeError, KeyError):
                                out.setdefault(tag, []).append((int(row["step"]), float(row[tag])))
            except csv.Error as err:
                raise RuntimeError(f"{csv_path} cannot be read as CSV ({err})") from err
    return out


def render_svg(series: Series, incidents: Sequence[Incident], title: str) -> str:
    panels = [(name, series[tag]) for name, tag in PANELS if series.get(tag)]
    steps = [s for _, pts in panels for s, _ in pts] + [i.step for i in incidents]
    lo, hi = (min(steps), max(steps)) if steps else (0, 1)
    hi = hi if hi > lo else lo + 1

    def x(step: float) -> float:
        return _PAD + (step - lo) / (hi - lo) * (_W - 2 * _PAD)

    height = _PAD + max(1, len(panels)) * (_PANEL_H + 20) + 20
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<text x="{_PAD}" y="20" font-size="14">{escape(title)}</text>',
    ]
    for k, (name, pts) in enumerate(panels):
        top = _PAD + k * (_PANEL_H + 20)
        finite = [v for _, v in pts if math.isfinite(v)]
        vmin, vmax = (min(finite), max(finite)) if finite else (0.0, 1.0)
        vmax = vmax if vmax > vmin else vmin + 1.0

        def y(v: float, top: int = top, vmin: float = vmin, vmax: float = vmax) -> float:
            v = min(max(v, vmin), vmax) if math.isfinite(v) else vmax
            return top + _PANEL_H - (v - vmin) / (vmax - vmin) * _PANEL_H

        out.append(
            f'<rect x="{_PAD}" y="{top}" width="{_W - 2 * _PAD}" height="{_PANEL_H}" fill="none" stroke="#ccc"/>'
        )
        out.append(f'<text x="{_PAD + 4}" y="{top + 12}">{escape(name)} [{vmin:.4g}, {vmax:.4g}]</text>')
        line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in pts)
        out.append(f'<polyline class="series" data-tag="{escape(name)}" fill="none" stroke="#1f77b4" points="{line}"/>')
        for s, v in pts:
            if not math.isfinite(v):
                out.append(f'<circle cx="{x(s):.1f}" cy="{top + 4}" r="3" fill="#d62728"><title>{v}</title></circle>')
    bottom = _PAD + max(1, len(panels)) * (_PANEL_H + 20) - 20
    for inc in incidents:
        actions = inc.actions or [inc.action]
        colour = next((_COLOURS[a] for a in _COLOURS if a in actions), "#7f7f7f")
        label = f"step {inc.step}: {inc.cause or inc.trigger} -> {', '.join(actions)}"
        out.append(
            f'<line class="incident" x1="{x(inc.step):.1f}" y1="{_PAD}" x2="{x(inc.step):.1f}" y2="{bottom}" '
            f'stroke="{colour}" stroke-dasharray="3,2"><title>{escape(label)}</title></line>'
        )
    out.append(f'<text x="{_PAD}" y="{height - 6}">step {lo} .. {hi}; dashed lines: incidents</text>')
    out.append("</svg>")
    return "\n".join(out)


def write_plot(path: str, run_dir: str, incidents: Sequence[Incident]) -> None:
    """Write ``path`` (``.svg``; ``.png`` with matplotlib). Raises ``RuntimeError`` when ``.png`` cannot be made."""
    series = read_series(run_dir)
    title = f"nanguard: {run_dir}"
    if path.lower().endswith(".svg"):
        with open(path, "w", encoding="utf-8") as f:
            f.write(render_svg(series, incidents, title))
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            f"cannot write {path}: PNG plots need matplotlib (pip install 'lightning-nanguard[plot]'); "
            "an .svg path needs nothing"
        ) from None
    panels = [(name, series[tag]) for name, tag in PANELS if series.get(tag)]
    fig, axes = plt.subplots(max(1, len(panels)), 1, sharex=True, figsize=(9, 2.2 * max(1, len(panels))))
    axes = list(axes) if len(panels) > 1 else [axes]
    for ax, (name, pts) in zip(axes, panels, strict=False):
        ax.plot([s for s, _ in pts], [v for _, v in pts])
        ax.set_ylabel(name)
        for inc in incidents:
            ax.axvline(inc.step, color="tab:red", linestyle="--", linewidth=0.8)
    axes[0].set_title(title)
    fig.savefig(path)
    plt.close(fig)

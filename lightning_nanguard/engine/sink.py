"""Report: every incident goes to one log (JSON lines on rank 0), the loggers, TensorBoard text, and the summary.

The sink never feeds a decision: rank-local incidents (a checkpoint refused on rank 0, the only rank that saves) are
recorded here and nowhere else.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_nanguard import _distributed, _notices
from lightning_nanguard._files import is_local_path
from lightning_nanguard.reporting import emit
from lightning_nanguard.reporting.dashboard import write_layout
from lightning_nanguard.reporting.incidents import INCIDENTS_FILE, Incident, IncidentLog
from lightning_nanguard.reporting.keys import key
from lightning_nanguard.reporting.summary import FACTS_FILE, SUMMARY_FILE, RunFacts, format_summary

__all__ = ["INCIDENTS_FILE", "SUMMARY_FILE", "IncidentSink", "incident_markdown", "repeat_markdown", "run_directory"]


class IncidentSink:
    """The run's incidents, in order (identical on every rank for engine-decided events)."""

    def __init__(self) -> None:
        self.log = IncidentLog()
        self.log_dir: str | None = None  # rank 0's only (the files it writes)
        self.run_dir: str | None = None  # the same on every rank

    @property
    def records(self) -> list[Incident]:
        return self.log.records

    def start(self, trainer: pl.Trainer) -> None:
        """New fit: a fresh log. Files are written only where a logger is configured, in its run folder on the local
        filesystem (``run_directory``)."""
        self.log = IncidentLog()
        self.log_dir = self.run_dir = None
        if not trainer.loggers:
            return
        log_dir = run_directory(trainer)  # a broadcast: every rank calls it here
        self.run_dir = log_dir  # every rank's: incident bundles go there, whichever rank writes one
        # Local directories only: a remote one (s3://, memory://) would be created as a local folder of that name.
        if trainer.is_global_zero and log_dir is not None and is_local_path(log_dir):
            self.log_dir = log_dir
            self.log.path = os.path.join(log_dir, INCIDENTS_FILE)
            self.log.touch()
            write_layout(trainer)

    def record(self, trainer: pl.Trainer, incident: Incident) -> bool:
        """Log an incident: the JSON line (rank 0), ``nanguard/incident/<action>`` scalars, a TensorBoard text.

        A repeat of an earlier incident (``Incident.recurring_key``) is counted in that record; it reaches
        TensorBoard only as the count doubles (the 2nd, 4th, 8th, ... time), with the count so far. Returns True
        for a repeat."""
        record = self.log.add(incident)
        if record is not None and record.count & (record.count - 1):
            return True
        actions = incident.actions or [incident.action]
        # At Lightning's logging step of the moment, the axis the training curves are drawn on.
        emit.log_event(trainer, {key("incident", a): 1.0 for a in actions})
        text = incident_markdown(incident) if record is None else repeat_markdown(record)
        emit.log_text(trainer, key("incidents"), text)
        return record is not None

    def summary(
        self,
        trainer: pl.Trainer,
        callbacks: list[str],
        *,
        monitored: bool,
        final_state: str,
        notes: list[str],
        steps: int | None = None,
        evaluation: str = "",
    ) -> str:
        facts = RunFacts(
            callbacks=tuple(callbacks),
            monitored=monitored,
            final_state=final_state,
            notes=tuple(notes),
            end_step=int(trainer.global_step),
            steps=steps,
            evaluation=evaluation,
        )
        text = format_summary(self.records, callbacks, self.log.path, **facts.summary_arguments())
        _notices.note(text)
        if self.log_dir is not None and trainer.is_global_zero:
            path = os.path.join(self.log_dir, SUMMARY_FILE)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            # What the summary says beside the incidents: nanguard report prints the same summary from it.
            with open(os.path.join(self.log_dir, FACTS_FILE), "w", encoding="utf-8") as f:
                f.write(facts.to_json() + "\n")
        return text


def run_directory(trainer: pl.Trainer) -> str | None:
    """The folder of the first logger's run, where nanguard's files go (``<log_dir>`` in the README): where Lightning
    puts that logger's checkpoints, less ``checkpoints``. TensorBoardLogger's and CSVLogger's ``log_dir``
    (``<save_dir>/<name>/<version>``); for any other logger ``<save_dir>/<name>/<version>`` too, never its bare
    ``save_dir``, with the Trainer's ``default_root_dir`` for a ``save_dir`` that is the working directory (a logger
    that keeps its history in memory reports it). ``None`` (no files) for a logger that saves nothing locally
    (``save_dir`` ``None``: ``fast_dev_run``'s DummyLogger, a remote tracker), and never the working directory itself.
    Rank 0's, on every rank (one broadcast)."""
    logger = trainer.loggers[0]
    cwd = os.path.realpath(os.getcwd())
    if isinstance(logger, (TensorBoardLogger, CSVLogger)):
        path = trainer.log_dir  # Lightning's own answer, broadcast
    else:
        local: str | None = None
        if trainer.is_global_zero and logger.save_dir is not None:
            save_dir = os.fspath(logger.save_dir)
            if os.path.realpath(save_dir) == cwd:
                save_dir = os.fspath(trainer.default_root_dir)
            name, version = logger.name, logger.version
            parts = [str(name)] if name else []
            if version is not None and version != "":
                parts.append(version if isinstance(version, str) else f"version_{version}")
            local = os.path.join(save_dir, *parts)
        found = _distributed.broadcast_object(trainer, local)
        path = found if isinstance(found, str) else None
    return None if path is None or os.path.realpath(path) == cwd else path


def repeat_markdown(record: Incident) -> str:
    """A recurring incident's count, for TensorBoard's text dashboard."""
    where = f" at `{record.where}`" if record.where else ""
    return (
        f"**step {record.last_step}**: `{record.trigger}` again, cause **{record.cause or 'n/a'}**{where}: "
        f"{record.count} times between steps {record.step} and {record.last_step}"
    )


def incident_markdown(incident: Incident) -> str:
    """The incident as Markdown, for TensorBoard's text dashboard."""
    actions = ", ".join(incident.actions or [incident.action])
    lines = [
        f"**step {incident.step}** (epoch {incident.epoch}, batch {incident.batch_idx}, ranks {incident.ranks}): "
        f"`{incident.trigger}`",
        "",
        f"* cause: **{incident.cause or 'n/a'}**" + (f" at `{incident.where}`" if incident.where else ""),
        f"* actions: {actions} (by {incident.source})",
        f"* {incident.message}",
    ]
    if incident.budget_left >= 0:
        lines.append(f"* budget left: {incident.budget_left}")
    return "\n".join(lines)

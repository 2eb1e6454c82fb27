"""GradNormMonitor's arguments: declared, validated and documented once; the engine reads them from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from lightning_nanguard.config._declare import CallbackConfig, Choice, Flag, Float, Int, PathArg, arg

__all__ = ["MAX_BUNDLE_MB", "MAX_REPLAY_STEPS", "GradNormMonitorConfig"]

# The largest incident bundle budget taken, in MB (1 TB): any larger number is no budget at all (a disk fills first).
MAX_BUNDLE_MB = 1e6
MAX_REPLAY_STEPS = 20.0  # the replays' default budget, in training steps' worth of time (forensics reads it too)


@dataclass(frozen=True)
class GradNormMonitorConfig(CallbackConfig):
    """GradNormMonitor's arguments: how a non-finite or spiking step is met, and how incidents are investigated."""

    kind: ClassVar[str] = "GradNormMonitor"

    on_nonfinite: Literal["warn", "skip", "stop"] = arg(
        "skip",
        Choice(("warn", "skip", "stop")),
        """`"skip"` drops the update; `"warn"` lets it through and warns (the weights will be poisoned: for diagnosis
        only); `"stop"` drops it and stops training at once.""",
    )
    max_consecutive_skips: int = arg(
        20,
        Int(minimum=1),
        """Non-finite steps in a row tolerated (bad data's, which the quarantine answers, not counted); one more
        escalates to a rollback (and a learning-rate backoff where that is the cause's remedy) where AutoRollback is
        installed, and otherwise stops with `NonFiniteTrainingError`. Under `16-mixed` with a LossScaleWatchdog
        installed, overflow streaks are the watchdog's to judge.""",
    )
    layer_depth: int | None = arg(
        1,
        Int(minimum=1, allow_none=True),
        """Module depth at which per-layer gradient norms are grouped (`1`: top-level children, `2`: their children,
        ...), counted below single-child wrappers such as `self.model`; `None` turns per-layer norms off.""",
    )
    log_every_n_steps: int | None = arg(
        None,
        Int(minimum=1, allow_none=True),
        """How often per-layer norms (and the histogram) reach the loggers; `None` follows
        `Trainer(log_every_n_steps)`.""",
    )
    histogram: bool = arg(False, Flag(), "Also write a TensorBoard histogram of the per-tensor gradient norms.")
    spike_zscore: float | None = arg(
        None,
        Float(low=0.0, low_inclusive=False, allow_none=True),
        """Flag a step whose loss or gradient norm is this many standard deviations above its running mean (in log
        space, so a 10x jump is the same spike at any scale); `None` turns spike detection off. The test runs on the
        host floats the step's one read brings back.""",
    )
    spike_warmup: int = arg(50, Int(minimum=1), "Finite steps observed before spikes are tested.")
    on_spike: Literal["warn", "skip", "rollback", "probe"] = arg(
        "warn",
        Choice(("warn", "skip", "rollback", "probe")),
        """`"warn"` records and warns; `"skip"` drops the update; `"rollback"` drops it and has AutoRollback restore
        the last good state (and OptimizerBackoff lower the learning rate); `"probe"` measures whether the weights got
        worse: AutoRollback's probe batch (a few training samples, scored at each snapshot) is re-scored with the
        current weights at a spike, and at a loss that climbs back and stays up (the median of 5 steps gave back half
        of what the run had learned lately); its loss rose more than 2x against the newest sound snapshot's, or gave
        back a third of what it had learned in the last 50 steps while the training loss gave back half: roll back to
        before the climb and lower the learning rate (cause `weights_diverging`); it did not: nothing is done.
        Requires `spike_zscore`.""",
    )
    quarantine: bool = arg(True, Flag(), "Quarantine the data that caused an incident (`input_data`/`targets` causes).")
    quarantine_file: str | None = arg(
        None,
        PathArg(must_exist=True),
        """A JSON file of sample indices to quarantine from the start (`[12, 507]` or `{"samples": [...]}`: the format
        of a run's `<log_dir>/nanguard/quarantine.json`).""",
    )
    forensics: Literal["first", "every", "off"] = arg(
        "first",
        Choice(("first", "every", "off")),
        """`"first"` replays the first incident of each kind of evidence and reuses that verdict for later ones;
        `"every"` replays each incident; `"off"` uses the cheap evidence only.""",
    )
    max_replay_steps: float = arg(
        MAX_REPLAY_STEPS,
        Float(low=0.0),
        "Replays stop once they have cost this many training steps' worth of time in this fit.",
    )
    max_dropped_fraction: float | None = arg(
        0.05,
        Float(low=0.0, high=1.0, allow_none=True),
        """The dropped-updates budget: more dropped updates than this share of the last `dropped_window` optimizer
        steps (drops a rollback answered and the GradScaler's routine skips aside) stops training with
        `NonFiniteTrainingError` naming the cause and its fix; `None`: no budget.""",
    )
    dropped_window: int = arg(1000, Int(minimum=1), "The window, in optimizer steps, of that budget.")
    on_dropped_budget: Literal["stop", "warn"] = arg(
        "stop", Choice(("stop", "warn")), '`"stop"`; or `"warn"`: warn as the budget is crossed and go on.'
    )
    bundle_mb: float = arg(
        64.0,
        Float(low=0.0, high=MAX_BUNDLE_MB),
        "The size budget, in MB, of each replayed incident's bundle (for `nanguard replay`); `0`: none.",
    )
    max_quarantined_fraction: float = arg(
        0.005,
        Float(low=0.0, high=1.0),
        """Records blamed as a hypothesis (not holding NaN/inf) past this share of the dataset (never fewer than 4):
        the blame is withdrawn and they are released.""",
    )

"""The TensorBoard dashboard: a custom-scalars layout grouping nanguard's charts, written once per run.

Open TensorBoard's "Custom Scalars" tab: three sections (health, precision: the loss scale, overflows and each module's headroom; interventions), each chart a regex over
the ``nanguard/...`` tags. Incident markers are the ``nanguard/incident/<action>`` scalars (1.0 at each incident's
step) and the incident text is Markdown under ``nanguard/incidents`` in the "Text" tab.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_nanguard.reporting import keys

__all__ = ["LAYOUT", "write_layout"]


def _chart(*tags: str) -> list[object]:
    return ["Multiline", list(tags)]


LAYOUT: dict[str, dict[str, list[object]]] = {
    "nanguard: health": {
        "loss": _chart(keys.LOSS + "$"),
        "gradient norm (last finite; interval max; after clipping)": _chart(
            keys.GRAD_NORM + "$", keys.GRAD_NORM_MAX + "$", keys.GRAD_NORM_CLIPPED + "$"
        ),
        "per-layer gradient norms": _chart(keys.LAYER_GRAD_NORM + "/.*"),
        "non-finite steps per interval": _chart(keys.NONFINITE_STEPS + "$"),
    },
    "nanguard: precision": {
        "loss scale": _chart(keys.LOSS_SCALE + "$"),
        "overflows": _chart(keys.OVERFLOW_RATE + "$", keys.OVERFLOW_STREAK + "$", keys.OVERFLOW_STEPS + "$"),
        "evaluation batches re-run in float32": _chart(keys.EVAL_FP32_RERUNS + "$"),
        "headroom in bits, lowest modules (0: the output overflows)": _chart(
            keys.HEADROOM_MIN + "$", keys.HEADROOM + "/.*"
        ),
        "modules moved to float32 by the headroom forecast": _chart(keys.PROMOTED_MODULES + "$"),
        "loss-scaled gradient headroom in bits, and the scale lowered ahead of an overflow": _chart(
            keys.HEADROOM_SCALED_GRAD + "$", keys.LOSS_SCALE_LOWERED + "$"
        ),
    },
    "nanguard: interventions": {
        "incidents (1.0 at each incident's step, by action)": _chart(keys.key("incident") + "/.*"),
        "dropped updates": _chart(keys.SKIPPED_STEPS + "$"),
        "rollbacks": _chart(keys.ROLLBACKS + "$", keys.ROLLBACK_SKIPPED_BATCHES + "$"),
        "learning-rate scale and eps": _chart(keys.LR_SCALE + "$", keys.EPS + "(/.*)?$"),
        "quarantined samples or batches": _chart(keys.QUARANTINED + "$"),
    },
}


@rank_zero_only
def write_layout(trainer: pl.Trainer) -> None:
    """Write the layout to every TensorBoardLogger of ``trainer`` (once per run; rank 0)."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_custom_scalars(LAYOUT)

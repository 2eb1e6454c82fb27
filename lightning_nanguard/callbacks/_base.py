"""The plumbing every fit-time nanguard callback shares, so each callback file holds only its own decisions."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_nanguard.callbacks._common import check_strategy_supported
from lightning_nanguard.context import NanGuardContext, get_context

__all__ = ["NanGuardCallback"]


class NanGuardCallback(Callback):
    """Joins the Trainer's shared nanguard context for each fit, forwards losses to it, and ends the fit through it.

    * ``setup`` (fit): checks the environment (``_check_environment``), joins the context, then ``_setup_fit``.
    * ``on_before_backward``: the loss goes to the shared step health (idempotent across callbacks).
    * ``on_train_end``: prints the summary once and raises a pending stop error once (whichever callback is first).
    * ``on_exception``: prints the summary once.
    * ``teardown`` (fit): ``_teardown_fit``, then the context forgets the fit.
    """

    def _check_environment(self, trainer: pl.Trainer) -> None:
        """Refuse a setup this callback cannot handle correctly (raise ``UnsupportedSetupError``)."""
        check_strategy_supported(trainer, type(self).__name__)

    def _setup_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: NanGuardContext) -> None:
        """Per-fit setup once the shared context is ready: subscribe to its events here."""

    def _teardown_fit(self, trainer: pl.Trainer) -> None:
        """Per-fit cleanup, before the shared context forgets the fit."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_environment(trainer)
        ctx = get_context(trainer)
        ctx.setup(trainer, type(self).__name__)
        self._setup_fit(trainer, pl_module, ctx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        get_context(trainer).observe_loss(loss)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        get_context(trainer).finish(trainer, raise_pending=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        get_context(trainer).finish(trainer, raise_pending=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._teardown_fit(trainer)
            get_context(trainer).teardown()

"""The plumbing every nanguard callback shares: join the Trainer's engine, and drive it if first.

Every nanguard callback joins the engine in ``setup`` and registers its capability (``_install``). The first one to
join in a fit drives the engine: its hooks forward to the engine, every other member's hooks return at once. So the
stages run exactly once per step, whatever the callbacks' order and number.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nanguard import _lightning_compat
from lightning_nanguard.callbacks._common import check_strategy_supported
from lightning_nanguard.callbacks._state import CheckedState, adopt_saved_state, saved_state_key
from lightning_nanguard.config import Configured
from lightning_nanguard.engine import Engine, get_engine

__all__ = ["NanGuardCallback", "bind_engine_hooks", "mute_idle_hooks", "show_hooks", "unmute_hooks"]

# The hooks Lightning dispatches once per batch or per step. For each, every installed callback costs a profiler
# context and a ``state_key`` read even when the hook does nothing (docs/PERFORMANCE.md). Lightning skips a hook whose
# attribute is not callable (``trainer/call.py`` ``_call_callback_hooks``: ``if callable(fn)``), so during a fit a
# member sets the per-batch hooks it has nothing to do in to ``None`` on the instance: Callback's no-ops always, the
# engine's hooks unless it drives. ``setup`` of the next fit and ``teardown`` put the methods back.
_PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)


class NanGuardCallback(CheckedState, Configured, Callback):
    """Base of the nanguard callbacks. Subclasses override ``_install`` (and their own non-engine hooks)."""

    _drives = False
    _state_key_cache: str | None = None
    _engine_now: Engine

    @override
    @property
    def state_key(self) -> str:
        # Lightning reads it for every hook of every callback (profiler names): build it once.
        # The class name: callbacks/_state.py says why no argument is in it.
        key = self._state_key_cache
        if key is None:
            key = self._state_key_cache = saved_state_key(self)
        return key

    def _check_environment(self, trainer: pl.Trainer) -> None:
        """Refuse a setup this callback cannot handle correctly (raise ``UnsupportedSetupError``)."""
        check_strategy_supported(trainer, type(self).__name__)

    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        """Register this callback's capability with the engine (every fit, on every rank)."""

    def _uninstall(self, trainer: pl.Trainer) -> None:
        """Per-fit cleanup, before the engine forgets the fit."""

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._unmute_hooks()
        self._check_environment(trainer)
        engine = get_engine(trainer)
        self._drives = engine.join(trainer, self)
        self._engine_now = engine  # the hooks use it directly (a WeakKeyDictionary lookup per hook adds up)
        self._install(trainer, pl_module, engine)
        self._mute_idle_hooks()

    def _mute_idle_hooks(self) -> None:
        mute_idle_hooks(self, drives=self._drives)
        if self._drives:
            bind_engine_hooks(self, self._engine_now)

    def _unmute_hooks(self) -> None:
        unmute_hooks(self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The last hook of a fit: the first member to get here checks the state once more, after every callback's
        # on_train_end and on_fit_end (``Engine.end_fit``); the last one to leave raises a pending stop error.
        if stage == "fit":
            engine = get_engine(trainer)
            engine.end_fit(trainer, pl_module)
            self._uninstall(trainer)
            self._drives = False
            self._unmute_hooks()
            engine.leave(self)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        adopt_saved_state(self, checkpoint)  # a checkpoint that saved the state under an older key

    # ------------------------------------------------------------------ the engine's hooks (driver only)
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._drives:
            self._engine_now.train_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._drives:
            self._engine_now.train_epoch_start(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._drives:
            self._engine_now.batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._drives:
            self._engine_now.on_before_backward(trainer, pl_module, loss)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._drives:
            self._engine_now.before_optimizer_step(trainer, pl_module, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._drives:
            self._engine_now.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._drives:  # the first end-of-fit check; ``teardown`` runs the second
            self._engine_now.train_end(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._drives:
            get_engine(trainer).finish(trainer, raise_pending=False)


def mute_idle_hooks(callback: Callback, *, drives: bool) -> None:
    """Hide the per-batch hooks ``callback`` has nothing to do in, until ``unmute_hooks``: Callback's own no-ops, and
    the engine's forwarding hooks where ``callback`` does not drive (see ``_PER_BATCH_HOOKS``)."""
    cls = type(callback)
    for name in _PER_BATCH_HOOKS:
        impl = getattr(cls, name)
        if impl is getattr(Callback, name) or (impl is getattr(NanGuardCallback, name) and not drives):
            _lightning_compat.set_instance_attribute(callback, name, None)


def bind_engine_hooks(callback: NanGuardCallback, engine: Engine) -> None:
    """The driver's per-batch forwarding hooks, replaced on the instance by the engine's own bound methods (same
    signatures), so that Lightning calls the engine directly: one Python frame and one ``_drives`` test fewer per
    hook and step. Only where the class keeps ``NanGuardCallback``'s forwarding method (a subclass that overrides a
    hook keeps it); ``unmute_hooks`` puts the methods back."""
    cls = type(callback)
    for name, target in (
        ("on_train_batch_start", engine.batch_start),
        ("on_before_backward", engine.on_before_backward),
        ("on_before_optimizer_step", engine.before_optimizer_step),
        ("on_train_batch_end", engine.on_train_batch_end),
    ):
        if getattr(cls, name) is getattr(NanGuardCallback, name) and not _lightning_compat.has_instance_attribute(
            callback, name
        ):
            _lightning_compat.set_instance_attribute(callback, name, target)
    if _lightning_compat.instance_attribute(callback, "on_train_batch_start") == engine.batch_start:
        # The engine hides it while it has nothing to do at a batch start (``Engine.refresh_batch_start``).
        engine.batch_start_switch = BatchStartSwitch(callback, engine)


class BatchStartSwitch:
    """Shows or hides the driver's ``on_train_batch_start`` (the engine's own ``batch_start``). A class, not a
    closure: a Trainer that holds it can still be pickled (``torch.save(trainer)``)."""

    __slots__ = ("callback", "engine")

    def __init__(self, callback: Callback, engine: Engine) -> None:
        self.callback = callback
        self.engine = engine

    def __call__(self, on: bool) -> None:
        target = self.engine.batch_start if on else None
        _lightning_compat.set_instance_attribute(self.callback, "on_train_batch_start", target)


def show_hooks(callback: Callback, names: tuple[str, ...], *, shown: bool) -> None:
    """Show ``names`` to Lightning's dispatch (the class's methods) or hide them (``None`` on the instance)."""
    for name in names:
        if shown:
            _lightning_compat.pop_instance_attribute(callback, name)
        else:
            _lightning_compat.set_instance_attribute(callback, name, None)


def unmute_hooks(callback: Callback) -> None:
    for name in _PER_BATCH_HOOKS:
        _lightning_compat.pop_instance_attribute(callback, name)

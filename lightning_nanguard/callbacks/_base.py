"""The plumbing every nanguard callback shares: join the Trainer's engine, and drive it if first.

Every nanguard callback joins the engine in ``setup``, registers its capability and its part (``_install``;
``engine/parts.py``: the one way a feature takes part in a step). The first one to join a fit drives the engine:
its per-batch hooks are the engine's own methods (``bind_hooks``); every other member's per-batch hooks are hidden
from Lightning's dispatch. So the stages run exactly once per step, whatever the callbacks' order and number, and a
feature's per-step work runs as its part's stages, called by the engine.
"""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_nanguard import _lightning_compat
from lightning_nanguard.callbacks._common import check_strategy_supported
from lightning_nanguard.callbacks._state import CheckedState, adopt_saved_state, saved_state_key
from lightning_nanguard.config import Configured
from lightning_nanguard.engine import Engine, get_engine

__all__ = ["NanGuardCallback", "bind_hooks", "unbind_hooks"]

# The hooks Lightning dispatches once per batch or per step. For each, every installed callback costs a profiler
# context and a ``state_key`` read even when the hook does nothing (docs/PERFORMANCE.md). Lightning skips a hook whose
# attribute is not callable (``trainer/call.py`` ``_call_callback_hooks``: ``if callable(fn)``), so during a fit
# every member's per-batch hooks are set on the instance: the engine's own methods for the driver (those it has),
# ``None`` for the rest. ``setup`` of the next fit and ``teardown`` put the class's (Callback's no-ops) back.
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
    """Base of the nanguard callbacks. Subclasses override ``_install`` (register a capability and a part), and
    ``_check_environment`` / ``_uninstall`` where they have something to check or release; their per-step work is
    their part's (``engine/parts.py``), never a Lightning per-batch hook of their own."""

    # A member that joins the training steps and may drive them; False: one that never drives (a fit with only such
    # members senses no step): CheckpointGuard, FP32Evaluation.
    steps_member: ClassVar[bool] = True
    # Joins validate/test/predict too, not only fit (FP32Evaluation).
    every_stage: ClassVar[bool] = False

    _drives = False
    _stage = ""
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
        """Register this callback's capability and part with the engine (every fit, on every rank)."""

    def _uninstall(self, trainer: pl.Trainer) -> None:
        """Per-fit cleanup, before the engine forgets the fit."""

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" and not self.every_stage:
            return
        unbind_hooks(self)
        self._stage = stage
        self._check_environment(trainer)
        engine = get_engine(trainer)
        self._drives = engine.join(trainer, self, fit=self.steps_member)
        self._engine_now = engine  # the hooks use it directly (a WeakKeyDictionary lookup per hook adds up)
        self._install(trainer, pl_module, engine)
        bind_hooks(self, engine, drives=self._drives)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The last hook of a fit: the first member to get here checks the state once more, after every callback's
        # on_train_end and on_fit_end (``Engine.end_fit``); the last one to leave raises a pending stop error.
        if stage == "fit" or self.every_stage:
            engine = get_engine(trainer)
            engine.end_fit(trainer, pl_module)
            self._uninstall(trainer)
            self._drives = False
            unbind_hooks(self)
            engine.leave(self)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        adopt_saved_state(self, checkpoint)  # a checkpoint that saved the state under an older key

    # ------------------------------------------------------------------ the engine's once-per-fit and evaluation hooks
    # Every member forwards them; the engine runs each once (whoever calls first), the parts' stages with it.
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._engine_now.train_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._drives:
            self._engine_now.train_epoch_start(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The first end-of-fit check (once, whoever calls first); ``teardown`` runs the second.
        self._engine_now.train_end(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation(trainer).evaluation_start(trainer, pl_module, "validation_step")

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation(trainer).evaluation_epoch_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation(trainer).evaluation_end(trainer)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation(trainer).evaluation_start(trainer, pl_module, "test_step")

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation(trainer).evaluation_epoch_end(trainer, pl_module)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation(trainer).evaluation_end(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._drives:
            get_engine(trainer).finish(trainer, raise_pending=False)

    def _evaluation(self, trainer: pl.Trainer) -> Engine | _NoEvaluation:
        """The engine where this member forwards the evaluation hooks (the first member to join), else a no-op."""
        engine = get_engine(trainer)
        return engine if engine.forwards_evaluation(self) else _NO_EVALUATION


class _NoEvaluation:
    """The evaluation hooks of a member that does not forward them."""

    def evaluation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step_name: str) -> None:
        pass

    def evaluation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass

    def evaluation_end(self, trainer: pl.Trainer) -> None:
        pass


_NO_EVALUATION = _NoEvaluation()


def bind_hooks(callback: Callback, engine: Engine | None, *, drives: bool) -> None:
    """Set ``callback``'s per-batch hooks on the instance for this fit: the engine's own bound methods (same
    signatures) where it drives, so that Lightning calls the engine directly (one Python frame fewer per hook and
    step), ``None`` (hidden from Lightning's dispatch) for every other per-batch hook and every other member."""
    targets = (
        {
            "on_train_batch_start": engine.batch_start,
            "on_before_backward": engine.on_before_backward,
            "on_before_optimizer_step": engine.before_optimizer_step,
            "on_train_batch_end": engine.on_train_batch_end,
        }
        if drives and engine is not None
        else {}
    )
    for name in _PER_BATCH_HOOKS:
        _lightning_compat.set_instance_attribute(callback, name, targets.get(name))
    if drives and engine is not None:
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


def unbind_hooks(callback: Callback) -> None:
    """The class's per-batch hooks back (between fits)."""
    for name in _PER_BATCH_HOOKS:
        _lightning_compat.pop_instance_attribute(callback, name)

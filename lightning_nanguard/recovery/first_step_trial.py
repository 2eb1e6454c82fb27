"""The first half-precision step of a fit, tried before it runs: one traced forward of its batch, leaving no trace.

The riskiest step of a ``16-mixed`` fit is its first: a model trained in float32 (or resumed from one) may overflow
float16 at once, before any sample of the headroom forecast has a history. ``trial_forward`` runs the
LightningModule's own ``training_step`` on the step's batch once, in the training precision's
context, with an ``OpProbe`` armed (every half-precision op's abs-max, by module), before the step's forward; the
forecast reads it and promotes a module that cannot run in float16 before the real forward overflows. It leaves no
trace, as the probe batch's scoring does (``recovery.probe``): buffers run on copies, the RNG streams (torch's,
Python's, NumPy's), modes, autocast and grad mode are put back, ``self.log`` is a no-op for the call, and whatever
else the module can reach (parameters of every submodule, tensors and containers held in attributes, its own random
generators) is put back by ``recovery.probe_trace.untouched``. Where the GradScaler's scale can be cut (``16-mixed``, automatic optimization, no
accumulation) the trial takes its loss's parameter gradients too (``torch.autograd.grad`` at a loss scale of 1), so
the first step's scale starts where its gradient's float16 headroom says. It runs eagerly on a compiled module (``torch.compiler.set_stance("force_eager")``): a
traced eager forward, no graph compiled for it. The per-module vector is reduced across ranks (MAX: every rank runs the trial at the same
step, and reduces even when its ``training_step`` raised) and read on the host once by the caller: the one
synchronization the trial costs, once per fit. Manual optimization is not tried (its ``training_step`` steps the optimizers).
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl
import torch

from lightning_nanguard import _distributed, _notices
from lightning_nanguard._lightning_compat import AttributePatches
from lightning_nanguard.forensics.isolation import preserved_state, swapped
from lightning_nanguard.recovery.probe_trace import host_rngs_kept, untouched
from lightning_nanguard.signals.op_headroom import OpProbe

__all__ = ["trial_forward"]


def trial_forward(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, probe: OpProbe, *, gradient: bool = False
) -> torch.Tensor:
    """``probe.reduce``'s vector for one traced ``training_step`` of ``batch`` and, with ``gradient``, one more
    entry: the largest parameter gradient of its loss at a loss scale of 1 (``torch.autograd.grad``: no ``.grad``
    written, no hook of a DDP wrapper run). Reduced across ranks (MAX), on the device; every entry -1 where nothing
    was measured (``training_step`` raised or returned no loss, no half-precision op ran in a watched module)."""
    size = 2 * len(probe.names) + gradient
    local: torch.Tensor | None = None
    if pl_module.automatic_optimization:
        local = _traced(trainer, pl_module, batch, probe, gradient)
    if local is None:
        local = torch.full((size,), -1.0, device=pl_module.device)
    return _distributed.max_across_ranks(trainer, local.to(pl_module.device))


def _traced(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, probe: OpProbe, gradient: bool
) -> torch.Tensor | None:
    patches = AttributePatches()
    grad: torch.Tensor | None = None
    # Outermost: whatever the call changed in what the module reaches (an EMA, its own generators) is put back last.
    with untouched(pl_module):
        try:
            with (
                preserved_state(pl_module),
                host_rngs_kept(),
                swapped(pl_module, float32=False),
                torch.set_grad_enabled(gradient),
            ):
                patches.set(pl_module, "log", _no_log)
                patches.set(pl_module, "log_dict", _no_log)
                # Eager, on a compiled module too: a dispatch mode sees every op of an eager forward (a compiled
                # graph's kernels are not aten ops), and no graph is compiled for the trial's forward.
                with torch.compiler.set_stance("force_eager"):
                    with trainer.precision_plugin.train_step_context():
                        probe.arm(overflows=True)
                        try:
                            out = pl_module.training_step(batch, 0)
                        finally:
                            probe.disarm()
                    if gradient:
                        grad = _gradient_or_note(pl_module, out)
        except Exception as exc:  # a trial must never take training down with it
            probe.reduce()
            _notices.note(f"nanguard: the first half-precision step could not be tried ({type(exc).__name__}: {exc}).")
            return None
        finally:
            patches.restore()
    ops = probe.reduce()
    if ops is None:
        ops = torch.full((2 * len(probe.names),), -1.0, device=pl_module.device)
    if not gradient:
        return ops
    tail = grad if grad is not None else torch.full((), -1.0)
    return torch.cat([ops, tail.to(ops.device).reshape(1)])


def _gradient_or_note(pl_module: pl.LightningModule, out: object) -> torch.Tensor | None:
    """``_largest_gradient``, or ``None`` with a note where the loss cannot be differentiated that way (reentrant
    activation checkpointing refuses ``torch.autograd.grad``): the ops' reading stands, the scale starts as set."""
    try:
        return _largest_gradient(pl_module, out)
    except RuntimeError as exc:
        _notices.note(f"nanguard: the first step's gradient could not be measured ({exc}); its scale is left as set.")
        return None


def _largest_gradient(pl_module: pl.LightningModule, out: object) -> torch.Tensor | None:
    """The largest |value| of the parameter gradients of ``out``'s loss (float32, 0-dim), ``None`` without one."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    params = [p for p in pl_module.parameters() if p.requires_grad]
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or loss.numel() != 1 or not params:
        return None
    grads = torch.autograd.grad(loss.float(), params, allow_unused=True)
    maxes = [g.detach().abs().amax().float() for g in grads if g is not None and g.numel()]
    return torch.stack(maxes).amax() if maxes else None


def _no_log(*args: object, **kwargs: object) -> None:
    return None

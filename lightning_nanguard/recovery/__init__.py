"""The only code that mutates model, optimizer or scaler state."""

from lightning_nanguard.recovery.step_skip import drop_update

__all__ = ["drop_update"]

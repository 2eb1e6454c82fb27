"""Which infinities in a checkpoint's ``state_dict`` are intended (a mask of -inf), and which are damage.

A ``state_dict`` entry that holds infinities and no NaN is intended when

* the checkpoint's sidecar (or manifest) records it: CheckpointGuard records, at each save, the buffers that held
  infinities and no NaN when training started (``signals.model_tensors.record_intended_infinities``); or
* the live module, where there is one (a resume, a fallback, a disk rollback), has a buffer of that name holding the
  same infinities at the same places with the same signs (the module built the mask in ``__init__``); or
* there is neither a module nor a record (``nanguard verify`` of a file Lightning wrote): it passes, with a note
  naming it, as nothing says whether it is a mask or a parameter that overflowed.

NaN is never intended, and optimizer state never holds intended infinities. A record that lists no entry is a
record: with it, every infinity is damage unless the live module explains it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["IntendedInfinities", "inf_only_entries", "intended_infinities_of", "live_intended", "recorded_intended"]


def _state_entries(checkpoint: object) -> dict[str, Tensor]:
    """The strided tensors of a Lightning checkpoint's ``state_dict`` (a plain state dict's entries)."""
    sd = checkpoint.get("state_dict") if isinstance(checkpoint, dict) and "state_dict" in checkpoint else checkpoint
    if not isinstance(sd, dict):
        return {}
    return {str(k): v for k, v in sd.items() if isinstance(v, Tensor) and v.layout == torch.strided}


def _inf_pattern(t: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(where t is infinite, its values there)``, on the CPU, for a floating ``t`` without NaN, else ``None``."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point() or bool(torch.isnan(t).any()):
        return None
    mask = torch.isinf(t)
    return mask.cpu(), t[mask].float().cpu()


def inf_only_entries(checkpoint: object) -> list[str]:
    """The ``state_dict`` entries that hold infinities and no NaN (a host read per entry: not for healthy steps)."""
    out = []
    for key, t in _state_entries(checkpoint).items():
        pattern = _inf_pattern(t)
        if pattern is not None and bool(pattern[0].any()):
            out.append(key)
    return out


def live_intended(checkpoint: object, module: nn.Module) -> set[str]:
    """The entries of ``inf_only_entries`` whose infinities the live ``module``'s buffer of the same name holds too,
    at the same places with the same signs (a mask the module builds itself)."""
    entries = _state_entries(checkpoint)
    buffers = dict(module.named_buffers())
    out = set()
    for key in inf_only_entries(checkpoint):
        live = buffers.get(key)
        if live is None or live.layout != torch.strided or live.shape != entries[key].shape:
            continue
        saved, now = _inf_pattern(entries[key]), _inf_pattern(live)
        if saved is not None and now is not None and torch.equal(saved[0], now[0]) and torch.equal(saved[1], now[1]):
            out.add(key)
    return out


def recorded_intended(meta: dict[str, Any] | None) -> frozenset[str] | None:
    """The entries a sidecar/manifest records as intended infinities, or ``None`` when it records nothing."""
    raw = (meta or {}).get("intended_infinities")
    if not isinstance(raw, list) or not all(isinstance(k, str) for k in raw):
        return None
    return frozenset(raw)


class IntendedInfinities:
    """The intended infinities of one loaded checkpoint, and the note to give where they were taken on trust."""

    def __init__(self, names: set[str], note: str = "") -> None:
        self.names = frozenset(names)
        self.note = note


def intended_infinities_of(
    checkpoint: object, meta: dict[str, Any] | None, module: nn.Module | None
) -> IntendedInfinities:
    """The ``state_dict`` entries of ``checkpoint`` whose infinities are intended (see the module): recorded in
    ``meta`` or matching ``module``; without either, every infinities-only entry, with a note."""
    recorded = recorded_intended(meta)
    names = set(recorded or ())
    if module is not None:
        names |= live_intended(checkpoint, module)
    elif recorded is None:
        trusted = inf_only_entries(checkpoint)
        if trusted:
            shown = ", ".join(trusted[:3]) + (f" and {len(trusted) - 3} more" if len(trusted) > 3 else "")
            note = (
                f"{shown} hold{'s' if len(trusted) == 1 else ''} infinities and no NaN, taken as intended (a mask "
                "of -inf); no record says otherwise, and without the model a parameter that overflowed looks the "
                "same: a resume checks them against the model's own buffers"
            )
            return IntendedInfinities(set(trusted), note)
    return IntendedInfinities(names)

"""Checkpoint integrity: sha256 sidecars, verification, and the newest verified checkpoint in a directory.

A checkpoint ``X.ckpt`` is *verified* when its sidecar ``X.ckpt.sha256`` exists and matches the file's sha256, the
file loads with ``torch.load(weights_only=True)``, and every floating-point tensor in its ``state_dict`` and
``optimizer_states`` is finite.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SIDECAR_SUFFIX", "VerifyResult", "last_good_checkpoint", "sha256_of", "verify_checkpoint", "write_sidecar"]

SIDECAR_SUFFIX = ".sha256"


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of ``verify_checkpoint``: ``ok`` and, when not ok, one sentence saying why."""

    path: str
    ok: bool
    reason: str = ""


def sha256_of(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_sidecar(path: str) -> str:
    """Write ``path + '.sha256'`` atomically; returns the digest."""
    digest = sha256_of(path)
    tmp = path + SIDECAR_SUFFIX + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{digest}  {os.path.basename(path)}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path + SIDECAR_SUFFIX)
    return digest


def nonfinite_tensors(checkpoint: dict[str, Any]) -> list[str]:
    """Names of the non-finite floating-point tensors in a checkpoint's weights and optimizer states."""
    bad: list[str] = []

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
                bad.append(prefix)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}[{i}]", v)

    walk("state_dict", checkpoint.get("state_dict", {}))
    walk("optimizer_states", checkpoint.get("optimizer_states", []))
    return bad


def verify_checkpoint(path: str, *, require_sidecar: bool = True) -> VerifyResult:
    """Check a checkpoint file: sidecar checksum, loadable with ``weights_only=True``, finite weights and state."""
    if not os.path.isfile(path):
        return VerifyResult(path, False, "file does not exist")
    sidecar = path + SIDECAR_SUFFIX
    if os.path.isfile(sidecar):
        with open(sidecar, encoding="utf-8") as f:
            expected = f.read().split()[0] if f.readable() else ""
        if sha256_of(path) != expected:
            return VerifyResult(
                path, False, f"sha256 does not match {os.path.basename(sidecar)} (corrupt or truncated)"
            )
    elif require_sidecar:
        return VerifyResult(path, False, f"no checksum sidecar {os.path.basename(sidecar)}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable file is a failed verification, whatever torch raises
        return VerifyResult(path, False, f"cannot be loaded with weights_only=True: {type(err).__name__}: {err}")
    bad = nonfinite_tensors(checkpoint) if isinstance(checkpoint, dict) else []
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return VerifyResult(path, False, f"non-finite tensors: {', '.join(bad[:3])}{more}")
    return VerifyResult(path, True)


def last_good_checkpoint(dirpath: str, *, require_sidecar: bool = True) -> str | None:
    """The newest (by modification time) ``*.ckpt`` in ``dirpath`` that verifies, or ``None``."""
    if not os.path.isdir(dirpath):
        return None
    candidates = [os.path.join(dirpath, n) for n in os.listdir(dirpath) if n.endswith(".ckpt")]
    for path in sorted(candidates, key=os.path.getmtime, reverse=True):
        if verify_checkpoint(path, require_sidecar=require_sidecar).ok:
            return path
    return None

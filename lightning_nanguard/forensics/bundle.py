"""An incident bundle: what ``nanguard replay`` needs to re-run one training step offline, under the run's log dir.

One directory per incident, ``<log_dir>/nanguard/bundles/step-<global step>[-rank-<r>]/``:

* ``manifest.json``: the LightningModule's import path (module and qualname; for a class defined in a script run as
  ``__main__``, the script's path too) and its ``hparams``, the precision (and the loss scale), the optimizers (class
  and every param group's hyperparameters, with its parameters' names), the step, epoch and batch index the step ran
  at, the origin with its verdict, the incident's diagnosis, and what was stored or left out (and why);
* ``step.pt``: the batch as ``training_step`` received it, the random states (torch, CUDA, Python, NumPy: those
  the in-process replay ran with), and the module's parameters and buffers;
* ``op.pt``: the origin op's name and a copy of its inputs, for an op-level replay (when the trace kept them).

Every ``.pt`` loads with ``torch.load(weights_only=True)`` (tensors and primitives; ``bundle_codec``), except a
batch holding arbitrary objects, which goes to ``batch.pkl`` and is read only when the reader allows pickle. A bundle
is data: ``bundle_read.read_bundle`` imports and calls nothing it names.

Size: nothing is written past ``budget_mb`` (default ``DEFAULT_BUDGET_MB``) or when the disk has less free space
than the bundle plus ``DISK_RESERVE_MB``; the returned ``BundleWritten.reason`` says why. When the whole state does
not fit the budget, only the parameters and buffers of the module that ran the origin op (``Origin.module``) are
stored (``state="origin_module"``) and the replay re-runs the origin op alone from ``op.pt``; when not even those
fit, none (``state="none"``).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_nanguard import _lightning_compat
from lightning_nanguard._files import hash_file
from lightning_nanguard.exceptions import BundleError
from lightning_nanguard.forensics.bundle_codec import Unencodable, capture_rng, encode, nbytes
from lightning_nanguard.forensics.bundle_read import BUNDLES_DIR, DATA_FILES, FORMAT, Bundle, read_bundle
from lightning_nanguard.forensics.replay import TracedPass
from lightning_nanguard.policies.causes import explain

__all__ = [
    "BUNDLES_DIR",
    "DEFAULT_BUDGET_MB",
    "DISK_RESERVE_MB",
    "Bundle",
    "BundleError",
    "BundleWritten",
    "read_bundle",
    "write_bundle",
]

DEFAULT_BUDGET_MB = 64.0
DISK_RESERVE_MB = 256.0  # free space a bundle never takes
_MB = float(1 << 20)


@dataclass(frozen=True)
class BundleWritten:
    """The outcome of ``write_bundle``: the directory (``None``: nothing written, ``reason`` says why)."""

    path: str | None
    bytes: int = 0
    state: str = "none"  # "full" | "origin_module" | "none"
    reason: str = ""


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return ""


def _script(kind: type) -> str | None:
    """The file of a class defined in a script run as ``__main__`` (``None`` for an importable class, a notebook)."""
    if kind.__module__ != "__main__":
        return None
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.abspath(path) if isinstance(path, str) else None


def _jsonable(value: object) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _hparams(pl_module: pl.LightningModule) -> tuple[dict[str, Any], list[str]]:
    hparams = dict(getattr(pl_module, "hparams", {}) or {})
    kept = {k: v for k, v in hparams.items() if _jsonable(v)}
    return kept, sorted(set(hparams) - set(kept))


def _optimizers(trainer: object, pl_module: pl.LightningModule) -> list[dict[str, Any]]:
    names = {id(p): n for n, p in pl_module.named_parameters()}
    out = []
    for opt in getattr(trainer, "optimizers", None) or []:
        groups = []
        for group in opt.param_groups:
            settings = {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}
            settings = {k: v for k, v in settings.items() if _jsonable(v)}
            settings["params"] = [names.get(id(p), "?") for p in group["params"]]
            groups.append(settings)
        out.append({"class": f"{type(opt).__module__}:{type(opt).__qualname__}", "param_groups": groups})
    return out


def _state(pl_module: pl.LightningModule, prefix: str | None) -> dict[str, Tensor]:
    """The module's parameters and buffers (only those under ``prefix``, when given), on the CPU."""
    state = {k: v for k, v in pl_module.state_dict(keep_vars=True).items() if isinstance(v, Tensor)}
    if prefix is not None:
        state = {k: v for k, v in state.items() if k.startswith(prefix + ".")}
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _sizes(pl_module: pl.LightningModule, prefix: str | None) -> int:
    return sum(
        v.numel() * v.element_size()
        for k, v in pl_module.state_dict(keep_vars=True).items()
        if isinstance(v, Tensor) and (prefix is None or k.startswith(prefix + "."))
    )


def write_bundle(
    log_dir: str,
    trainer: Any,
    pl_module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    traced: TracedPass | None = None,
    *,
    budget_mb: float = DEFAULT_BUDGET_MB,
    name: str | None = None,
    diagnosis: dict[str, Any] | None = None,
    step: int | None = None,
    epoch: int | None = None,
) -> BundleWritten:
    """Write the bundle of one step under ``log_dir`` (call it right after ``trace_pass``: the random states it
        stores are then those the traced pass ran with). ``diagnosis`` is the incident's (``Diagnosis.to_dict()``),
        kept in the manifest so ``nanguard replay`` can show the cause the incident named; ``step`` and ``epoch`` those the
    step ran at (the Trainer's ``global_step`` and ``current_epoch`` when not given). Never raises for a full disk
        or an oversized state: the returned value says what was written, or why nothing was."""
    origin = traced.origin if traced is not None else None
    call = traced.call if traced is not None else None
    budget = int(budget_mb * _MB)
    left_out: list[str] = []
    pickled_batch: bytes | None = None
    try:
        stored_batch: object = encode(batch)
    except Unencodable as err:
        stored_batch, pickled_batch = None, pickle.dumps(batch)
        left_out.append(f"the batch holds a {err}: stored with pickle (batch.pkl), read only with allow_pickle")
    batch_bytes = nbytes(stored_batch) + len(pickled_batch or b"")
    if batch_bytes > budget:
        return BundleWritten(
            None, reason=f"the batch alone is {batch_bytes / _MB:.1f} MB, over budget_mb={budget_mb:g}"
        )
    op_bytes = nbytes(call) if call is not None else 0
    if call is not None and batch_bytes + op_bytes > budget:
        call, op_bytes = None, 0
        left_out.append("the origin op's inputs (over the budget)")
    room = budget - batch_bytes - op_bytes
    full = _sizes(pl_module, None)
    module = origin.module if origin is not None and origin.module else None
    if full <= room:
        kind, prefix = "full", None
    elif module is not None and _sizes(pl_module, module) <= room:
        kind, prefix = "origin_module", module
        left_out.append(f"the state outside {module} ({full / _MB:.1f} MB in all, over budget_mb={budget_mb:g})")
    else:
        kind, prefix = "none", None
        left_out.append(f"the module's state ({full / _MB:.1f} MB, over budget_mb={budget_mb:g})")
    state = _state(pl_module, prefix) if kind != "none" else {}
    total = batch_bytes + op_bytes + nbytes(state)
    root = os.path.join(log_dir, BUNDLES_DIR)
    os.makedirs(root, exist_ok=True)
    free = shutil.disk_usage(root).free
    if total + DISK_RESERVE_MB * _MB > free:
        return BundleWritten(
            None,
            reason=f"{free / _MB:.0f} MB free: a {total / _MB:.1f} MB bundle would leave less than "
            f"{DISK_RESERVE_MB:g} MB",
        )
    step = int(getattr(trainer, "global_step", 0) or 0) if step is None else step
    epoch = int(getattr(trainer, "current_epoch", 0) or 0) if epoch is None else epoch
    rank = int(getattr(trainer, "global_rank", 0) or 0)
    world = int(getattr(trainer, "world_size", 1) or 1)
    name = name or (f"step-{step}" + (f"-rank-{rank}" if world > 1 else ""))
    kind_of = type(pl_module)
    scaler = _lightning_compat.get_scaler(trainer) if hasattr(trainer, "precision_plugin") else None
    hparams, skipped = _hparams(pl_module)
    manifest = {
        "format": FORMAT,
        "module": kind_of.__module__,
        "qualname": kind_of.__qualname__,
        "script": _script(kind_of),
        "hparams": hparams,
        "hparams_skipped": skipped,
        "precision": str(getattr(trainer, "precision", "32-true")),
        "scale": float(scaler.get_scale()) if scaler is not None else None,
        "optimizers": _optimizers(trainer, pl_module),
        "step": step,
        "epoch": epoch,
        "batch_idx": batch_idx,
        "device": str(pl_module.device),
        "origin": origin.to_dict() if origin is not None else None,
        "verdict": explain(origin).to_dict() if origin is not None else None,
        "diagnosis": diagnosis,
        "state": kind,
        "state_module": prefix,
        "batch_pickled": pickled_batch is not None,
        "op": call[0] if call is not None else None,
        "left_out": left_out,
        "versions": {"torch": torch.__version__, "lightning": _version("lightning")},
    }
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")  # renamed into place when complete
    try:
        os.mkdir(tmp)
        torch.save({"batch": stored_batch, "rng": capture_rng(), "state": state}, os.path.join(tmp, "step.pt"))
        if pickled_batch is not None:
            with open(os.path.join(tmp, "batch.pkl"), "wb") as raw:
                raw.write(pickled_batch)
        if call is not None:
            torch.save(encode(call), os.path.join(tmp, "op.pt"))
        manifest["files"] = {n: hash_file(os.path.join(tmp, n))[1] for n in sorted(os.listdir(tmp)) if n in DATA_FILES}
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        return BundleWritten(None, reason=f"writing {final} failed: {err}")
    written = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
    return BundleWritten(final, written, kind, "; ".join(left_out))

"""Reading an incident bundle (``forensics.bundle`` writes it) as data: nothing it names is imported or called.

``read_bundle`` checks every file and key a replay reads before anything uses them: ``manifest.json`` (JSON, each key
of its type; the sha256 it records of each data file, ``files``, matches before the file is loaded), ``step.pt`` and
``op.pt`` (``torch.load(weights_only=True)``, then ``bundle_codec.decode``: the plain types only), the random states
(the shape ``capture_rng`` gives), the origin op (an aten op's name). A missing, cut-short or crafted file is a
``BundleError`` saying which and why; so is a manifest ``module`` that is not a dotted module name (a path, a ``.py``
file), refused before anything is imported. ``batch.pkl`` (a batch of arbitrary objects) is read only with
``allow_pickle``: the one trust opt-in, as unpickling can run any code.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_nanguard._files import hash_file
from lightning_nanguard.exceptions import BundleError, brief
from lightning_nanguard.forensics.bundle_codec import Undecodable, check_rng, decode
from lightning_nanguard.policies.origin import Origin

__all__ = ["BUNDLES_DIR", "DATA_FILES", "DOTTED_NAME", "FORMAT", "QUALNAME", "Bundle", "read_bundle"]

BUNDLES_DIR = os.path.join("nanguard", "bundles")
FORMAT = 1
DATA_FILES = ("batch.pkl", "op.pt", "step.pt")  # the manifest's "files" records each one's sha256
_SHA256 = re.compile(r"[0-9a-f]{64}")
# What a manifest may name: a module by its dotted import name (never a path or a file: no "/", "\\", ".py" at the
# end, which a dotted name could spell), a class by its qualname.
DOTTED_NAME = re.compile(r"(?![\s\S]*\.pyw?c?$)[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
QUALNAME = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]*|<locals>)(?:\.(?:[A-Za-z_][A-Za-z0-9_]*|<locals>))*")
_ATEN_OP = re.compile(r"aten\.(?!__)[A-Za-z0-9_]+\.(?!__)[A-Za-z0-9_]+")


@dataclass(frozen=True)
class Bundle:
    """A bundle as read back."""

    path: str
    manifest: dict[str, Any]
    batch: Any
    rng: dict[str, Any]
    state: dict[str, Tensor]
    call: tuple[str, Any, Any] | None

    @property
    def origin(self) -> Origin | None:
        data = self.manifest.get("origin")
        return Origin.from_dict(data) if data else None


def read_bundle(path: str, *, allow_pickle: bool = False) -> Bundle:
    """Read a bundle directory (or its ``manifest.json``) as data: nothing it names is imported or called (only
    ``batch.pkl``, read when ``allow_pickle``, can run code). Raises ``BundleError`` saying what is wrong: a missing
    or damaged file, a missing or mistyped key, a value outside the plain types ``bundle_codec`` decodes."""
    directory = os.path.dirname(path) if os.path.basename(path) == "manifest.json" else path
    manifest_path = os.path.join(directory, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise BundleError(
            f"no bundle at {path}: expected a directory with manifest.json (under <log_dir>/{BUNDLES_DIR})"
        )
    manifest = _read_manifest(manifest_path)
    _check_digests(directory, manifest.get("files") or {})
    data = _load(directory, "step.pt")
    if not isinstance(data, dict):
        raise BundleError(f"damaged bundle {directory}: step.pt holds a {type(data).__qualname__}, not a dict")
    lacking = sorted({"batch", "rng", "state"} - set(data))
    if lacking:
        raise BundleError(f"damaged bundle {directory}: step.pt lacks {lacking}")
    state = data["state"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise BundleError(f"damaged bundle {directory}: step.pt's state is not a dict of named tensors")
    try:
        check_rng(data["rng"])
        batch = decode(data["batch"])
    except (Undecodable, RecursionError) as err:
        raise BundleError(f"damaged bundle {directory}: step.pt: {err}") from err
    if manifest.get("batch_pickled"):
        if not allow_pickle:
            raise BundleError(
                f"the batch of {directory} holds objects stored with pickle (batch.pkl), which can run any code: "
                "allow pickle (nanguard replay --allow-pickle) only if you trust this bundle and where it came from"
            )
        try:
            with open(os.path.join(directory, "batch.pkl"), "rb") as f:
                batch = pickle.load(f)  # the caller allowed it
        except Exception as err:
            raise BundleError(f"unreadable bundle {directory}: batch.pkl: {_first_line(err)}") from err
    call = None
    if os.path.isfile(os.path.join(directory, "op.pt")) or manifest.get("op"):
        call = _read_call(directory, _load(directory, "op.pt"))
    return Bundle(directory, manifest, batch, data["rng"], dict(state), call)


def _check_digests(directory: str, files: dict[str, Any]) -> None:
    """Each data file the manifest lists has the sha256 it records (a bundle written before the manifest listed them
    has no "files": its files are read as they are)."""
    for name, digest in files.items():
        if name not in DATA_FILES or not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise BundleError(
                f"damaged bundle {directory}: manifest.json's 'files' lists {brief(name)}: {brief(digest)}"
            )
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise BundleError(f"damaged bundle {directory}: {name} is missing")
        try:
            matches = hash_file(path)[1] == digest
        except OSError as err:
            raise BundleError(f"damaged bundle {directory}: {name} is unreadable ({_first_line(err)})") from err
        if not matches:
            raise BundleError(
                f"damaged bundle {directory}: {name} does not match its sha256 in manifest.json (changed or damaged "
                "after it was written)"
            )


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


def _load(directory: str, name: str) -> object:
    """A ``.pt`` of the bundle, weights only, or ``BundleError`` (missing, cut short, or holding a non-plain value)."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise BundleError(f"damaged bundle {directory}: {name} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a cut-short zip, a refused global, ...: the file is not what write_bundle wrote
        raise BundleError(f"damaged bundle {directory}: {name} is unreadable ({_first_line(err)})") from err


# The manifest's keys a replay reads, with their types (``None`` allowed where the second entry says so).
_REQUIRED: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "format": (int, False),
    "module": (str, False),
    "qualname": (str, False),
    "precision": (str, False),
    "step": (int, False),
    "batch_idx": (int, False),
    "state": (str, False),
}
_OPTIONAL: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "epoch": (int, False),
    "hparams": (dict, False),
    "hparams_skipped": (list, False),
    "scale": ((int, float), True),
    "origin": (dict, True),
    "diagnosis": (dict, True),
    "batch_pickled": (bool, False),
    "op": (str, True),
    "script": (str, True),
    "state_module": (str, True),
    "files": (dict, False),
}


def _read_manifest(path: str) -> dict[str, Any]:
    directory = os.path.dirname(path)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError) as err:
        raise BundleError(f"damaged bundle {directory}: manifest.json is unreadable ({_first_line(err)})") from err
    if not isinstance(manifest, dict):
        raise BundleError(f"damaged bundle {directory}: manifest.json is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise BundleError(f"bundle format {manifest.get('format')!r} in {directory}: this nanguard reads {FORMAT}")
    for key, (kind, nullable) in (_REQUIRED | _OPTIONAL).items():
        if key not in manifest:
            if key in _REQUIRED:
                raise BundleError(f"damaged bundle {directory}: manifest.json lacks {key!r}")
            continue
        value = manifest[key]
        if (value is None and not nullable) or (value is not None and not isinstance(value, kind)):
            raise BundleError(f"damaged bundle {directory}: manifest.json's {key!r} is {brief(value)}")
    if not DOTTED_NAME.fullmatch(manifest["module"]):
        raise BundleError(
            f"crafted or damaged bundle {directory}: manifest.json's 'module' is {brief(manifest['module'])}, not a "
            "dotted module name (a bundle names its class by import name, never by a file: nothing was imported). "
            "To replay with a class from a file, name it yourself: nanguard replay BUNDLE --module path/to/file.py:Class"
        )
    if not QUALNAME.fullmatch(manifest["qualname"]):
        raise BundleError(
            f"crafted or damaged bundle {directory}: manifest.json's 'qualname' is {brief(manifest['qualname'])}, not "
            "a qualified name (nothing was imported)"
        )
    if manifest["state"] not in ("full", "origin_module", "none"):
        raise BundleError(f"damaged bundle {directory}: manifest.json's state is {brief(manifest['state'])}")
    try:
        if manifest.get("origin"):
            Origin.from_dict(manifest["origin"])
    except Exception as err:
        raise BundleError(
            f"damaged bundle {directory}: manifest.json's origin is malformed ({_first_line(err)})"
        ) from err
    return manifest


def _read_call(directory: str, stored: object) -> tuple[str, Any, Any]:
    """op.pt: the origin op's name (an aten op: ``aten.<op>.<overload>``) and its decoded inputs."""
    try:
        call = decode(stored)
    except (Undecodable, RecursionError) as err:
        raise BundleError(f"damaged bundle {directory}: op.pt: {err}") from err
    if not (isinstance(call, list | tuple) and len(call) == 3 and isinstance(call[0], str)):
        raise BundleError(f"damaged bundle {directory}: op.pt is not (op, args, kwargs)")
    name, args, kwargs = call
    if not _ATEN_OP.fullmatch(name) or not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
        raise BundleError(f"damaged bundle {directory}: op.pt names {name[:80]!r}, not an aten op with its inputs")
    return name, args, kwargs

"""The quarantine's saved form: ``quarantine.json``, the seed file (``GradNormMonitor(quarantine_file=...)``) and the
callback state in a checkpoint share one format, read with validation.

The format::

    [12, 507]                                  a plain list: the same as {"samples": [12, 507]}
    {
      "samples": [12, 507],                    dataset sample indices (integers >= 0) quarantined in every training
                                               loader; with one training loader, that loader's
      "loaders": {"a": [3], "b": [21]},        a fit with several training loaders (``{"a": loader_a, ...}``):
                                               the indices of each loader, by its key ("*": every loader); when
                                               present it is the whole list, and "samples" is its union
      "fingerprints": ["0f3a9c21d4e5b6a7"],    batches without sample indices (iterable datasets, custom batch
                                               samplers): 16 hexadecimal digits each
      "replaced": 5,                           what a run did with them (written by a run, optional in a seed):
      "dropped_batches": 2,                    samples replaced by the sampler, quarantined batches whose update was
      "step": 40                               dropped, the global step of the last change
    }

A file that breaks the format is refused with ``NanGuardConfigError`` naming the file, the problem and the fix:
quarantining other samples than the file meant (``"123"`` read as 1, 2, 3; ``1.5`` as 1) would remove healthy
training data without anyone noticing.
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass, field
from typing import Any, NoReturn

from lightning_nanguard.exceptions import NanGuardConfigError, brief

__all__ = ["EVERY_LOADER", "QuarantineRecord", "dump", "parse", "read_file", "write_file"]

EVERY_LOADER = ""  # the key of samples quarantined in every training loader (in a one-loader fit: that loader)
_EVERY_LOADER_IN_FILE = "*"
_COUNTERS = ("replaced", "dropped_batches", "step")
_KNOWN = ("samples", "loaders", "fingerprints", *_COUNTERS)
_FORMAT = (
    'a JSON list of dataset sample indices ([12, 507]) or an object {"samples": [...], "loaders": {...}, '
    '"fingerprints": [...]} as a run writes to <log_dir>/nanguard/quarantine.json'
)


@dataclass
class QuarantineRecord:
    """What is quarantined, as plain values: sample indices per loader key (``EVERY_LOADER``: every loader),
    batch fingerprints, and the counters."""

    samples: dict[str, set[int]] = field(default_factory=dict)
    fingerprints: set[str] = field(default_factory=set)
    replaced: int = 0
    dropped_batches: int = 0
    step: int = 0


class _Malformed(ValueError):
    pass


def parse(data: object, *, strict: bool = True) -> QuarantineRecord:
    """Validate ``data`` (the decoded JSON or a checkpoint's state) into a record. Raises ``ValueError`` with the
    problem; ``strict=False`` ignores keys this version does not know (a checkpoint written by a newer one)."""
    if isinstance(data, list):
        data = {"samples": data}
    if not isinstance(data, dict):
        raise _Malformed(f"the top level is {_kind(data)}, not a list or an object")
    unknown = sorted(str(k) for k in data if k not in _KNOWN)
    if unknown and strict:
        raise _Malformed(f"unknown key(s) {unknown}; the keys are {list(_KNOWN)}")
    record = QuarantineRecord()
    loaders = data.get("loaders")
    if loaders is not None:
        if not isinstance(loaders, dict):
            raise _Malformed(f'"loaders" is {_kind(loaders)}, not an object of loader key -> list of indices')
        for key, indices in loaders.items():
            name = EVERY_LOADER if key == _EVERY_LOADER_IN_FILE else str(key)
            record.samples[name] = _indices(indices, f'"loaders" entry {key!r}')
        union = set().union(*record.samples.values()) if record.samples else set()
        listed = _indices(data.get("samples", []), '"samples"')
        if not listed <= union:
            raise _Malformed(
                f'"samples" lists {sorted(listed - union)[:5]}, in none of "loaders" (with "loaders", "samples" is '
                'their union; put indices for every loader under "*")'
            )
    elif "samples" in data:
        found = _indices(data["samples"], '"samples"')
        if found:
            record.samples[EVERY_LOADER] = found
    prints = data.get("fingerprints", [])
    if not isinstance(prints, list):
        raise _Malformed(f'"fingerprints" is {_kind(prints)}, not a list of strings')
    for value in prints:
        if not (isinstance(value, str) and len(value) == 16 and all(c in string.hexdigits for c in value)):
            raise _Malformed(f'"fingerprints" holds {brief(value)}, not a batch fingerprint (16 hexadecimal digits)')
        record.fingerprints.add(value.lower())
    for name in _COUNTERS:
        value = data.get(name, 0)
        if not _is_index(value):
            raise _Malformed(f'"{name}" is {brief(value)}, not an integer >= 0')
        setattr(record, name, int(value))
    return record


def read_file(path: str) -> QuarantineRecord:
    """The record a quarantine file holds. Raises ``NanGuardConfigError`` naming the file, the problem and the fix."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise _config_error(path, f"it cannot be read ({err})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, _Malformed, RecursionError) as err:
        raise _config_error(path, f"it is not valid JSON ({str(err)[:200]})") from None
    try:
        return parse(data)
    except _Malformed as err:
        raise _config_error(path, str(err)) from None


def dump(record: QuarantineRecord) -> dict[str, Any]:
    """The record as plain values (the file's content and the checkpoint state)."""
    out: dict[str, Any] = {"samples": sorted(set().union(*record.samples.values())) if record.samples else []}
    if any(key != EVERY_LOADER for key in record.samples):
        out["loaders"] = {
            (_EVERY_LOADER_IN_FILE if key == EVERY_LOADER else key): sorted(indices)
            for key, indices in sorted(record.samples.items())
            if indices
        }
    out["fingerprints"] = sorted(record.fingerprints)
    out.update(replaced=record.replaced, dropped_batches=record.dropped_batches, step=record.step)
    return out


def write_file(path: str, record: QuarantineRecord) -> None:
    """Write the record atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(dump(record), f, indent=1)
    os.replace(tmp, path)


def _indices(value: object, where: str) -> set[int]:
    if not isinstance(value, list):
        raise _Malformed(f"{where} is {_kind(value)}, not a list of sample indices")
    bad = [v for v in value if not _is_index(v)]
    if bad:
        raise _Malformed(f"{where} holds {brief(bad[:3])}, not sample indices (integers >= 0)")
    return {int(v) for v in value}


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value: object) -> str:
    return "null" if value is None else f"{type(value).__name__} {repr(value)[:40]}"


def _no_constant(name: str) -> NoReturn:
    raise _Malformed(f"{name} is not a number JSON allows")


def _config_error(path: str, problem: str) -> NanGuardConfigError:
    return NanGuardConfigError(
        f"GradNormMonitor(quarantine_file={path!r}): {problem}. A quarantine file is {_FORMAT}. Fix the file, or "
        "pass quarantine_file=None to start with nothing quarantined."
    )

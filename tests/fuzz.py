"""Damaged contents for the readers' fuzz tests: whatever a file holds, its reader gives a verdict, never a traceback.

A file nanguard reads can hold anything after a crash, a bad disk or a careless edit. ``damaged_bytes`` derives, from
a valid file, what those leave (nothing, a prefix, flipped bits, noise, another encoding, garbage appended);
``DEEP_JSON`` is nesting made to exhaust a recursive reader; ``wrong_types`` puts every JSON type in each key of a
valid object; ``json_values`` and ``st.binary()`` let hypothesis look further. ``verdict`` runs a reader and lets
through only what it returns or the errors that are its documented verdict (with a message).
"""

from __future__ import annotations

import io
import random
import struct
import zipfile
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

__all__ = [
    "DEEP_JSON",
    "FUZZ",
    "damaged_bytes",
    "deep_checkpoint",
    "deep_list",
    "json_values",
    "verdict",
    "wrong_types",
]

# A few dozen examples each, no deadline (a reader may load torch), the same examples every run.
FUZZ = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

DEEP_JSON = {
    "deep list": "[" * 100_000 + "]" * 100_000,
    "deep object": '{"a":' * 100_000 + "1" + "}" * 100_000,
    "deep and cut": "[" * 100_000,
}

# One value of each JSON type (and the ones a careless edit makes): what ``wrong_types`` puts in a key.
_JSON_KINDS: dict[str, Any] = {
    "null": None,
    "bool": True,
    "negative int": -1,
    "huge int": 2**80,
    "float": 1.5,
    "string": "x",
    "empty string": "",
    "list": [1, "a", None],
    "empty list": [],
    "object": {"a": [1]},
    "nested": [[[[{"a": [[]]}]]]],
}


def damaged_bytes(valid: bytes, seed: int = 0) -> dict[str, bytes]:
    """What a crash, a bad disk or an edit leaves of ``valid``, by name (deterministic)."""
    rng = random.Random(seed)
    flipped = bytearray(valid)
    for i in rng.sample(range(len(valid)), min(8, len(valid))):
        flipped[i] ^= 0xFF
    out = {
        "empty": b"",
        "one byte": valid[:1],
        "first half": valid[: len(valid) // 2],
        "all but the last byte": valid[:-1],
        "flipped bits": bytes(flipped),
        "noise": bytes(rng.getrandbits(8) for _ in range(max(64, min(len(valid), 4096)))),
        "nul bytes": b"\0" * 256,
        "invalid utf-8": b"\xff\xfe\xfa" + valid[:200],
        "garbage appended": valid + b"\x00garbage\xff",
        **{name: text.encode() for name, text in DEEP_JSON.items()},
    }
    try:
        out["utf-16"] = valid.decode("utf-8").encode("utf-16")
    except UnicodeDecodeError:
        pass
    return out


def wrong_types(valid: Any) -> dict[str, Any]:
    """``valid`` (a JSON object) with each key in turn set to each JSON type, with each key removed, and replaced
    whole by each type, by name."""
    out: dict[str, Any] = {f"whole: {kind}": value for kind, value in _JSON_KINDS.items()}
    if isinstance(valid, dict):
        for key in valid:
            out[f"{key}: missing"] = {k: v for k, v in valid.items() if k != key}
            for kind, value in _JSON_KINDS.items():
                if value != valid[key]:
                    out[f"{key}: {kind}"] = {**valid, key: value}
    return out


def deep_list(depth: int = 100_000) -> list[Any]:
    """A list nested ``depth`` deep, built without recursion (a state made to exhaust a recursive reader)."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def deep_checkpoint(depth: int = 100_000, key: str | None = None) -> bytes:
    """A torch zip file whose pickle nests lists ``depth`` deep (``{key: ...}`` when given): ``torch.save`` cannot
    write one (it recurses), but the pickle opcodes build it without recursion, and ``torch.load(weights_only=True)``
    reads it back: what a crafted file can hand a recursive reader."""
    nested = b"]" * depth + b"a" * (depth - 1)
    if key is not None:
        name = key.encode()
        nested = b"}X" + struct.pack("<I", len(name)) + name + nested + b"s"
    pickled = b"\x80\x02" + nested + b"."
    template = io.BytesIO()
    torch.save([], template)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(template.getvalue())) as source, zipfile.ZipFile(out, "w") as target:
        for name_in in source.namelist():
            target.writestr(name_in, pickled if name_in.endswith("data.pkl") else source.read(name_in))
    return out.getvalue()


def json_values() -> st.SearchStrategy[Any]:
    """Any JSON value, nested a few levels."""
    leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
    return st.recursive(
        leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4)
    )


def verdict(read: Callable[[], Any], *errors: type[BaseException]) -> Any:
    """``read()``'s value, or the message of the error it raised when that is one of ``errors`` (its documented
    verdict, which must say something). Any other exception fails the test."""
    try:
        return read()
    except errors as err:
        said = str(err).strip()
    assert said, "an error without a message"
    return said

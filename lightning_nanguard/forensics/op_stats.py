"""What explains one op's non-finite output (the statistics of ``policies.origin``), and the user's line that ran it.

Called only for the few ops the origin tracer finds making a non-finite value from finite inputs, so a host read
here and there is fine.
"""

from __future__ import annotations

import linecache
import math
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import torch
from torch import Tensor

from lightning_nanguard.policies.origin import SourceFrame, Stat

__all__ = ["frame_from_stack", "frame_from_traceback", "module_from_stack", "op_stats", "rows_of"]


def _library_dirs() -> tuple[str, ...]:
    import importlib.util

    import lightning

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lightning_nanguard/
    dirs = [os.path.dirname(m.__file__ or "") for m in (torch, lightning)] + [package]
    # Located, never imported: importing the standalone lightning_fabric re-points Lightning's rank-zero logger.
    fabric = importlib.util.find_spec("lightning_fabric")
    dirs += list(fabric.submodule_search_locations or []) if fabric is not None else []
    dirs += [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


_LIBRARY_DIRS = _library_dirs()
# The demo's tasks stand for a user's project: their models and data are the lines an incident of ``nanguard demo``
# should name (installed or not), not the console script that started the demo.
_DEMO_DIR = os.path.join(os.path.realpath(os.path.join(os.path.dirname(os.path.dirname(__file__)), "demo")), "")


def _is_user_file(path: str) -> bool:
    if path.startswith("<"):
        return False
    real = os.path.realpath(path)
    if real.startswith(_DEMO_DIR):
        return True
    if "site-packages" in path or "dist-packages" in path:
        return False
    return not real.startswith(_LIBRARY_DIRS)


def frame_from_stack() -> SourceFrame | None:
    """The innermost frame of the running stack that is the user's code (outside torch, Lightning, this package but
    its demo's tasks, the standard library and site-packages)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if _is_user_file(path):
            code = linecache.getline(path, f.f_lineno).strip()
            return SourceFrame(path, f.f_lineno, f.f_code.co_name, code)
        f = f.f_back
    return None


def module_from_stack(names: dict[int, str]) -> str | None:
    """The name of the innermost module (one of ``names``) whose method is on the stack."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        owner = f.f_locals.get("self") if "self" in f.f_code.co_varnames else None
        if owner is not None and id(owner) in names:
            return names[id(owner)]
        f = f.f_back
    return None


_ENTRY = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)\n(?:\s*(?P<code>[^\n]*))?')


def frame_from_traceback(entries: Iterable[str]) -> SourceFrame | None:
    """The innermost user frame of a formatted stack (``traceback.format_stack`` entries, outermost first)."""
    for entry in reversed(list(entries)):
        m = _ENTRY.match(entry)
        if m and _is_user_file(m["file"]):
            return SourceFrame(m["file"], int(m["line"]), m["func"].strip(), (m["code"] or "").strip())
    return None


def rows_of(mask: Tensor, batch_size: int | None) -> tuple[int, ...]:
    """The leading-dim indices where ``mask`` holds, when that dim is the batch's (else none). Every one: the
    quarantine of a formula bug's triggering records reads them."""
    if batch_size is None or mask.dim() == 0 or mask.shape[0] != batch_size:
        return ()
    hit = mask.reshape(mask.shape[0], -1).any(dim=1)
    return tuple(int(i) for i in hit.nonzero().flatten().tolist())


def _num(x: Tensor) -> float:
    return float(x)


def _name(producer: Callable[[Tensor], tuple[str, list[Any]] | None], t: Tensor) -> str:
    made = producer(t)
    return made[0] if made else ""


_HALF = (torch.float16, torch.bfloat16)
_ROUNDING_PRODUCERS = ("aten.sigmoid", "aten.exp", "aten._softmax", "aten.softmax")


def _log_stats(
    x: Tensor, producer: Callable[[Tensor], tuple[str, list[Any]] | None], batch_size: int | None
) -> tuple[dict[str, Stat], tuple[int, ...]]:
    xf = x.detach().float()
    stats: dict[str, Stat] = {
        "input_min": _num(xf.min()) if xf.numel() else 0.0,
        "input_zeros": int((xf == 0).sum()),
        "input_negatives": int((xf < 0).sum()),
    }
    made = producer(x)
    if made is not None:
        name, operands = made
        if name.startswith(("aten.rsub", "aten.sub")):
            # 1 - p: the p that rounded to 1.0
            p = next((t for t in operands if isinstance(t, Tensor) and t.is_floating_point()), None)
            if p is not None:
                stats["operand_ones"] = int((p.detach() == 1).sum())
                stats["operand_dtype"] = str(p.dtype)
                stats["operand_producer"] = _name(producer, p)
        elif name.startswith(_ROUNDING_PRODUCERS) and x.dtype in _HALF and stats["input_zeros"]:
            stats["underflow_zeros"] = stats["input_zeros"]
            stats["operand_producer"] = name
    return stats, rows_of(xf <= 0, batch_size)


def op_stats(
    op: str,
    args: tuple[Any, ...],
    out: Tensor,
    producer: Callable[[Tensor], tuple[str, list[Any]] | None],
    batch_size: int | None,
) -> tuple[dict[str, Stat], tuple[int, ...]]:
    """The statistics that explain ``op``'s non-finite ``out`` from its finite inputs, and the batch rows involved."""
    tensors = [a for a in args if isinstance(a, Tensor) and a.is_floating_point()]
    first = tensors[0] if tensors else None
    if op.startswith(("aten.div", "aten.true_divide", "aten.reciprocal")) and first is not None:
        den = first if op.startswith("aten.reciprocal") else args[1] if len(args) > 1 else None
        if isinstance(den, Tensor):
            zero = den.detach() == 0
            stats: dict[str, Stat] = {"denominator_zeros": int(zero.sum())}
            if den is not first:
                stats["numerator_zeros"] = int((zero & (first.detach() == 0)).sum())
            stats["denominator_producer"] = _name(producer, den)
            return stats, rows_of(zero.expand_as(out) if zero.dim() else zero, batch_size)
    if op.startswith(("aten.log", "aten.xlogy", "aten.special_xlogy")) and first is not None:
        x = args[1] if op.startswith(("aten.xlogy", "aten.special_xlogy")) and isinstance(args[1], Tensor) else first
        return _log_stats(x, producer, batch_size)
    if op.startswith(("aten.sqrt", "aten.rsqrt")) and first is not None:
        xf = first.detach().float()
        return {
            "input_min": _num(xf.min()),
            "input_zeros": int((xf == 0).sum()),
            "input_negatives": int((xf < 0).sum()),
        }, rows_of(xf <= 0, batch_size)
    if op.startswith(("aten._softmax", "aten._log_softmax", "aten._safe_softmax")) and first is not None:
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
        full = (first.detach() == -math.inf).all(dim=dim)
        return {"rows_all_neg_inf": int(full.sum())}, rows_of(full, batch_size)
    if op.startswith(("aten.exp", "aten.exp2", "aten.expm1")) and first is not None:
        limit = math.log(torch.finfo(first.dtype).max)
        big = first.detach().float()
        return {"max_arg": _num(big.max()), "log_max": round(limit, 3)}, rows_of(big > limit, batch_size)
    finite = [t.detach().float().abs().amax() for t in tensors if t.numel()]
    stats = {"dtype_max": float(torch.finfo(out.dtype).max)}
    if finite:
        stats["max_abs_input"] = _num(torch.stack(finite).amax())
    den = args[0] if op.startswith("aten.pow.Scalar") else first
    if op.startswith("aten.pow") and isinstance(den, Tensor):
        stats["denominator_zeros"] = int((den.detach() == 0).sum())
    return stats, rows_of(~torch.isfinite(out.detach()), batch_size)

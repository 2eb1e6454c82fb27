"""The fences hold: private Lightning/torch touches only in the ``_lightning_compat`` package, collectives only in
``_distributed.py``.

An AST walk over every module of the package finds

* **private touches**: an attribute that starts with one underscore read or written on anything but ``self``/``cls``
  (``trainer._checkpoint_connector``, ``torch._foreach_norm``, ``scaler._scale``), the same through ``getattr``/
  ``setattr``/``hasattr``/``delattr`` with a literal name or as a string key (``state["_batches_that_stepped"]``),
  any ``x.__dict__`` of an object other than ``self``, ``vars()`` of a Trainer, strategy, module, ..., and an import
  of a private torch/Lightning module or name (``torch.utils._pytree``). Underscore names the package itself gives
  its own objects' attributes (``self._engine``, read as ``callback._engine`` elsewhere) and the ``_nanguard_*``
  markers it sets are not private touches, unless read off an object that is plainly Lightning's or torch's
  (``trainer``, ``strategy``, ``torch``, ...), nor are private names of other modules (``argparse``);
* **collectives**: ``torch.distributed`` used or imported (a type import such as ``DTensor`` communicates nothing:
  the ones that stay are in ``ALLOWED``), and a call of a collective by name on anything but the ``_distributed``
  module (``all_reduce``, ``all_gather*``, ``broadcast*``, ``barrier``, ``reduce_boolean_decision``,
  ``strategy.reduce``, ...).

Each hit outside its fence module must be in ``ALLOWED`` with its reason, and each entry of ``ALLOWED`` must still
be hit (a stale entry fails too, so the list stays the truth).
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lightning_nanguard"
COMPAT = "lightning_nanguard/_lightning_compat/"
DISTRIBUTED = "lightning_nanguard/_distributed.py"

# Receivers that are plainly Lightning's or torch's: a private name read off them is a private touch even when the
# package happens to use the same name for an attribute of its own.
FOREIGN = {"torch", "pl", "lightning", "trainer", "strategy", "scaler", "optimizer", "loop", "plugin", "pl_module"}
# Underscore names that are public API (namedtuple's).
PUBLIC_UNDERSCORE = {"_fields", "_asdict", "_replace", "_make"}
# Called by this name, a collective whatever the receiver (except the ``_distributed`` module).
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce_boolean_decision",
    "gather_object",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
}
# A collective by this name only on a strategy or ``torch.distributed`` (``functools.reduce`` is not one).
STRATEGY_COLLECTIVES = {"reduce", "gather", "scatter"}


@dataclass(frozen=True)
class Hit:
    path: str  # relative to the repository root
    kind: str  # "private" | "collective"
    code: str  # the expression or statement, as ``ast.unparse`` writes it
    line: int


# (path, code) -> why it stays where it is.
ALLOWED: dict[tuple[str, str], str] = {
    # ---- types from torch.distributed: no communication
    ("lightning_nanguard/signals/fsdp1.py", "from torch.distributed.fsdp import FullyShardedDataParallel"): (
        "a type import (isinstance), not a collective"
    ),
    ("lightning_nanguard/signals/sharded.py", "from torch.distributed.tensor import DTensor"): (
        "a type import (for the type checker, and DTensor.from_local on a tensor already sharded), not a collective"
    ),
}


def _root(node: ast.expr) -> str:
    """The name an attribute chain starts from (``trainer`` for ``trainer.strategy.x``); ``""`` for anything else,
    ``"self"`` for ``super()``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id == "super":
            return "self"
        return _root(node.func)
    return node.id if isinstance(node, ast.Name) else ""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORE


def _own_attributes(trees: dict[str, ast.Module]) -> set[str]:
    """Underscore names the package gives its own objects: ``self._x = ...``, class-body names, ``_nanguard_*``."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _root(node) in ("self", "cls") and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        own.add(item.name)
                    targets = item.targets if isinstance(item, ast.Assign) else []
                    if isinstance(item, ast.AnnAssign):
                        targets = [item.target]
                    own.update(t.id for t in targets if isinstance(t, ast.Name))
    return {name for name in own if _private(name)}


def _private_touch(name: str, receiver: ast.expr, own: set[str], other_modules: set[str]) -> bool:
    root = _root(receiver)
    if not _private(name) or root in ("self", "cls") or root in other_modules:
        return False
    ours = name in own or name.startswith("_nanguard_")
    return not ours or root in FOREIGN


def _other_modules(tree: ast.Module) -> set[str]:
    """Names a module binds to imported modules other than torch's, Lightning's and DeepSpeed's (``argparse``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in ("torch", "lightning", "deepspeed"):
                    names.add(alias.asname or alias.name.split(".")[0])
    return names


def _is_dict_of(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "__dict__"


def _is_torch_distributed(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "distributed"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )


def _private_touches(node: ast.AST, own: set[str], others: set[str]) -> Iterator[str]:
    """The private touches ``node`` makes, as code."""
    if isinstance(node, ast.Attribute):
        dict_of_other = node.attr == "__dict__" and _root(node.value) not in ("self", "cls")
        if dict_of_other or _private_touch(node.attr, node.value, own, others):
            yield ast.unparse(node)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name, args = node.func.id, node.args
        literal = args[1].value if len(args) >= 2 and isinstance(args[1], ast.Constant) else None
        if name in ("getattr", "setattr", "hasattr", "delattr") and isinstance(literal, str):
            yield from [ast.unparse(node)] if _private_touch(literal, args[0], own, others) else []
        elif name == "vars" and args and _root(args[0]) in FOREIGN:
            yield ast.unparse(node)
    # A string key: ``x["_name"]`` or ``x.get("_name")`` (on ``x.__dict__`` already reported as such).
    mapping, key = None, None
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        mapping, key = node.value, node.slice.value
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        first = node.args[0] if node.args else None
        mapping, key = node.func.value, first.value if isinstance(first, ast.Constant) else None
    if mapping is not None and isinstance(key, str) and not _is_dict_of(mapping):
        yield from [ast.unparse(node)] if _private_touch(key, mapping, own, others) else []
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
        for module in _imported_modules(node):
            if any(_private(p) for p in module.split(".")) or any(_private(n) for n in names):
                yield ast.unparse(node)


def _collectives(node: ast.AST) -> Iterator[str]:
    """The collectives (or ``torch.distributed`` uses) ``node`` makes, as code."""
    imports = _imported_modules(node) if isinstance(node, (ast.Import, ast.ImportFrom)) else []
    if any(module.split(".")[:2] == ["torch", "distributed"] for module in imports):
        yield ast.unparse(node)  # a type import too: one that stays is in ALLOWED with its reason
    if isinstance(node, ast.Attribute) and _is_torch_distributed(node):
        yield ast.unparse(node)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _root(node.func.value) != "_distributed":
        attr, receiver = node.func.attr, ast.unparse(node.func.value)
        strategy_like = receiver.endswith("strategy") or receiver in ("dist", "torch.distributed")
        if attr in COLLECTIVES or (attr in STRATEGY_COLLECTIVES and strategy_like):
            yield ast.unparse(node.func)


def _imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The torch/Lightning/DeepSpeed modules an import statement reads."""
    modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return [m for m in modules if m.split(".")[0] in ("torch", "lightning", "deepspeed")]


def _hits(path: str, tree: ast.Module, own: set[str]) -> Iterator[Hit]:
    others = _other_modules(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        yield from (Hit(path, "private", code, line) for code in _private_touches(node, own, others))
        yield from (Hit(path, "collective", code, line) for code in _collectives(node))


def _scan() -> list[Hit]:
    root = PACKAGE.parent
    trees = {p.relative_to(root).as_posix(): ast.parse(p.read_text(encoding="utf-8")) for p in PACKAGE.rglob("*.py")}
    own = _own_attributes(trees)
    hits = []
    for path, tree in sorted(trees.items()):
        for hit in _hits(path, tree, own):
            in_compat = path.startswith(COMPAT)
            fenced = (hit.kind == "private" and in_compat) or (
                hit.kind == "collective" and (in_compat or path == DISTRIBUTED)
            )
            if not fenced:
                hits.append(hit)
    return hits


def test_private_touches_and_collectives_stay_behind_their_fences() -> None:
    leaks = sorted({f"{h.path}:{h.line}: {h.kind}: {h.code}" for h in _scan() if (h.path, h.code) not in ALLOWED})
    assert not leaks, (
        "private Lightning/torch touches belong in _lightning_compat/, collectives in _distributed.py "
        "(or an entry in ALLOWED with its reason):\n" + "\n".join(leaks)
    )


def test_every_allowed_entry_is_still_needed() -> None:
    seen = {(h.path, h.code) for h in _scan()}
    stale = sorted(f"{path}: {code}" for path, code in ALLOWED if (path, code) not in seen)
    assert not stale, "ALLOWED lists touches that are gone; remove them:\n" + "\n".join(stale)


def test_the_walk_finds_each_kind_of_leak() -> None:
    source = """
import argparse
import torch.distributed as dist
from torch.utils._pytree import tree_map
from torch.distributed.tensor import DTensor

def f(trainer, module, scaler, strategy, checkpoint):
    trainer._checkpoint_connector.restore("x")
    torch._foreach_norm([])
    getattr(scaler, "_scale", None)
    module.__dict__["x"] = 1
    vars(strategy)
    vars(result)
    argparse._SubParsersAction
    checkpoint["loops"]["_batches_that_stepped"]
    strategy.reduce(1)
    trainer.strategy.broadcast(1)
    trainer.strategy.barrier()
    _distributed.barrier(trainer)
    self._engine = None
    torch.distributed.is_initialized()
"""
    found = {(h.kind, h.code) for h in _hits("x.py", ast.parse(source), own={"_engine"})}
    assert found == {
        ("collective", "import torch.distributed as dist"),
        ("private", "from torch.utils._pytree import tree_map"),
        ("collective", "from torch.distributed.tensor import DTensor"),
        ("private", "trainer._checkpoint_connector"),
        ("private", "torch._foreach_norm"),
        ("private", "getattr(scaler, '_scale', None)"),
        ("private", "module.__dict__"),
        ("private", "vars(strategy)"),
        ("private", "checkpoint['loops']['_batches_that_stepped']"),
        ("collective", "strategy.reduce"),
        ("collective", "trainer.strategy.broadcast"),
        ("collective", "trainer.strategy.barrier"),
        ("collective", "torch.distributed"),
    }


INCIDENT_PATH = "lightning_nanguard/engine/incidents.py"


def _record_calls(tree: ast.Module) -> Iterator[int]:
    """Lines that call ``.record(...)`` on a sink (``sink.record``, ``self.sink.record``, ``engine.sink.record``)."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "record"
            and "sink" in ast.unparse(node.func.value).lower()
        ):
            yield node.lineno


def test_every_record_goes_through_the_incident_path() -> None:
    # One record path (ARCHITECTURE.md, "One incident path"): only IncidentPath writes to the sink; whatever saw a
    # problem outside a training step reports it there (``IncidentPath.report``), with a typed trigger.
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = "lightning_nanguard/" + path.relative_to(PACKAGE).as_posix()
        if rel == INCIDENT_PATH:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        found += [f"{rel}:{line}" for line in _record_calls(tree)]
    assert found == []
    incident_path = ast.parse((PACKAGE / "engine" / "incidents.py").read_text(encoding="utf-8"))
    assert len(list(_record_calls(incident_path))) == 2  # handle's (_record) and report's: the walk sees them


def test_every_trigger_is_typed() -> None:
    # A trigger is a Signal (a training step's event) or a Notice (seen elsewhere): no string literal.
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "trigger":
                literals = [n for n in ast.walk(node.value) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                found += [f"{path.relative_to(PACKAGE)}:{n.lineno}" for n in literals]
    assert found == []


MAX_BARE_ANY = 150
MAX_TYPE_IGNORES = 40


def _annotations(tree: ast.Module) -> Iterator[ast.expr]:
    """Every annotation: of a parameter (``*args`` and ``**kwargs`` too), a return, an annotated assignment."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None and arg.annotation is not None:
                    yield arg.annotation
            if node.returns is not None:
                yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def test_bare_any_and_type_ignores_stay_few() -> None:
    # Counted as the issue counted them: an annotation that is ``Any`` itself (not ``dict[str, Any]``), and every
    # ``type: ignore`` comment; the package is checked with ``mypy --strict``.
    bare, ignores = 0, 0
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        ignores += text.count("type: ignore")
        bare += sum(1 for a in _annotations(ast.parse(text)) if isinstance(a, ast.Name) and a.id == "Any")
    assert bare <= MAX_BARE_ANY, f"{bare} bare Any annotations (at most {MAX_BARE_ANY}): type what is known"
    assert ignores <= MAX_TYPE_IGNORES, f"{ignores} type: ignore comments (at most {MAX_TYPE_IGNORES})"

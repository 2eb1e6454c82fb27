"""Imports only go down the layers, and no import runs in a circle (ARCHITECTURE.md, "Layers").

Every ``import`` of a package module counts, wherever it is written: at the top, inside a function, or under
``TYPE_CHECKING``. A module may import from its own layer or any layer below it; the import graph has no cycle except
the demo task registry's (``demo.registry`` loads ``demo.tasks``, whose tasks register themselves with it).
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Mapping

import lightning_nanguard

PACKAGE = "lightning_nanguard"
ROOT = os.path.dirname(lightning_nanguard.__file__)

# Bottom first. A module belongs to the layer of its top-level name ("engine.step" -> "engine"); "" is the package's
# own __init__ (the public API).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("contract", "exceptions", "_validation", "_files", "_notices"),  # the shared vocabulary; files; notices
    ("_distributed",),  # every collective
    ("_lightning_compat", "precision"),  # every reach into Lightning's and torch's internals; the precision, typed
    ("signals",),  # pure tensor reductions and evidence readers
    ("policies", "config"),  # pure decisions: facts in, verdicts out; each callback's arguments, declared once
    (
        "checkpointing",
        "checkpoints",
    ),  # checkpoint integrity: write, verify, fall back, shard manifest (and its former home)
    ("recovery", "forensics"),  # the mechanisms that act; the replay that investigates
    ("reporting",),  # keys, sentences, records, summary
    ("engine",),  # the per-Trainer engine
    ("parts",),  # the features' parts: driven by the engine's stages, configured by their callbacks
    ("callbacks",),  # the thin Lightning adapters
    ("preset", "testing"),
    ("",),
    ("demo",),
    ("commands",),
    ("cli",),
)


def _allowed(cycle: set[str]) -> bool:
    """The demo task registry and the tasks that register with it."""
    return all(m == "demo.registry" or m == "demo.tasks" or m.startswith("demo.tasks.") for m in cycle)


def _modules() -> dict[str, str]:
    """Module name (relative to the package, "" for its __init__) -> file."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                out["" if rel == "__init__" else rel.removesuffix(".__init__")] = path
    return out


def _resolve(name: str, modules: Iterable[str]) -> str | None:
    """The package module an absolute import name refers to (its longest known prefix), or None if none."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    parts = name.split(".")[1:]
    known = set(modules)
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        targets: set[str] = set()
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]  # a name, or a submodule
            for name in names:
                target = _resolve(name, modules)
                if target is not None and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise KeyError(module)


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    return [
        f"{m or PACKAGE} ({LAYERS[layer_of(m)]}) imports {t or PACKAGE} ({LAYERS[layer_of(t)]})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if layer_of(t) > layer_of(m)
    ]


def cycles(graph: Mapping[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    missing = []
    for module in import_graph():
        try:
            layer_of(module)
        except KeyError:
            missing.append(module)
    assert not missing, f"modules in no layer of LAYERS (tests/test_layers.py, ARCHITECTURE.md): {missing}"


def test_imports_only_go_down() -> None:
    assert upward_imports(import_graph()) == []


def test_no_import_cycle_but_the_demo_registry() -> None:
    found = [sorted(c) for c in cycles(import_graph()) if not _allowed(c)]
    assert found == []


def test_the_checks_see_an_upward_import_and_a_cycle() -> None:
    graph = {"signals.a": {"engine.b"}, "engine.b": {"engine.c"}, "engine.c": {"engine.b"}}
    assert upward_imports(graph) == [f"signals.a ({LAYERS[3]}) imports engine.b ({LAYERS[8]})"]
    assert cycles(graph) == [{"engine.b", "engine.c"}]


def test_one_way_to_take_part_in_a_step() -> None:
    # Every nanguard callback is a NanGuardCallback, and none overrides a Lightning per-batch hook: the driver's are
    # the engine's own methods, and a feature's per-step work is its part's (engine/parts.py, ARCHITECTURE.md "Parts").
    from lightning.pytorch.callbacks import Callback

    from lightning_nanguard.callbacks._base import _PER_BATCH_HOOKS, NanGuardCallback
    from lightning_nanguard.preset import CALLBACKS

    assert [cls.__name__ for cls in CALLBACKS if not issubclass(cls, NanGuardCallback)] == []
    overriding = [
        f"{cls.__name__}.{name}"
        for cls in (NanGuardCallback, *CALLBACKS)
        for name in _PER_BATCH_HOOKS
        if getattr(cls, name) is not getattr(Callback, name)
    ]
    assert overriding == []


def test_callbacks_are_thin() -> None:
    # A callback configures its part and adapts Lightning: at most 250 lines a file (ARCHITECTURE.md, "Add a callback").
    folder = os.path.join(ROOT, "callbacks")
    long = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                lines = len(f.readlines())
            if lines > 250:
                long[name] = lines
    assert long == {}


def test_the_engine_holds_only_what_it_runs() -> None:
    # engine/ is the step's orchestration: every module there is one the engine itself imports (from the package's
    # __init__, get_engine, down); a feature's machinery the engine never calls is a part (parts/).
    graph = import_graph()
    seen: set[str] = set()
    todo = ["engine"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += [t for t in graph.get(module, ()) if t.split(".")[0] == "engine"]
    assert sorted(m for m in graph if m.split(".")[0] == "engine" and m not in seen) == []

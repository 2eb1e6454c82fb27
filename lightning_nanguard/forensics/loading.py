"""The only code a replay imports: the LightningModule class a bundle names, or the class or factory the user names.

A bundle's names are data. The class its manifest names (``module_class``) is imported by its dotted name from the
environment, with the current directory on ``sys.path`` for the import as ``python -m`` puts it (the user's project
root, where they stand; ``sys.path`` is put back afterwards), and no module found inside the bundle's own directory
is ever loaded (``_NothingFrom``: a bundle cannot ship the code it names, whatever the current directory or
``PYTHONPATH``). A file path (``path/to/file.py:Class``) is accepted only
from the user (``nanguard replay --module`` / ``--factory``, ``load_object``), who may also name a module of the
current directory. ``bundle_read`` refuses a manifest whose ``module`` is not a dotted name before anything runs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import lightning.pytorch as pl

from lightning_nanguard.exceptions import BundleError, brief
from lightning_nanguard.forensics.bundle_read import DOTTED_NAME, QUALNAME

__all__ = ["load_object", "module_class"]


_HOW = (
    "install the project (pip install -e .), or run nanguard replay from the directory that holds the package (its "
    "root), or name the class yourself with --module pkg.mod:Class or --module path/to/file.py:Class"
)


def module_class(
    manifest: dict[str, Any], announce: Callable[[str], None], bundle_dir: str | None = None
) -> type[pl.LightningModule]:
    """The LightningModule class the manifest names, imported by its dotted name from the environment and the current
    directory: ``announce`` is told which before anything is imported, nothing under ``bundle_dir`` is loaded, and
    anything but a ``LightningModule`` subclass is refused before it is called."""
    module, qualname = manifest["module"], manifest["qualname"]
    if module == "__main__" or "<locals>" in qualname:
        script = manifest.get("script")
        where = f"the script {script}" if script else "a script's __main__ (or a notebook), or inside a function"
        how = (
            f"--module {script}:{qualname}"
            if script and "<locals>" not in qualname
            else "--module path/to/script.py:Class or --factory pkg.mod:make_model"
        )
        raise BundleError(
            f"{qualname} was defined in {where}: it cannot be imported by name. Name it yourself: nanguard replay "
            f'BUNDLE {how} (a file is loaded without running its `if __name__ == "__main__":` block), or from '
            "Python: lightning_nanguard.replay_bundle(bundle, model=your_module)"
        )
    if not (isinstance(module, str) and DOTTED_NAME.fullmatch(module)):
        raise BundleError(f"the bundle's module {brief(module)} is not a dotted module name: nothing imported")
    if not (isinstance(qualname, str) and QUALNAME.fullmatch(qualname)):
        raise BundleError(f"the bundle's qualname {brief(qualname)} is not a qualified name: nothing imported")
    announce(
        f"the bundle names the LightningModule {module}:{qualname}: importing it from the environment "
        "(this runs that module's code; choose another with --module pkg.mod:Class or --factory pkg.mod:fn)"
    )
    try:
        with _nothing_from(bundle_dir), _current_directory_on_path():
            found: Any = _attribute(importlib.import_module(module), qualname)
    except (ImportError, AttributeError) as err:
        raise BundleError(f"cannot import {module}:{qualname} ({err}): {_HOW}") from err
    return _checked(found, f"{module}:{qualname}", want_class=True)


def load_object(spec: str, *, want_class: bool) -> Any:
    """What the user names (``--module`` / ``--factory``): ``pkg.mod:Name`` (from the environment or the current
    directory) or ``path/to/file.py:Name`` (a file is loaded as a module of its own, so its ``if __name__ ==
    "__main__":`` block does not run): a ``LightningModule`` subclass (``want_class``) or a callable."""
    where, _, qualname = spec.rpartition(":")
    if not where or not qualname:
        raise BundleError(f"{spec!r}: expected pkg.module:Name or path/to/file.py:Name")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the user named it, from where they stand
    try:
        found = _attribute(_load_file(where) if where.endswith(".py") else importlib.import_module(where), qualname)
    except (ImportError, AttributeError, OSError) as err:
        raise BundleError(
            f"cannot import {where}:{qualname} ({err}): run nanguard replay from the project's root, or put the "
            "directory that holds the package on PYTHONPATH"
        ) from err
    return _checked(found, f"{where}:{qualname}", want_class=want_class)


def _attribute(found: object, qualname: str) -> Any:
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _checked(found: object, name: str, *, want_class: bool) -> Any:
    if want_class and not (inspect.isclass(found) and issubclass(found, pl.LightningModule)):
        raise BundleError(f"{name} is a {type(found).__qualname__}, not a LightningModule subclass")
    if not want_class and not callable(found):
        raise BundleError(f"{name} is a {type(found).__qualname__}, not a callable")
    return found


def _load_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise ImportError(f"no file {path}")
    name = "nanguard_replay_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _inside(path: str | None, root: str) -> bool:
    if not path:
        return False
    try:
        return os.path.commonpath([os.path.realpath(path), root]) == root
    except ValueError:  # another drive
        return False


class _NothingFrom(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while a bundle's class is imported: asks the other finders, and refuses a module
    they would load from inside the bundle's directory (a shipped ``.py``, package or namespace package)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if any(_inside(p, self.root) for p in [spec.origin, *(spec.submodule_search_locations or ())]):
            raise ImportError(f"{fullname} would be loaded from inside the bundle ({self.root}): refused")
        return spec


@contextmanager
def _current_directory_on_path() -> Iterator[None]:
    """The current directory first on ``sys.path`` for one import (as ``python -m`` has it), then ``sys.path`` as it
    was: a project run from its root replays without being installed."""
    before = list(sys.path)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.path[:] = before


@contextmanager
def _nothing_from(bundle_dir: str | None) -> Iterator[None]:
    if bundle_dir is None:
        yield
        return
    guard = _NothingFrom(bundle_dir)
    sys.meta_path.insert(0, guard)
    try:
        yield
    finally:
        sys.meta_path.remove(guard)

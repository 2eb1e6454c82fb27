"""A bundle is data: crafted and damaged bundles get a clear error and exit 2, and nothing they name runs.

Each case starts from a real bundle (a fit of ``NormNoEps``), changes one thing, and runs ``nanguard replay`` on it.
The payloads (``tests/forensics/payload.py``) write a marker file when called: the marker never appears.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_nanguard.cli import main
from lightning_nanguard.exceptions import BundleError, NanGuardError
from lightning_nanguard.forensics.bundle import read_bundle
from lightning_nanguard.forensics.bundle_codec import Undecodable, decode, encode
from lightning_nanguard.forensics.offline import replay_bundle
from tests.forensics import origin_models as m
from tests.forensics import payload
from tests.forensics.test_bundle import BundleAt


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("good")
    callback = BundleAt(str(root))
    m.fit(m.NormNoEps(), callback, root=str(root))
    assert callback.written is not None
    assert callback.written.path is not None
    assert sorted(os.listdir(callback.written.path)) == ["manifest.json", "op.pt", "step.pt"]
    return callback.written.path


def _copy(good: str, tmp_path: Path, *, digests: bool = False) -> str:
    """A copy of the good bundle; without its files' sha256 in the manifest unless ``digests`` (the checks below
    are of the files' contents, which a crafter who rewrites a file also re-hashes; the sums are tested apart)."""
    path = str(tmp_path / "bundle")
    shutil.copytree(good, path)
    if not digests:
        _manifest(path, lambda d: d.pop("files"))
    return path


def _manifest(path: str, change: Callable[[dict[str, Any]], None]) -> None:
    file = os.path.join(path, "manifest.json")
    with open(file, encoding="utf-8") as f:
        manifest = json.load(f)
    change(manifest)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def _pt(path: str, name: str, change: Callable[[Any], Any]) -> None:
    file = os.path.join(path, name)
    data = torch.load(file, weights_only=True)
    torch.save(change(data), file)


def _refused(path: str, capsys: Any, match: str, *extra: str) -> str:
    """``nanguard replay`` exits 2 with nanguard's message (no traceback) naming ``match``."""
    code = main(["replay", path, *extra])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("nanguard replay: ")
    assert match in err, err
    return err


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.__setitem__(key, value)


# Code named in the manifest: each is refused before it is called (none is a LightningModule subclass).
MANIFEST_CODE = {
    "os.system": ("os", "system", {"command": "touch {marker}"}),
    "a function": ("tests.forensics.payload", "touch", {"path": "{marker}"}),
    "a class": ("tests.forensics.payload", "Touch", {"path": "{marker}"}),
    "subprocess.Popen": ("subprocess", "Popen", {"args": ["touch", "{marker}"]}),
    "builtins.exec": ("builtins", "exec", {"source": "open('{marker}', 'w')"}),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CODE))
def test_a_manifest_naming_code_is_refused_before_it_is_called(
    good: str, tmp_path: Path, capsys: Any, case: str
) -> None:
    path, marker = _copy(good, tmp_path), str(tmp_path / "RAN")
    module, qualname, hparams = MANIFEST_CODE[case]
    hparams = json.loads(json.dumps(hparams).replace("{marker}", marker))
    _manifest(path, lambda d: d.update(module=module, qualname=qualname, hparams=hparams))
    err = _refused(path, capsys, "not a LightningModule subclass")
    assert f"the bundle names the LightningModule {module}:{qualname}" in err  # said before it was imported
    assert not os.path.exists(marker)


def test_the_class_is_announced_before_it_is_imported(
    good: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user is told which class a bundle names before its module is imported (importing runs its code)."""
    imported = tmp_path / "IMPORTED"
    (tmp_path / "announced_models.py").write_text(
        f"open({str(imported)!r}, 'w').close()\nfrom tests.forensics.origin_models import NormNoEps as Model\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _copy(good, tmp_path)
    _manifest(path, lambda d: d.update(module="announced_models", qualname="Model"))
    said: list[tuple[str, bool]] = []
    found = replay_bundle(path, announce=lambda message: said.append((message, imported.exists())))
    assert said == [(said[0][0], False)]
    assert "announced_models:Model" in said[0][0]
    assert imported.exists()
    assert found.runs[0].reproduced


# Code in tagged objects of step.pt's batch: unknown tags, or names that are no torch value, are refused.
def _batch(value: Any) -> Callable[[Any], Any]:
    def change(data: Any) -> Any:
        data["batch"] = value
        return data

    return change


TAGGED = {
    "an object tag": {"__nanguard__": "object", "type": "tests.forensics.payload:touch", "args": ["{marker}"]},
    "a dtype naming a function": {"__nanguard__": "dtype", "value": "load"},
    "a layout naming a module": {"__nanguard__": "layout", "value": "os"},
    "a named tuple with code in a field": {
        "__nanguard__": "namedtuple",
        "type": "x:Batch",
        "fields": {"x=__import__('os').system('touch {marker}')": 1},
    },
    "a tag with extra keys": {"__nanguard__": "device", "value": "cpu", "call": "tests.forensics.payload:touch"},
}


@pytest.mark.parametrize("case", sorted(TAGGED))
def test_a_tagged_value_outside_the_fixed_set_is_refused(good: str, tmp_path: Path, capsys: Any, case: str) -> None:
    path, marker = _copy(good, tmp_path), str(tmp_path / "RAN")
    value = json.loads(json.dumps(TAGGED[case]).replace("{marker}", marker))
    _pt(path, "step.pt", _batch([value]))
    _refused(path, capsys, "damaged bundle")
    assert not os.path.exists(marker)


def test_a_named_tuple_comes_back_as_data_never_as_the_class_it_names(tmp_path: Path) -> None:
    marker = str(tmp_path / "RAN")
    stored = {"__nanguard__": "namedtuple", "type": "tests.forensics.payload:Touch", "fields": {"path": marker}}
    value = decode(stored)
    assert type(value).__name__ == "Touch"
    assert type(value) is not payload.Touch
    assert value.path == marker
    assert not os.path.exists(marker)
    Point = __import__("collections").namedtuple("Point", "x y")
    back = decode(encode(Point(torch.ones(1), 2)))
    assert back._fields == ("x", "y")
    assert back.y == 2
    with pytest.raises(Undecodable):
        decode({"x": object()})


@pytest.mark.parametrize("name", ["step.pt", "op.pt"])
def test_a_pickle_payload_in_a_data_file_is_refused(good: str, tmp_path: Path, capsys: Any, name: str) -> None:
    path, marker = _copy(good, tmp_path), str(tmp_path / "RAN")
    torch.save({"batch": payload.Pickled(marker), "rng": {}, "state": {}}, os.path.join(path, name))
    _refused(path, capsys, f"{name} is unreadable")
    assert not os.path.exists(marker)


def test_a_pickled_batch_is_read_only_with_allow_pickle(good: str, tmp_path: Path, capsys: Any) -> None:
    path, marker = _copy(good, tmp_path), str(tmp_path / "RAN")
    import pickle

    with open(os.path.join(path, "batch.pkl"), "wb") as f:
        pickle.dump(payload.Pickled(marker), f)
    _manifest(path, _set("batch_pickled", True))
    _refused(path, capsys, "can run any code")
    assert not os.path.exists(marker)


@pytest.mark.parametrize(
    "name", ["torch.ops.load_library.default", "aten.__class__.mro", "aten.div.__call__", "os.system.x"]
)
def test_an_op_that_is_no_aten_op_is_refused(good: str, tmp_path: Path, capsys: Any, name: str) -> None:
    path = _copy(good, tmp_path)
    _pt(path, "op.pt", lambda call: [name, *call[1:]])
    _refused(path, capsys, "not an aten op")


def test_an_aten_op_without_tensor_inputs_is_not_run(good: str, tmp_path: Path, capsys: Any) -> None:
    """An op-level replay runs an aten op on recorded tensors, nothing else (``aten.from_file`` reads a file)."""
    path = _copy(good, tmp_path)
    _pt(path, "op.pt", lambda call: ["aten.from_file.default", ["/etc/hostname"], {}])
    _manifest(path, _set("state", "none"))
    _refused(path, capsys, "no aten op on recorded tensors")


# Damaged bundles: cut short, missing files, missing or mistyped keys.
def _cut(name: str) -> Callable[[str], None]:
    def cut(path: str) -> None:
        file = os.path.join(path, name)
        with open(file, "rb") as f:
            data = f.read()
        with open(file, "wb") as f:
            f.write(data[: len(data) // 2])

    return cut


def _remove(name: str) -> Callable[[str], None]:
    return lambda path: os.remove(os.path.join(path, name))


def _drop_key(key: str) -> Callable[[str], None]:
    return lambda path: _manifest(path, lambda d: d.pop(key))


def _drop_data(key: str) -> Callable[[str], None]:
    return lambda path: _pt(path, "step.pt", lambda d: {k: v for k, v in d.items() if k != key})


DAMAGED: dict[str, tuple[Callable[[str], None], str]] = {
    "manifest.json cut short": (_cut("manifest.json"), "manifest.json is unreadable"),
    "step.pt cut short": (_cut("step.pt"), "step.pt is unreadable"),
    "op.pt cut short": (_cut("op.pt"), "op.pt is unreadable"),
    "step.pt missing": (_remove("step.pt"), "step.pt is missing"),
    "op.pt missing": (_remove("op.pt"), "op.pt is missing"),
    "manifest.json missing": (_remove("manifest.json"), "no bundle at"),
    **{f"manifest without {k}": (_drop_key(k), f"lacks '{k}'") for k in ("module", "qualname", "step", "batch_idx")},
    "manifest step a string": (lambda p: _manifest(p, _set("step", "2")), "'step' is '2'"),
    "manifest a list": (lambda p: Path(p, "manifest.json").write_text("[1]"), "not a JSON object"),
    "manifest nested too deep": (lambda p: Path(p, "manifest.json").write_text("[" * 10**6), "unreadable"),
    **{f"step.pt without {k}": (_drop_data(k), f"lacks ['{k}']") for k in ("batch", "rng", "state")},
    "rng damaged": (lambda p: _pt(p, "step.pt", lambda d: {**d, "rng": {"torch": torch.zeros(3)}}), "random"),
    "step.pt a list": (lambda p: _pt(p, "step.pt", lambda d: [1, 2]), "not a dict"),
    "state not tensors": (lambda p: _pt(p, "step.pt", lambda d: {**d, "state": {"w": 1}}), "named tensors"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_bundle_is_a_clear_error_and_exit_2(good: str, tmp_path: Path, capsys: Any, case: str) -> None:
    path = _copy(good, tmp_path)
    damage, match = DAMAGED[case]
    damage(path)
    _refused(path, capsys, match)
    with pytest.raises(BundleError, match="bundle"):
        read_bundle(path)


def test_bundle_error_is_a_nanguard_error() -> None:
    assert issubclass(BundleError, NanGuardError)


def test_module_and_factory_together_are_a_usage_error(good: str, capsys: Any) -> None:
    _refused(good, capsys, "give one", "--module", "a:B", "--factory", "a:c")


def test_a_module_option_naming_no_lightning_module_is_refused_before_it_is_called(
    good: str, tmp_path: Path, capsys: Any
) -> None:
    """``--module`` is the user's choice, still checked: a class that is no LightningModule is never built."""
    path, marker = _copy(good, tmp_path), str(tmp_path / "RAN")
    _manifest(path, _set("hparams", {"path": marker}))
    _refused(path, capsys, "not a LightningModule subclass", "--module", "tests.forensics.payload:Touch")
    assert not os.path.exists(marker)


# Code shipped inside the bundle: the manifest names a file, or a module name that matches a shipped file; the user
# runs ``nanguard replay .`` from inside the bundle, with the bundle's directory on sys.path (``python -m``,
# ``PYTHONPATH=.``). Nothing shipped runs.
def _ship(path: str, marker: str, name: str) -> None:
    file = Path(path, name)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(f"open({marker!r}, 'w').write('shipped code ran')\nclass Innocent: pass\n")


@pytest.mark.parametrize("module", ["payload.py", "./payload.py", "sub/payload.py", "sub\\payload", "payload.pyc"])
def test_a_manifest_naming_a_file_is_refused_before_anything_is_imported(
    good: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    path, marker = _copy(good, tmp_path), str(tmp_path / "RAN")
    for name in ("payload.py", "sub/payload.py", "payload/__init__.py"):
        _ship(path, marker, name)
    _manifest(path, lambda d: d.update(module=module, qualname="Innocent"))
    monkeypatch.chdir(path)
    monkeypatch.syspath_prepend(path)
    err = _refused(".", capsys, "not a dotted module name")
    assert "importing" not in err  # refused when read, before any import was announced
    assert not os.path.exists(marker)


@pytest.mark.parametrize("module", ["shipped_models", "shipped_pkg.models", "shipped_ns.models"])
def test_a_module_name_matching_a_file_shipped_in_the_bundle_is_not_imported_from_it(
    good: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    """A plain dotted name resolved from the bundle's own directory (the current one, on sys.path here as ``python
    -m`` or ``PYTHONPATH=.`` put it) would run what the bundle ships: the import refuses any module found there."""
    path, marker = _copy(good, tmp_path), str(tmp_path / "RAN")
    for name in ("shipped_models.py", "shipped_pkg/__init__.py", "shipped_pkg/models.py", "shipped_ns/models.py"):
        _ship(path, marker, name)
    _manifest(path, lambda d: d.update(module=module, qualname="Innocent"))
    monkeypatch.chdir(path)
    monkeypatch.syspath_prepend(path)
    _refused(".", capsys, "from inside the bundle")
    assert not os.path.exists(marker)
    assert module.split(".")[0] not in sys.modules


def test_a_manifest_class_is_found_in_the_current_directory_outside_the_bundle_and_sys_path_is_put_back(
    good: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project run from its root replays without being installed (the current directory is on sys.path for the
    import, as ``python -m`` has it), sys.path is put back afterwards, and the same module shipped inside the bundle,
    run from there, is refused (the test above)."""
    path, marker = _copy(good, tmp_path), str(tmp_path / "RAN")
    project = tmp_path / "project"
    project.mkdir()
    (project / "user_models.py").write_text(
        f"with open({marker!r}, 'w') as f:\n    f.write('user code imported')\nclass Innocent: pass\n"
    )
    _manifest(path, lambda d: d.update(module="user_models", qualname="Innocent"))
    monkeypatch.chdir(project)
    monkeypatch.delitem(sys.modules, "user_models", raising=False)
    before = list(sys.path)
    _refused(path, capsys, "user_models:Innocent is a type, not a LightningModule subclass")
    assert os.path.exists(marker)  # found where the user stands, outside the bundle
    assert sys.path == before
    sys.modules.pop("user_models", None)


def test_deeply_nested_hparams_are_shortened_in_the_error(good: str, tmp_path: Path, capsys: Any) -> None:
    """A bundle whose 7 kB nested ``hparams`` the class cannot take names them in a short line, not all of them."""
    path = _copy(good, tmp_path)
    huge = {f"block_{i}": {"sizes": list(range(40)), "name": "x" * 100, "deep": [[[[i]]]]} for i in range(30)}
    assert len(json.dumps(huge)) > 7000
    _manifest(path, _set("hparams", huge))
    err = _refused(path, capsys, "cannot build NormNoEps(**{")
    assert max(len(line) for line in err.splitlines()) < 1500


@pytest.mark.parametrize("name", ["step.pt", "op.pt"])
def test_a_data_file_changed_after_it_was_written_fails_its_sha256(
    good: str, tmp_path: Path, capsys: Any, name: str
) -> None:
    path = _copy(good, tmp_path, digests=True)
    with open(os.path.join(good, "manifest.json"), encoding="utf-8") as f:
        assert sorted(json.load(f)["files"]) == ["op.pt", "step.pt"]
    data = bytearray(Path(path, name).read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: torch's loader would not notice it in a tensor's bytes
    Path(path, name).write_bytes(bytes(data))
    _refused(path, capsys, f"{name} does not match its sha256 in manifest.json")


@pytest.mark.parametrize("files", [{"../secret": "0" * 64}, {"step.pt": "not a digest"}, {"manifest.json": "0" * 64}])
def test_a_files_entry_that_is_no_data_file_digest_is_refused(
    good: str, tmp_path: Path, capsys: Any, files: dict[str, str]
) -> None:
    path = _copy(good, tmp_path, digests=True)
    _manifest(path, lambda d: d.__setitem__("files", files))
    _refused(path, capsys, "manifest.json's 'files' lists")

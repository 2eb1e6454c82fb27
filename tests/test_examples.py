"""The shipped LightningCLI configs parse and build the callbacks they name."""

from __future__ import annotations

import glob
import os

import pytest
from lightning.pytorch.callbacks import Callback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"), recursive=True))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_config_builds_its_callbacks(path: str) -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--trainer.callbacks", type=list[Callback], default=[])
    cfg = parser.parse_path(path)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    built = instantiate(cfg).trainer.callbacks
    with open(path) as f:
        assert len(built) == f.read().count("class_path:")


def test_an_ablation_example_for_every_callback() -> None:
    """examples/ablation/ holds each callback alone (``only_<name>.yaml``) and all of them (``all.yaml``)."""
    import re

    from lightning_nanguard.preset import CALLBACKS

    folder = os.path.join(ROOT, "examples", "ablation")
    for cls in CALLBACKS:
        snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", cls.__name__).lower()
        path = os.path.join(folder, f"only_{snake}.yaml")
        assert os.path.isfile(path), path
        with open(path, encoding="utf-8") as f:
            assert f"class_path: lightning_nanguard.{cls.__name__}\n" in f.read()
    with open(os.path.join(folder, "all.yaml"), encoding="utf-8") as f:
        listed = re.findall(r"class_path: lightning_nanguard\.(\w+)", f.read())
    assert listed == [cls.__name__ for cls in CALLBACKS]

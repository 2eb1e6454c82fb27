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

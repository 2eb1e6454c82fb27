"""``nanguard demo``'s incidents and their replay name the demo's own model line, as a user's run names the user's:
the demo's tasks live inside the package but stand for a user's project (``forensics.op_stats``). Before, the
innermost frame outside the package was whatever started the demo (the console script ``bin/nanguard``; here, this
test file)."""

from __future__ import annotations

import os
import pathlib

import lightning_nanguard
from lightning_nanguard import default_callbacks, replay_bundle
from lightning_nanguard.demo import demo_module, run_task

DEMO = os.path.join(os.path.dirname(os.path.realpath(lightning_nanguard.__file__)), "demo", "")


def test_the_demo_incident_and_its_replay_name_the_demo_model(tmp_path: pathlib.Path) -> None:
    result = run_task("bad-data", default_callbacks(), root_dir=str(tmp_path), max_epochs=1)
    (incident,) = result.incidents
    frame = incident.diagnosis["origin"]["frame"]
    assert os.path.realpath(frame["file"]).startswith(DEMO), frame
    assert frame["function"] == "forward"

    bundles = pathlib.Path(result.log_dir) / "nanguard" / "bundles"
    (bundle,) = bundles.iterdir()
    found = replay_bundle(bundle, model=demo_module, announce=lambda _: None)
    assert found.origin is not None
    assert found.origin.frame is not None
    assert os.path.realpath(found.origin.frame.file).startswith(DEMO), found.origin.frame

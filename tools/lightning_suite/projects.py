"""The projects whose own test suites ``run.py`` runs plain and with nanguard's preset: where each one's source
comes from, what to install, which tests run, and the file of its intended differences.

Add a project by adding a ``Project`` to ``PROJECTS``: it must train with ``lightning.pytorch``'s ``Trainer`` (the
plugin patches that class, so a ``Trainer`` subclass is covered too), and its chosen tests must run on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Lightning's own pytest settings for its tests (its setup.cfg is not part of tests/).
_LIGHTNING_INI = """[pytest]
addopts = --strict-markers -p no:cacheprovider --disable-pytest-warnings
markers =
    cloud: Run the cloud tests for example
xfail_strict = true
filterwarnings =
    error::FutureWarning
    ignore:You are using `torch.load` with `weights_only=False`.*:FutureWarning
    ignore::FutureWarning:torch.distributed.algorithms.ddp_comm_hooks
    ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated.*:FutureWarning
"""

# pytorch-forecasting's pytest settings without its coverage options (pytest-cov is not needed here).
_PYTORCH_FORECASTING_INI = """[pytest]
addopts = -rsxX
log_cli_level = ERROR
filterwarnings =
    ignore:Found \\d+ unknown classes which were set to NaN:UserWarning
    ignore:Less than \\d+ samples available for \\d+ prediction times. Use ba:UserWarning
    ignore:scale is below 1e-7 - consider not centering the data or using data with:UserWarning
    ignore:You defined a `validation_step` but have no `val_dataloader`:UserWarning
    ignore:ReduceLROnPlateau conditioned on metric:RuntimeWarning
    default::DeprecationWarning
    default::PendingDeprecationWarning
    default::FutureWarning
    ignore::UserWarning
"""


@dataclass(frozen=True)
class Project:
    """One project's test suite as a compatibility check.

    Args:
        name: the ``--project`` name.
        repo: the public repository (``owner/name``).
        ref: the tag or commit the recorded run used (take the one matching the installed package).
        install: what to pip-install beside lightning_nanguard (always with torch pinned: ``-c .ci/constraints.txt``).
        copy: the paths of the checkout each run copies into its own fresh tree (a run's files never meet the other's).
        workdir: where pytest runs, inside the copied tree (also its ``--rootdir``).
        paths: the test paths, relative to ``workdir``.
        ini: pytest settings to use instead of the project's own, or ``None`` to keep the project's.
        args: further pytest arguments (markers, ignores).
        data: (file in the checkout, module) pairs: files the tests would download, copied from the checkout into
            the installed module's folder when missing there.
    """

    name: str
    repo: str
    ref: str
    install: str
    copy: tuple[str, ...]
    workdir: str
    paths: tuple[str, ...]
    ini: str | None = None
    args: tuple[str, ...] = field(default_factory=tuple)
    data: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @property
    def intended(self) -> Path:
        """``intended/<name>.txt``: one ``test-id  # reason`` per line (``*`` matches anything), and
        ``file: <glob>  # reason`` for files the preset run leaves in the project's tree."""
        return HERE / "intended" / f"{self.name}.txt"


PROJECTS = {
    p.name: p
    for p in (
        Project(
            name="lightning",
            repo="Lightning-AI/pytorch-lightning",
            ref="2.6.5",
            install="cloudpickle psutil pandas scikit-learn",
            copy=("tests",),
            workdir="tests",
            # Trainer, loops, checkpointing, logging and hooks: the parts of Lightning a callback suite can disturb.
            paths=(
                "tests_pytorch/trainer",
                "tests_pytorch/loops",
                "tests_pytorch/checkpointing",
                "tests_pytorch/loggers",
                "tests_pytorch/models/test_hooks.py",
            ),
            ini=_LIGHTNING_INI,
            args=("-m", "not cloud"),
        ),
        Project(
            # A single-cell library: its own Trainer subclass, Pyro training plans (SVI, a guide's parameters
            # created lazily), manual optimization (adversarial classifiers), custom data splitters and loggers.
            name="scvi-tools",
            repo="scverse/scvi-tools",
            ref="1.4.2",
            install="scvi-tools==1.4.2",
            copy=("tests", "pyproject.toml"),
            workdir=".",
            # Every test that trains a model; the jax, mlx and hub tests need packages or a network the CPU run
            # has not (their markers skip the rest: multigpu, internet, optional, autotune).
            paths=("tests/train", "tests/model", "tests/external", "tests/module"),
            args=(
                "--ignore=tests/model/test_jaxscvi.py",
                "--ignore=tests/model/test_mlxscvi.py",
                "--ignore=tests/external/mrvi_jax",
                "--ignore=tests/external/tangram",
            ),
        ),
        Project(
            # Time-series forecasting: LightningModules with their own logging, learning-rate finders and
            # ReduceLROnPlateau schedulers, custom samplers, TensorBoard figures, models saved and reloaded.
            name="pytorch-forecasting",
            repo="sktime/pytorch-forecasting",
            ref="v1.8.0",
            install="pytorch-forecasting==1.8.0 pyarrow",
            copy=("tests",),
            workdir=".",
            # Every test that trains a model (the data, metric and utility tests build no Trainer).
            paths=("tests/test_models", "tests/test_callbacks.py"),
            ini=_PYTORCH_FORECASTING_INI,
            # The tests' data set, which get_stallion_data() would download into the package's folder.
            data=(("examples/data/stallion.parquet", "pytorch_forecasting.data.examples"),),
        ),
    )
}

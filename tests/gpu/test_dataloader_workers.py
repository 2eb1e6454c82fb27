"""DataLoader workers (forked, persistent, pinned memory) with the preset on CUDA, over several fits; and the
mechanism behind a worker dying with ``cudaErrorInitializationError``: a forked worker's garbage collector freeing
page-locked memory the parent left behind as garbage (``recovery/host_memory.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import default_callbacks
from lightning_nanguard.recovery import host_memory
from tests.gpu._helpers import ACCELERATOR, Incidents, gpu, gpu_trainer, needs_cuda
from tests.helpers import TinyModel

pytestmark = gpu


class WorkerModel(TinyModel):
    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        data = TensorDataset(x, x[:, :1] * 0.5)
        return DataLoader(data, batch_size=8, num_workers=2, persistent_workers=True, pin_memory=ACCELERATOR == "cuda")


def test_the_preset_trains_with_pinned_persistent_workers_over_several_fits(tmp_path: Any) -> None:
    for i in range(4):
        probe = Incidents()
        trainer = gpu_trainer(tmp_path / str(i), callbacks=[*default_callbacks(), probe], max_steps=40)
        trainer.fit(WorkerModel())
        assert probe.finite
        assert probe.seen == []


_WORKER = textwrap.dedent(
    """
    import gc, importlib.util, sys
    import torch
    from torch.utils.data import DataLoader, Dataset

    gc.disable()  # keep the garbage until the worker collects it

    class Holder:
        pass

    h = Holder()
    h.self = h  # a reference cycle: freed only by the garbage collector
    h.buf = torch.empty(1024, pin_memory=True)  # the caching host allocator's memory
    h.buf.copy_(torch.ones(1024, device="cuda"), non_blocking=True)  # freeing it will record a CUDA event
    torch.cuda.synchronize()
    del h
    if sys.argv[1] == "guard":
        spec = importlib.util.spec_from_file_location("host_memory", sys.argv[2])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.protect_forked_children()

    class Collecting(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            gc.collect()
            return torch.zeros(1)

    for _ in DataLoader(Collecting(), num_workers=1, multiprocessing_context="fork"):
        pass
    print("worker survived")
    """
)


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WORKER, mode, host_memory.__file__], capture_output=True, text=True, timeout=120
    )


@needs_cuda
def test_a_forked_worker_dies_freeing_the_parents_pinned_garbage_without_the_guard() -> None:
    out = _run("none")
    assert out.returncode != 0, "the mechanism did not reproduce: the worker freed inherited pinned memory safely"
    assert "worker survived" not in out.stdout


@needs_cuda
def test_with_the_guard_the_forked_worker_survives() -> None:
    out = _run("guard")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "worker survived" in out.stdout

"""2 gloo ranks without Lightning: the share rule and the snapshot ring on hand-built DTensors.

``python -m tests.sharded._dtensor_worker OUT_DIR``: spawns 2 processes; each writes ``dtensor{r}.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from lightning_nanguard.recovery.snapshot import SnapshotRing
    from lightning_nanguard.signals.gradients import ParamIndex, grad_norms, weighted_squares
    from lightning_nanguard.signals.sharded import local_tensor, share_of

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)  # the same full tensors on both ranks
    mesh = init_device_mesh("cpu", (2,))
    full = {"sharded": torch.randn(6, 3), "replicated": torch.randn(4), "plain": torch.randn(5)}
    params = [
        torch.nn.Parameter(distribute_tensor(full["sharded"], mesh, [Shard(0)])),
        torch.nn.Parameter(distribute_tensor(full["replicated"], mesh, [Replicate()])),
        torch.nn.Parameter(full["plain"].clone()),
    ]
    for p, t in zip(params, full.values(), strict=True):
        p.grad = distribute_tensor(t * 2, mesh, p.placements) if isinstance(p, DTensor) else t * 2
    out: dict[str, Any] = {"shares": [share_of(p, 2) for p in params]}
    index = ParamIndex(params, ["a.w", "b.w", "c.w"], 1, world_size=2)
    squares = weighted_squares(index, grad_norms(index), torch.device("cpu"))
    dist.all_reduce(squares)  # the sensor's SUM all-reduce
    out["norms"] = squares.sqrt().tolist()
    out["expected"] = [float((t * 2).double().norm()) for t in full.values()]
    # Snapshot ring: the local shards round-trip in place; state the snapshot had but the live optimizer lost is
    # rebuilt as a DTensor of the recorded layout.
    opt = torch.optim.Adam(params[:2], lr=0.1)
    opt.step()
    ring = SnapshotRing(1)
    snap = ring.take(torch.nn.ParameterList(params), [opt], step=1, log_step=1)
    before = [local_tensor(p).clone() for p in params]
    moments = local_tensor(opt.state[params[0]]["exp_avg"]).clone()
    opt.step()
    del opt.state[params[0]]["exp_avg"]
    ring.restore(snap, torch.nn.ParameterList(params), [opt])
    out["params_restored"] = all(torch.equal(local_tensor(p), b) for p, b in zip(params, before, strict=True))
    rebuilt = opt.state[params[0]]["exp_avg"]
    first = params[0]
    assert isinstance(first, DTensor)
    out["rebuilt_is_dtensor"] = isinstance(rebuilt, DTensor) and rebuilt.placements == first.placements
    out["rebuilt_equal"] = torch.equal(local_tensor(rebuilt), moments)
    out["shard_buffer_shape"] = list(snap.model[0].shape)
    with open(os.path.join(out_dir, f"dtensor{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mp.spawn(_run, args=(_free_port(), sys.argv[1]), nprocs=2)  # type: ignore[attr-defined,no-untyped-call]

"""The checkpoint integrity helpers' former home, kept for scripts that import from it.

Checkpoint integrity lives in ``lightning_nanguard.checkpointing`` (one module per job: write, verify, fall back,
shard manifest). The public entry points are ``lightning_nanguard.verify_checkpoint`` and
``lightning_nanguard.last_good_checkpoint``; this module re-exports the names scripts used from here.
"""

from __future__ import annotations

from lightning_nanguard.checkpointing.sidecar import write_sidecar
from lightning_nanguard.checkpointing.verify import verify_checkpoint

__all__ = ["verify_checkpoint", "write_sidecar"]

"""The test suite. Importing it (every test module does, and so does every spawned DDP rank that unpickles a model
or callback defined here) registers one exit handler: a rank that still holds the default process group at exit
destroys it first. Lightning leaves the group up after fit, and the gloo threads torn down with the interpreter can
abort a rank whose fit succeeded ("terminate called without an active exception", SIGABRT), failing a passing test
at random."""

from __future__ import annotations

import atexit


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(_destroy_process_group)

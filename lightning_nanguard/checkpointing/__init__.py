"""Checkpoint integrity, one entry point per job.

* **write**: ``write`` (a file through a temporary name, or at the caller's path for a custom ``CheckpointIO``; the
  ``nanguard-last-good.ckpt`` tag), with its ``.checksum`` sidecar (``sidecar``);
* **verify**: ``verify`` (``verify_checkpoint``, ``verify_and_load``, ``last_good_checkpoint``, ``verified_step``);
* **fall back**: ``fallback`` (which verified file a failed resume takes, within ``lineage``'s past);
* **shard manifest**: ``manifest`` (a directory checkpoint's ``nanguard-manifest.json``).

CheckpointGuard's IO puts them together: ``install`` puts ``verifying_io`` (the ``CheckpointIO`` wrapper) on the
strategy, ``sharded`` wraps the sharded strategies' own ``save_checkpoint``/``load_checkpoint``; ``events`` says what
it did. ``final`` writes a verified checkpoint before a graceful stop; ``orphans`` and ``tmp_files`` clear what deleted
checkpoints and killed saves leave behind; ``infinities`` decides which infinities in a checkpoint are intended.
"""

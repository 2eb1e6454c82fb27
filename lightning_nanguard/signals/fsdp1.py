"""FSDPStrategy (FSDP1, ``FullyShardedDataParallel``) with ``use_orig_params=True``: the original parameters as this
rank's local pieces.

Under ``use_orig_params=True`` (Lightning's default) FSDP1 keeps the original ``nn.Parameter`` objects, and outside
forward and backward each one's ``.data`` is a flat (1-d) view of its piece of the rank's flat shard
(``FlatParamHandle._use_sharded_views``: ``flat_param[offset_in_shard : offset_in_shard + numel_in_shard]``), or a
size-0 tensor where the rank holds none of it; its ``.grad`` is the same view of the sharded gradient, or ``None``
where the piece is empty (``_use_sharded_grad_views``). The padding (``_shard_numel_padded``) is in no view. So a
rank's pieces are plain tensors, disjoint across the ranks of a shard group, and nanguard reads, snapshots and restores
them as it reads the local shards of a ``DTensor`` (``signals/sharded.py``): in place, no communication.

Nothing on those tensors says which share of the world holds them, so ``mark_parameters`` writes it once, after the
strategy has wrapped the model (``install``): ``shard_group_size / world`` on every original parameter of a flat
parameter (``FULL_SHARD``/``SHARD_GRAD_OP``: 1; ``HYBRID_SHARD``: 1 / replicas; ``NO_SHARD``, where every rank holds
the whole tensor: 1 / world). ``signals/sharded.share_of`` and ``is_sharded`` read the mark; one SUM all-reduce of
weighted squared norms is then each tensor's global norm, as under FSDP2.

``use_orig_params=False`` is refused: the optimizer then holds the ``FlatParameter``s (one per wrapped unit, padding
included), so neither per-parameter norms nor the names of the original parameters exist.
"""

from __future__ import annotations

from typing import Any

from lightning_nanguard import _lightning_compat
from lightning_nanguard.exceptions import UnsupportedSetupError

__all__ = ["SHARE_ATTR", "install", "is_fsdp1", "mark_parameters", "refusal", "refusal_use_orig_params"]

SHARE_ATTR = "_nanguard_share"  # set on an original parameter: its weight in the SUM (``sharded.share_of``)

# The callbacks that do not run under FSDPStrategy, and why (every other one runs under ``use_orig_params=True``;
# CheckpointGuard with ``state_dict_type="sharded"`` only: it wraps the strategy's own save and load,
# ``checkpointing/sharded.py``).
_NOT_SUPPORTED = {
    "PrecisionHeadroom": (
        "FSDP1 casts each unit's parameters to its MixedPrecision param_dtype at the all-gather whatever autocast "
        "says, so a module moved to float32 would still compute in it; its sampled forward hooks are untested there"
    ),
    "FP32Evaluation": (
        "FSDP1 casts each unit's parameters to its MixedPrecision param_dtype at the all-gather whatever autocast "
        "says, so switching autocast off does not evaluate in float32; its mode='on_nonfinite' re-runs a batch on "
        "one rank, and an FSDP1 forward all-gathers (a hang); not built or tested for FSDP1. Use "
        "ModelParallelStrategy with fully_shard (FSDP2, mode='always' under bf16-mixed)"
    ),
}


# Run by tests/sharded/test_fsdp1.py.
_TESTED_PRECISIONS = ("32-true", "32", "bf16-mixed")


def is_fsdp1(strategy: object) -> bool:
    """``strategy`` is Lightning's ``FSDPStrategy`` (or a subclass): read from the class names, no import."""
    return any(cls.__name__ == "FSDPStrategy" for cls in type(strategy).__mro__)


def refusal(trainer: Any, owner: str) -> str | None:
    """Why ``owner`` does not run under this Trainer's ``FSDPStrategy``, or ``None`` if it does."""
    strategy = trainer.strategy
    kwargs = getattr(strategy, "kwargs", None) or {}
    if not kwargs.get("use_orig_params", False):  # Lightning's FSDPStrategy sets it True unless told otherwise
        return refusal_use_orig_params()
    precision = str(getattr(trainer, "precision", "32-true"))
    if precision in ("16-mixed", "16"):
        return (
            "FSDPStrategy under precision='16-mixed' steps through a ShardedGradScaler whose skip and found-inf "
            "reduction nanguard is not tested with (FSDPStrategy needs a GPU for it). Use precision='bf16-mixed' "
            "or '32-true'"
        )
    if precision not in _TESTED_PRECISIONS:
        return (
            f"FSDPStrategy under precision={precision!r} is not tested (tested: '32-true' and 'bf16-mixed', whose "
            "sharded gradients are float32). Use precision='bf16-mixed' or '32-true'"
        )
    if owner == "CheckpointGuard" and _lightning_compat.fsdp1_state_dict_type(strategy) != "sharded":
        return (
            "FSDPStrategy(state_dict_type='full') (its default) gathers the whole state to rank 0 and loads it "
            "itself, and nanguard has not run that path: torch's FSDP1 full state dict (Lightning asks for "
            "offload_to_cpu=True) crashes on CPU ranks, and no GPU was available to test it. Use "
            "FSDPStrategy(state_dict_type='sharded'): distributed checkpoint directories, saved with a manifest "
            "and verified at resume"
        )
    return _NOT_SUPPORTED.get(owner)


def refusal_use_orig_params() -> str:
    """The reason ``use_orig_params=False`` is refused."""
    return (
        "FSDPStrategy(use_orig_params=False): it hands the optimizer FlatParameters (one per wrapped unit, padding "
        "included), so the original parameters, their gradients and their names are gone and neither the "
        "per-parameter reading nor the snapshots can be built on them. Use FSDPStrategy(use_orig_params=True) "
        "(Lightning's default: remove use_orig_params=False)"
    )


def mark_parameters(model: Any, world_size: int) -> int:
    """Write each original parameter's share (module docstring) on it; the number of parameters marked.

    ``model``: the strategy's wrapped model (``FullyShardedDataParallel`` units anywhere inside). Runs once per
    setup, on every rank alike (no communication).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    marked = 0
    world = max(1, int(world_size))
    for unit in model.modules():
        if not isinstance(unit, FullyShardedDataParallel):
            continue
        handle = _lightning_compat.fsdp1_handle(unit)
        if handle is None:  # a unit that manages no parameter of its own (the root of a fully wrapped model)
            continue
        if not _lightning_compat.fsdp1_uses_orig_params(handle):  # wrapped by hand with use_orig_params=False
            raise UnsupportedSetupError(f"nanguard does not support {refusal_use_orig_params()}.")
        flat = handle.flat_param
        shard_group = handle.process_group.size() if handle.uses_sharded_strategy else 1
        share = min(1.0, shard_group / world)
        for p in _lightning_compat.fsdp1_original_params(flat):
            setattr(p, SHARE_ATTR, share)
            marked += 1
    return marked


class _MarkAfterSetup:
    """``strategy.setup`` then ``mark_parameters`` (an instance attribute over the class's method)."""

    def __init__(self, original: Any, strategy: Any) -> None:
        self.original = original
        self.strategy = strategy

    def __call__(self, trainer: Any) -> None:
        self.original(trainer)
        if self.strategy.model is not None:
            mark_parameters(self.strategy.model, self.strategy.world_size)


def install(strategy: Any) -> None:
    """Mark the original parameters every time ``strategy`` sets the model up (it wraps it in FSDP there, after
    the callbacks' ``setup`` and before ``on_fit_start``). Once per strategy instance."""
    if isinstance(_lightning_compat.instance_attribute(strategy, "setup"), _MarkAfterSetup):
        return
    strategy.setup = _MarkAfterSetup(strategy.setup, strategy)

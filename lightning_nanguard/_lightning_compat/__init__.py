"""Every private or version-specific touch of Lightning/torch internals lives in this package, each with its public
fallback where one exists: ``amp`` (the GradScaler and fused optimizers), ``loops`` (Lightning's loop counters),
``strategies`` (strategy settings, checkpoint layout), ``patches`` (instance patches of Lightning objects),
``torch_ops`` (torch's private functions). Import the package; every name is here.

``tests/test_fences.py`` holds the fence: a private attribute of a Lightning or torch object read or written outside
this package fails it.
"""

from lightning_nanguard._lightning_compat.amp import (
    accepts_found_inf,
    active_scaler,
    agree_scaler_skip,
    clamp_scale,
    clear_found_inf,
    clear_found_inf_of,
    current_scale,
    flag_nonfinite,
    get_scaler,
    optimizer_handles_unscaling,
    or_into_found_inf,
    or_nonfinite_into_found_inf,
    scale_tensor,
    set_found_inf,
    set_found_inf_where_nonfinite,
    true_flag,
)
from lightning_nanguard._lightning_compat.dispatch import (
    TorchDispatchMode,
    autograd_node,
    node_stack,
    op_is_mutable,
    tensor_version,
)
from lightning_nanguard._lightning_compat.loops import (
    LoggingSteps,
    is_train_logging_step,
    log_step,
    should_update_logs,
    train_batch_idx,
    train_batch_samplers,
)
from lightning_nanguard._lightning_compat.patches import (
    EVAL_STEP_CONTEXT,
    AttributePatches,
    clipping_possible,
    guard_clipping,
    takes_dataloader_iter,
    tensorboard_one_event,
)
from lightning_nanguard._lightning_compat.strategies import (
    checkpoint_log_step,
    checkpoint_scaler_scale,
    fsdp1_state_dict_type,
    instance_attribute,
    saves_distributed_checkpoint,
    strategy_class_names,
)
from lightning_nanguard._lightning_compat.torch_ops import (
    foreach_norm,
    foreach_norms,
    host_buffer_marked,
    local_shards,
    tree_map,
)

__all__ = [
    "EVAL_STEP_CONTEXT",
    "AttributePatches",
    "LoggingSteps",
    "TorchDispatchMode",
    "accepts_found_inf",
    "active_scaler",
    "agree_scaler_skip",
    "autograd_node",
    "checkpoint_log_step",
    "checkpoint_scaler_scale",
    "clamp_scale",
    "clear_found_inf",
    "clear_found_inf_of",
    "clipping_possible",
    "current_scale",
    "flag_nonfinite",
    "foreach_norm",
    "foreach_norms",
    "fsdp1_state_dict_type",
    "get_scaler",
    "guard_clipping",
    "host_buffer_marked",
    "instance_attribute",
    "is_train_logging_step",
    "local_shards",
    "log_step",
    "node_stack",
    "op_is_mutable",
    "optimizer_handles_unscaling",
    "or_into_found_inf",
    "or_nonfinite_into_found_inf",
    "saves_distributed_checkpoint",
    "scale_tensor",
    "set_found_inf",
    "set_found_inf_where_nonfinite",
    "should_update_logs",
    "strategy_class_names",
    "takes_dataloader_iter",
    "tensor_version",
    "tensorboard_one_event",
    "train_batch_idx",
    "train_batch_samplers",
    "tree_map",
    "true_flag",
]

"""Optimizer hazards that can be seen before the first step, from plain facts about the setup.

The findings (pure: descriptions in, findings out; the callback gathers the descriptions and applies fixes):

* ``eps_underflow``: a non-fused optimizer with an ``eps`` (Adam family, RMSprop, Adagrad, ...) whose eps is not a
  normal number in the parameters' dtype. In float16, ``1e-8`` rounds to 0, so Adam's ``exp_avg / (sqrt(v) + eps)``
  divides by zero the first time ``v`` underflows (``(1 - beta2) * g**2`` is 0 in fp16 for ``|g| < 7e-3``): every
  parameter is inf/NaN after step 1. Subnormal eps (1e-7) blew up later and 1e-6 diverged in our measurements, so
  the rule is "eps must be at least the dtype's smallest normal number" (6.1e-5 for float16). bfloat16 shares
  float32's exponent range, so it never trips this. Fused kernels compute in float32: exempt. Fixable: raise eps.
* ``fused_scaler_clip``: a fused optimizer with a GradScaler and gradient clipping: Lightning raises at the first
  step (the fused kernel unscales inside, so clipping would see scaled gradients). Not fixable here.
* ``half_master``: parameters in true half precision (no float32 master copy): updates smaller than half an ulp of a
  weight are rounded away, and the optimizer state is half precision too. Reported once per optimizer; not fixable
  here (use ``precision="16-mixed"``/``"bf16-mixed"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_nanguard.contract import Notice

__all__ = ["Finding", "GroupInfo", "OptimizerInfo", "min_safe_eps", "preflight_findings"]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GroupInfo:
    """One param group: its ``eps`` (None when it has none), whether it is fused, its parameter dtypes."""

    eps: float | None
    fused: bool
    dtypes: tuple[torch.dtype, ...]


@dataclass(frozen=True)
class OptimizerInfo:
    """One optimizer as preflight sees it."""

    index: int
    name: str
    groups: tuple[GroupInfo, ...]
    fused_with_scaler: bool = False


@dataclass(frozen=True)
class Finding:
    """One hazard. ``fix_eps`` is the eps that fixes it (``eps_underflow`` only)."""

    code: Notice
    opt_idx: int
    group_idx: int
    message: str
    fixable: bool
    values: dict[str, object] = field(default_factory=dict)
    fix_eps: float | None = None


def min_safe_eps(dtype: torch.dtype) -> float:
    """The smallest eps that is a normal number in ``dtype`` (float16: 6.1e-5; float32/bfloat16: 1.2e-38)."""
    return float(torch.finfo(dtype).tiny) if dtype.is_floating_point else 0.0


def preflight_findings(
    optimizers: list[OptimizerInfo], *, clip: bool, safe_eps: float, check_half_master: bool = True
) -> list[Finding]:
    """Every hazard in ``optimizers``, in optimizer/group order.

    Args:
        optimizers: the setup, one entry per optimizer.
        clip: whether the Trainer clips gradients (``gradient_clip_val`` set and > 0).
        safe_eps: the eps an ``eps_underflow`` fix raises to (at least the dtype's smallest normal).
        check_half_master: report ``half_master``.
    """
    out: list[Finding] = []
    for opt in optimizers:
        if opt.fused_with_scaler and clip:
            out.append(
                Finding(
                    code=Notice.FUSED_SCALER_CLIP,
                    opt_idx=opt.index,
                    group_idx=-1,
                    fixable=False,
                    message=(
                        f"optimizer {opt.index} ({opt.name}) is fused and runs with a GradScaler and gradient "
                        "clipping: Lightning will raise at the first step, because the fused kernel unscales the "
                        "gradients itself. Use fused=False, or drop gradient_clip_val."
                    ),
                )
            )
        half = sorted({str(d).replace("torch.", "") for g in opt.groups for d in g.dtypes if d in _HALF})
        if check_half_master and half:
            out.append(
                Finding(
                    code=Notice.HALF_MASTER,
                    opt_idx=opt.index,
                    group_idx=-1,
                    fixable=False,
                    values={"dtypes": half},
                    message=(
                        f"optimizer {opt.index} ({opt.name}) updates {'/'.join(half)} parameters with no float32 "
                        "master copy: updates below half an ulp of a weight are lost and the optimizer state is low "
                        "precision. If training stalls or goes non-finite, use precision='16-mixed' or 'bf16-mixed'."
                    ),
                )
            )
        for j, group in enumerate(opt.groups):
            if group.eps is None or group.fused:
                continue
            for dtype in group.dtypes:
                floor = min_safe_eps(dtype)
                if group.eps >= floor:
                    continue
                target = max(safe_eps, floor)
                as_dtype = float(torch.tensor(group.eps, dtype=dtype))
                name = str(dtype).replace("torch.", "")
                out.append(
                    Finding(
                        code=Notice.EPS_UNDERFLOW,
                        opt_idx=opt.index,
                        group_idx=j,
                        fixable=True,
                        fix_eps=target,
                        values={"eps": group.eps, "eps_in_dtype": as_dtype, "dtype": name, "eps_fixed": target},
                        message=(
                            f"optimizer {opt.index} ({opt.name}) group {j}: eps={group.eps:g} is "
                            f"{'0' if as_dtype == 0 else 'subnormal (' + format(as_dtype, 'g') + ')'} in {name}, "
                            f"below its smallest normal {floor:g}; the non-fused update divides by (almost) zero and "
                            f"the parameters go non-finite. Set eps>={target:g}, use fused=True, or train in "
                            "'16-mixed'."
                        ),
                    )
                )
                break
    return out

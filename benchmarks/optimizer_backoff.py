"""What OptimizerBackoff costs: its healthy-path hook, a backoff, and the preflight, on a 292-tensor optimizer.

Plain python, not a test: ``PYTHONPATH=$PWD python benchmarks/optimizer_backoff.py``. CPU (process) time, 1 thread.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from lightning_nanguard import OptimizerBackoff
from lightning_nanguard.policies.preflight import GroupInfo, OptimizerInfo, preflight_findings
from lightning_nanguard.recovery.backoff import eps_metrics, scale_schedule, sync_lr_scale

torch.set_num_threads(1)
warnings.filterwarnings("ignore")


def _per_call_us(fn: Callable[[], object], reps: int = 2000) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - t0) / reps)
    return best * 1e6


def main() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(146)])  # 292 tensors, like gpt_deep
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
    seq = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=10),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, 100),
        ],
        milestones=[10],
    )
    scheds = [seq]

    cb = OptimizerBackoff()

    rows = [
        ("sync_lr_scale, already in sync (re-apply check)", _per_call_us(lambda: sync_lr_scale(opt, scheds, 1.0))),
        (
            "scale_schedule x0.5 then x2 (two backoffs)",
            _per_call_us(lambda: (scale_schedule(opt, scheds, 0.5), scale_schedule(opt, scheds, 2.0))),
        ),
        ("eps_metrics (logged steps only)", _per_call_us(lambda: eps_metrics([opt], "nanguard/eps"))),
    ]
    info = [OptimizerInfo(0, "AdamW", tuple(GroupInfo(1e-8, False, (torch.float16,)) for _ in opt.param_groups))]
    rows.append(
        (
            "preflight_findings (once per fit)",
            _per_call_us(lambda: preflight_findings(info, clip=False, safe_eps=1e-4), reps=200),
        )
    )
    rows.append(("policy tick, healthy step (every step)", _per_call_us(lambda: cb._policy.tick(10))))

    print(f"{'what':<52} {'us/call':>10}")
    for name, us in rows:
        print(f"{name:<52} {us:>10.1f}")


if __name__ == "__main__":
    main()

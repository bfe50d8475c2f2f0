"""Optimizer and learning-rate schedule shared by the SFT and RL trainers."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

LR_SCHEDULES = ("constant", "cosine")


def lr_lambda(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the base lr at ``step``: linear warm-up over ``warmup_steps``, then constant or cosine
    decay to ``min_lr_ratio`` at ``total_steps``: ``min + (1 - min) * (1 + cos(pi * progress)) / 2``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected one of {LR_SCHEDULES}")
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(
    params_and_lrs: list[tuple[Iterable[torch.nn.Parameter], float]],
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    warmup_steps: int = 0,
    total_steps: int = 1,
    schedule: str = "constant",
    min_lr_ratio: float = 0.0,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over one or more (parameters, lr) sets (policy, critic), plus a LambdaLR stepped once per
    trainer step that scales every set's lr alike. Norms and biases get no weight decay."""
    groups = []
    for params, lr in params_and_lrs:
        params = [p for p in params if p.requires_grad]
        groups.append({"params": [p for p in params if p.ndim >= 2], "lr": lr, "weight_decay": weight_decay})
        groups.append({"params": [p for p in params if p.ndim < 2], "lr": lr, "weight_decay": 0.0})
    # Fused and foreach kernels need all-plain or all-DTensor parameters (tensor parallelism alone leaves norms
    # plain: then the per-tensor loop). Fused is the fastest (on CPU 3.4x foreach's step for the built-in model).
    params = [p for g in groups for p in g["params"]]
    uniform = len({isinstance(p, DTensor) for p in params}) == 1
    if uniform and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params):
        optimizer = torch.optim.AdamW(groups, betas=tuple(betas), fused=True)
    else:
        optimizer = torch.optim.AdamW(groups, betas=tuple(betas), foreach=uniform)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, warmup_steps, total_steps, schedule, min_lr_ratio)
    )
    return optimizer, scheduler

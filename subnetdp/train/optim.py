"""Optimizers by name and learning-rate schedules (warm-up, then cosine or constant)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterable

import torch

from subnetdp.core.errors import ConfigError


def check_config(cfg: Any) -> None:
    """``optim.*`` across keys: two Adam betas in [0, 1), and a warm-up no longer than the run (a
    longer one never reaches ``optim.lr``). Single-key ranges are declared with the fields."""
    betas = list(cfg.optim.betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError("optim.betas", betas, "must be two numbers in [0, 1)", "write optim.betas=[0.9,0.999]")
    warmup, steps = cfg.optim.warmup_steps, cfg.train.steps
    if warmup > steps:
        raise ConfigError("optim.warmup_steps", warmup, f"must be in [0, train.steps={steps}]: a longer warm-up "
                          "never reaches optim.lr", f"use optim.warmup_steps={steps} or less (0 starts at the full "
                          f"learning rate), or train.steps={warmup} or more")


def build_optimizer(cfg: Any, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``torch.optim`` by ``optim.name`` (``sgd``, ``adamw``, ``adam``)."""
    params = [p for p in params if p.requires_grad]
    name = cfg.name
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[name]
    return cls(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of ``optim.lr`` before optimizer step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_schedule(cfg: Any, optimizer: torch.optim.Optimizer, total_steps: int,
                   start: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule of ``optimizer``, at step ``start`` (a rebuilt optimizer keeps the run's
    position): made there, as ``start`` calls of ``step()`` would leave it (the factor depends on the step
    alone), without making them (a re-plan at step 100,000 would have paid 100,000 of them)."""
    warmup, schedule = int(cfg.warmup_steps), str(cfg.schedule)  # read once: the factor runs every step

    def factor(s: int) -> float:
        return lr_factor(s, total_steps, warmup, schedule)

    if start > 0:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its first step comes before the optimizer's
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start - 1)

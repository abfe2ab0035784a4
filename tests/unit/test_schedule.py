"""The learning-rate schedule a rebuilt optimizer starts at the run's position with (``build_schedule``):
what stepping the schedule there would give, made at once (a re-plan late in a long run paid one
``step()`` per step before)."""

from __future__ import annotations

import warnings

import pytest
import torch
from omegaconf import OmegaConf

from subnetdp.train.optim import build_schedule, lr_factor


def _stepped(cfg, optimizer, total, start):
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, cfg.warmup_steps, cfg.schedule))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(start):
            scheduler.step()
    return scheduler


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
@pytest.mark.parametrize("start", [0, 1, 4, 5, 23, 40])
def test_a_schedule_made_at_a_step_is_the_one_stepped_there(schedule, start):
    cfg = OmegaConf.create({"warmup_steps": 5, "schedule": schedule})
    p = torch.nn.Parameter(torch.zeros(3))
    a, b = torch.optim.AdamW([p], lr=0.1), torch.optim.AdamW([p], lr=0.1)
    stepped, made = _stepped(cfg, a, 40, start), build_schedule(cfg, b, 40, start=start)
    for _ in range(6):  # then both go on alike
        assert b.param_groups[0]["lr"] == a.param_groups[0]["lr"] and made.last_epoch == stepped.last_epoch
        a.step(), b.step(), stepped.step(), made.step()
    assert made.base_lrs == stepped.base_lrs == [0.1]


def test_a_schedule_made_late_in_a_long_run_takes_no_step_per_step_before(monkeypatch):
    import subnetdp.train.optim as optim

    calls = []
    monkeypatch.setattr(optim, "lr_factor", lambda s, *a: calls.append(s) or lr_factor(s, *a))
    cfg = OmegaConf.create({"warmup_steps": 100, "schedule": "cosine"})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    made = build_schedule(cfg, optimizer, 10**6, start=750_000)
    assert calls == [750_000]  # made there: the factor asked once, at that step (stepping there asked 750,001 times)
    made.step()
    assert calls == [750_000, 750_001] and made.last_epoch == 750_001
    assert optimizer.param_groups[0]["lr"] == lr_factor(750_001, 10**6, 100, "cosine")

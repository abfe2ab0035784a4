"""What a plan's subnetworks cost in FLOPs against the full model, counted on ``meta``.

A rank trains its subnetwork; the method's quality claims are made at equal compute, so a run that
should match DDP's training FLOPs takes ``round(steps / ratio)`` steps, where ``ratio`` is the mean
over ranks of a rank's training-step FLOPs (forward and backward, one micro-batch) over the full
model's. The counts come from :class:`torch.utils.flop_counter.FlopCounterMode` running the models
on the ``meta`` device with a batch of the loaders' shapes: nothing is allocated or computed, the
counts are those of the real shapes, and every rank (and ``subnetdp plan``) gets the same figure.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from subnetdp.core.contracts import ModelAdapter, Partition
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.variants import local_model


@dataclass(frozen=True)
class FlopRatios:
    """Per-rank FLOPs of a plan relative to the full model (forward, and forward + backward)."""

    forward: float  # mean over ranks of rank forward / full forward
    train_step: float  # mean over ranks of rank (forward + backward) / full (forward + backward)
    full_forward: int  # the full model's forward FLOPs on one micro-batch
    full_train_step: int
    per_rank_train_step: tuple[float, ...]

    def matched_steps(self, steps: int) -> int:
        """The step count whose training FLOPs equal ``steps`` steps of the full model (at least ``steps``
        when every rank trains less than the full model)."""
        return max(1, round(steps / self.train_step))

    def to_dict(self) -> dict[str, Any]:
        return {"forward": self.forward, "train_step": self.train_step, "full_forward": self.full_forward,
                "full_train_step": self.full_train_step, "per_rank_train_step": list(self.per_rank_train_step)}


def step_flops(adapter: ModelAdapter, model: nn.Module, batch: Sequence[Any]) -> tuple[int, int]:
    """FLOPs of ``model``'s forward, and of forward + backward, on ``batch`` (all on ``meta``)."""
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    # One forward, counted on its own, then its backward: the step is their sum (a second forward
    # would count the same operations again and cost a third of the count's time in every worker).
    with FlopCounterMode(display=False) as fwd:
        loss = adapter.loss(model(adapter.inputs(batch)), batch)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), fwd.get_total_flops() + bwd.get_total_flops()


def _shape_key(partition: Partition, owned: Sequence[int]) -> tuple:
    """What a rank's FLOPs depend on: the group and the slice shapes of each unit it owns."""
    return tuple((partition.units[u].group, tuple((s.name, s.dim, s.stop - s.start) for s in partition.units[u].slices))
                 for u in owned)


def plan_flops(adapter: ModelAdapter, full: nn.Module, partition: Partition, plan: MaskPlan, mcfg: Any,
               batch: Sequence[Any]) -> FlopRatios:
    """The plan's FLOP ratios. ``full`` is the full model on ``meta`` (left untouched); ``batch`` one
    micro-batch of the loaders' shapes (moved to ``meta`` here). Ranks whose subnetworks have the same
    shapes are counted once."""
    batch = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in batch)
    full_fwd, full_step = step_flops(adapter, copy.deepcopy(full), batch)
    seen: dict[tuple, tuple[int, int]] = {}
    # A rank that owns every unit holds the full model (C = 1): its count is the one just made.
    seen[_shape_key(partition, range(len(partition.units)))] = (full_fwd, full_step)
    fwd, step = [], []
    for owned in plan.owned:
        key = _shape_key(partition, owned)
        if key not in seen:
            with torch.device("meta"):  # modules made while narrowing stay on meta too
                model, _ = local_model(adapter, copy.deepcopy(full), owned, partition, mcfg)
            seen[key] = step_flops(adapter, model, batch)
        fwd.append(seen[key][0] / full_fwd)
        step.append(seen[key][1] / full_step)
    return FlopRatios(sum(fwd) / len(fwd), sum(step) / len(step), int(full_fwd), int(full_step), tuple(step))

"""Re-drawing the mask plan every ``masker.resample_every`` steps, from a family fixed at set-up.

The family is the masker's plan rotated within each group: member ``d`` gives every rank the units
``d`` places further along in each group (``ids[(i + d) mod K_g]`` for the base plan's
``ids[i]``). Rotation moves whole owner sets from unit to unit, so every member has exactly the base
plan's owner sets and every group the run will ever need exists from the start.

At a re-draw every rank rebuilds its model for the new plan. A unit's values come from its previous
``min(owners)`` (a broadcast over the world, unit by unit). Optimizer state starts **fresh on every
rank** (documented choice): handing over only the moved units' state would leave the owners of a
unit with different state histories, and the invariant that all owners of a unit hold bit-identical
state would break; a fresh start keeps it at the cost of re-warming momentum every
``resample_every`` steps.
"""

from __future__ import annotations

import random
from typing import Any

from subnetdp.core.contracts import Partition
from subnetdp.core.plan import MaskPlan, group_units


def rotated(plan: MaskPlan, partition: Partition, offset: int, group_by: str = "auto") -> MaskPlan:
    """Family member ``offset``: every rank's units moved ``offset`` places along their group."""
    where: dict[int, tuple[list[int], int]] = {}
    for ids in group_units(partition, group_by).values():
        for i, u in enumerate(ids):
            where[u] = (ids, i)
    owned = []
    for units in plan.owned:
        moved = []
        for u in units:
            ids, i = where[u]
            moved.append(ids[(i + offset) % len(ids)])
        owned.append(moved)
    return MaskPlan(plan.world_size, owned, plan.num_units)


def family_size(partition: Partition, group_by: str = "auto") -> int:
    """Number of distinct rotations worth drawing: the largest group's size."""
    return max((len(ids) for ids in group_units(partition, group_by).values()), default=1)


def draw(plan: MaskPlan, partition: Partition, seed: int, index: int, group_by: str = "auto") -> MaskPlan:
    """The plan for re-draw ``index`` (0 = the base plan): a seeded offset, identical on every rank."""
    if index == 0:
        return plan
    offset = random.Random(f"{seed}:{index}").randrange(family_size(partition, group_by))
    return rotated(plan, partition, offset, group_by)


def family(plan: MaskPlan, partition: Partition, group_by: str = "auto") -> list[MaskPlan]:
    """Every member of the family, offset 0 first."""
    return [rotated(plan, partition, d, group_by) for d in range(family_size(partition, group_by))]


def group_by_of(mcfg: Any) -> str:
    return str(mcfg.group_by)


class Resampler:
    """Re-draws the plan every ``every`` steps and rebuilds this rank's model for it.

    Args:
        adapter, spec, seed: to rebuild the full model's structure on CPU (values are then copied in).
        partition: the partition.
        base: the plan drawn at set-up (family member 0).
        mcfg: the ``masker`` config (granularity, regime, rescale).
        comm: the communicator.
        every: ``masker.resample_every`` (> 0).
    """

    def __init__(self, adapter: Any, spec: Any, seed: int, partition: Partition, base: MaskPlan, mcfg: Any,
                 comm: Any, every: int) -> None:
        self.adapter, self.spec, self.seed = adapter, spec, seed
        self.partition, self.base, self.mcfg, self.comm = partition, base, mcfg, comm
        self.every = int(every)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def redraw(self, step: int, model: Any, pmap: Any, plan: MaskPlan) -> tuple[Any, Any, MaskPlan]:
        """The new plan and this rank's model for it, holding the current values of every piece.

        A piece a new owner did not hold comes from its previous ``min(owners)`` by a broadcast over
        the world, piece by piece, in global order. Collective: every rank calls it.
        """
        import torch

        from subnetdp.core.errors import SubnetdpError
        from subnetdp.sdp.construct import meta_model, poison, poisoned, to_empty
        from subnetdp.sdp.pieces import LocalIndex, global_items
        from subnetdp.sdp.variants import local_model

        new_plan = draw(self.base, self.partition, self.seed, step // self.every, group_by_of(self.mcfg))
        device = next(model.parameters()).device
        with torch.device("meta"):  # structure only: every value is received or copied below
            new_model, new_pmap = local_model(self.adapter, meta_model(self.adapter, self.spec),
                                              new_plan.owned[self.comm.rank], self.partition, self.mcfg)
        to_empty(new_model, device)
        poison(new_model)  # so a tensor the loop below leaves unset is an error, not garbage
        old_index, new_index = LocalIndex(model, pmap), LocalIndex(new_model, new_pmap)
        rank = self.comm.rank
        with torch.no_grad():
            for item in global_items(self.partition, plan) + global_items(self.partition, plan, buffers=True):
                old = item.owners
                new = old if item.unit is None else new_plan.owners(item.unit)
                if set(new) <= set(old):
                    # Nobody new: a holder keeps its own copy (with backward masking every rank holds
                    # every piece, owned or not, so the model it runs stays the current one).
                    if new_index.holds(item):
                        new_index.view(item).copy_(old_index.view(item))
                    continue
                dtype = self.partition.dtypes[item.name]
                buf = (old_index.view(item).contiguous().clone() if rank == old[0]
                       else torch.empty(item.shape, dtype=dtype, device=device))
                # collective: every rank joins the broadcast of a piece that changes hands.
                self.comm.broadcast(buf, old[0])
                if new_index.holds(item):
                    new_index.view(item).copy_(buf)
        unset = poisoned(new_model)
        if unset:
            raise SubnetdpError(f"re-drawing the plan at step {step} left {unset[:3]} of rank {rank}'s new model unset")
        return new_model, new_pmap, new_plan

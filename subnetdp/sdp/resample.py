"""Re-drawing the mask plan every ``masker.resample_every`` steps, from a family fixed at set-up.

The family is the masker's plan rotated within each group: member ``d`` gives every rank the units
``d`` places further along in each group (``ids[(i + d) mod K_g]`` for the base plan's
``ids[i]``). Rotation moves whole owner sets from unit to unit, so every member has exactly the base
plan's owner sets and every group the run will ever need exists from the start.

At a re-draw every rank rebuilds its model for the new plan
(:meth:`subnetdp.train.state.TrainState.replan`); a unit's values come from its previous
``min(owners)`` (:func:`receive_from_owners`: a broadcast over the world, unit by unit). Optimizer state starts **fresh on every
rank** (documented choice): handing over only the moved units' state would leave the owners of a
unit with different state histories, and the invariant that all owners of a unit hold bit-identical
state would break; a fresh start keeps it at the cost of re-warming momentum every
``resample_every`` steps.
"""

from __future__ import annotations

import random
import torch

from subnetdp.core.contracts import Communicator, Partition
from subnetdp.core.plan import MaskPlan, group_units
from subnetdp.sdp.pieces import LocalIndex, global_items


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


class Resampler:
    """Which plan of the family holds after a step: a re-draw every ``every`` steps.

    Args:
        partition: the partition.
        base: the plan drawn at set-up (family member 0).
        seed: the run's seed (which member each re-draw takes).
        every: ``masker.resample_every`` (> 0).
        group_by: ``masker.group_by``: the groups units rotate within.
    """

    def __init__(self, partition: Partition, base: MaskPlan, seed: int, every: int, group_by: str = "auto") -> None:
        self.partition, self.base, self.seed = partition, base, seed
        self.every, self.group_by = int(every), group_by

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def plan_at(self, step: int) -> MaskPlan:
        """The plan for the steps after ``step``. The same on every rank."""
        return draw(self.base, self.partition, self.seed, step // self.every, self.group_by)


def receive_from_owners(partition: Partition, old: LocalIndex, old_plan: MaskPlan, new: LocalIndex,
                        new_plan: MaskPlan, comm: Communicator) -> None:
    """Fill ``new`` (this rank's model under ``new_plan``) with the current value of every piece it holds.

    A piece whose owners did not change, or that a rank held already, is copied from ``old``; a piece
    a new owner did not hold comes from its previous ``min(owners)`` by a broadcast over the world,
    piece by piece, in global order. Collective: every rank calls it, with the same plans.
    """
    rank = comm.rank
    with torch.no_grad():
        for item in global_items(partition, old_plan) + global_items(partition, old_plan, buffers=True):
            owners = item.owners
            gaining = owners if item.unit is None else new_plan.owners(item.unit)
            if set(gaining) <= set(owners):
                # Nobody new: a holder keeps its own copy (with backward masking every rank holds
                # every piece, owned or not, so the model it runs stays the current one).
                if new.holds(item):
                    new.view(item).copy_(old.view(item))
                continue
            buf = (old.view(item).contiguous().clone() if rank == owners[0]
                   else torch.empty(item.shape, dtype=partition.dtypes[item.name], device=comm.device))
            # collective: every rank joins the broadcast of a piece that changes hands.
            comm.broadcast(buf, owners[0])
            if new.holds(item):
                new.view(item).copy_(buf)

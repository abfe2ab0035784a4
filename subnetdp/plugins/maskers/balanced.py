"""Masker ``balanced``: every rank's total compute cost as equal as possible.

For units of unequal cost (the adapter gives each unit's forward FLOPs per sample), every unit gets
``k = max(masker.min_owners, floor(C * W + 0.5))`` owners, chosen greedily, most expensive unit
first, among the ranks with the least cost so far (longest-processing-time scheduling). Loads carry
over from group to group, so ranks end with nearly equal total cost and no rank straggles; a rank may
then hold more units of one group than another rank (``n_g`` differs between ranks). The plan
reports each rank's cost (``cost_per_rank`` in ``plan.json`` and ``subnetdp plan``).
"""

from __future__ import annotations

from subnetdp import MaskPlan, Masker, MaskerConfig, Partition, group_units, hookimpl, units_kept


class BalancedMasker(Masker):
    """Cost-balanced unit sets (greedy longest-processing-time over the adapter's unit costs)."""

    Config = MaskerConfig
    ignores = {"capacity": "it sets owner counts from the units' costs, not per-rank coverages"}

    def plan(self, partition: Partition, world_size: int, seed: int) -> MaskPlan:
        k = min(world_size, max(self.cfg.min_owners, units_kept(self.cfg.coverage, world_size)))
        owned: list[list[int]] = [[] for _ in range(world_size)]
        load = [0.0] * world_size
        for ids in group_units(partition, self.cfg.group_by).values():
            in_group = [0] * world_size
            for u in sorted(ids, key=lambda i: (-partition.units[i].cost, i)):
                # Least-loaded ranks first; among equals, those holding fewest units of this group.
                ranks = sorted(range(world_size), key=lambda r: (round(load[r], 6), in_group[r], r))[:k]
                for r in ranks:
                    owned[r].append(u)
                    load[r] += partition.units[u].cost
                    in_group[r] += 1
        return MaskPlan(world_size, owned, len(partition.units))


@hookimpl
def subnetdp_register_maskers(registry) -> None:
    registry.add("balanced", BalancedMasker)

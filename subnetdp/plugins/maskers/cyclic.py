"""Masker ``cyclic``: contiguous runs of units, starting points spread evenly over the ranks.

In group g with K_g units, rank r owns units ``(floor(r * K_g / W) + t) mod K_g`` for
``t < n_g``, ``n_g = max(1, floor(C * K_g + 0.5))``. Deterministic, as even as integers allow, and
at most W distinct owner sets per group, so few owner groups have to be created.

Heterogeneous ranks (``masker.capacity``, one coverage per rank): rank r keeps
``n_g(r) = max(1, floor(c_r * K_g + 0.5))`` units, starting at ``floor(K_g * sum_{q<r} n_g(q) / sum_q n_g(q))``,
so the runs tile the cycle in proportion to their lengths (equal capacities give the formula above).
"""

from __future__ import annotations

from subnetdp import MaskPlan, Masker, MaskerConfig, Partition, group_units, hookimpl, rank_coverages, units_kept


class CyclicMasker(Masker):
    """Every rank keeps a contiguous (cyclic) run of ``n_g`` units of every group."""

    Config = MaskerConfig

    def plan(self, partition: Partition, world_size: int, seed: int) -> MaskPlan:
        owned: list[list[int]] = [[] for _ in range(world_size)]
        coverages = rank_coverages(self.cfg, world_size)
        for ids in group_units(partition, self.cfg.group_by).values():
            k = len(ids)
            n = [units_kept(c, k) for c in coverages]
            total, before = sum(n), 0
            for r in range(world_size):
                start = (k * before) // total
                before += n[r]
                owned[r].extend(ids[(start + t) % k] for t in range(n[r]))
        return MaskPlan(world_size, owned, len(partition.units))


@hookimpl
def subnetdp_register_maskers(registry) -> None:
    registry.add("cyclic", CyclicMasker)

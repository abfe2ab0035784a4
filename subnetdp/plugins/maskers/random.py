"""Masker ``random``: seeded random unit sets with owner counts as even as possible.

In group g every rank draws ``n_g = max(1, floor(C * K_g + 0.5))`` distinct units. Ranks draw one
after another in a seeded random order, each taking the units with the fewest owners so far (ties
broken at random), so owner counts within a group differ by at most one: every unit is owned by as
close to ``C x W`` ranks as integers allow. Pure function of (partition, world size, config, seed).
"""

from __future__ import annotations

import hashlib

import numpy as np

from subnetdp import MaskPlan, Masker, MaskerConfig, Partition, group_units, hookimpl, rank_coverages, units_kept


def group_rng(seed: int, group: str) -> np.random.Generator:
    """A generator that depends only on the seed and the group's name."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{group}".encode()).digest()[:8], "little")
    return np.random.default_rng(h)


class RandomMasker(Masker):
    """Seeded random subsets, balanced in owner counts."""

    Config = MaskerConfig

    def plan(self, partition: Partition, world_size: int, seed: int) -> MaskPlan:
        owned: list[list[int]] = [[] for _ in range(world_size)]
        coverages = rank_coverages(self.cfg, world_size)
        for name, ids in group_units(partition, self.cfg.group_by).items():
            rng = group_rng(seed, name)
            k = len(ids)
            n = [units_kept(c, k) for c in coverages]  # masker.capacity: one coverage per rank
            counts = np.zeros(k)
            for r in rng.permutation(world_size):
                order = np.lexsort((rng.random(k), counts))  # fewest owners first, random ties
                chosen = np.sort(order[:n[int(r)]])
                counts[chosen] += 1
                owned[int(r)].extend(ids[int(i)] for i in chosen)
        return MaskPlan(world_size, owned, len(partition.units))


@hookimpl
def subnetdp_register_maskers(registry) -> None:
    registry.add("random", RandomMasker)

"""Masker ``cyclic``: contiguous runs of units, starting points spread evenly over the ranks.

In group g with K_g units, rank r owns units ``(floor(r * K_g / W) + t) mod K_g`` for
``t < n_g``, ``n_g = max(1, floor(C * K_g + 0.5))``. Deterministic, as even as integers allow, and
at most W distinct owner sets per group, so few owner groups have to be created.

Heterogeneous ranks (``masker.capacity``, one coverage per rank): rank r keeps
``n_g(r) = max(1, floor(c_r * K_g + 0.5))`` units, starting at ``floor(K_g * sum_{q<r} n_g(q) / sum_q n_g(q))``,
so the runs tile the cycle in proportion to their lengths (equal capacities give the formula above).
"""

from __future__ import annotations

from subnetdp.core.contracts import Masker, MaskerConfig, Partition
from subnetdp.core.errors import ConfigError, suggest
from subnetdp.core.hookspecs import hookimpl
from subnetdp.core.plan import GROUP_BY, MaskPlan, group_units, rank_coverages, units_kept


class CyclicMasker(Masker):
    """Every rank keeps a contiguous (cyclic) run of ``n_g`` units of every group."""

    Config = MaskerConfig

    @classmethod
    def validate_config(cls, cfg, root) -> None:
        if cfg.group_by not in GROUP_BY:
            raise ConfigError("masker.group_by", cfg.group_by, f"valid choices: {', '.join(GROUP_BY)}"
                              + suggest(cfg.group_by, GROUP_BY))
        for c in cfg.get("capacity") or []:
            if not 0.0 < float(c) <= 1.0:
                raise ConfigError("masker.capacity", list(cfg.capacity), f"holds {c}: every entry must be in (0, 1]",
                                  "give each rank a coverage such as 0.5 (1 = the whole model)")

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

"""Masker ``strided``: in each group, rank r keeps units r, r+W, r+2W, ... (plus ``masker.offset``).

In group g with K_g units, rank r walks the group from position ``(r + offset) mod K_g`` in steps
of the world size W, wrapping round the group. When a lap would come back to its start, the next lap
begins one position further on, so a rank never takes a unit twice. It stops at
``n_g = units_kept(coverage, K_g)`` units.

This module is the whole plugin: the entry point ``strided`` in ``pyproject.toml`` names it, and
subnetdp calls the ``@hookimpl`` functions below. Copy it, rename it, and change ``plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from subnetdp import (ConfigError, Masker, MaskerConfig, MaskPlan, Partition, Registry, RunContext, TrainStateView,
                      group_units, hookimpl, units_kept)

NAME = "strided"  # what a config selects: masker.name=strided


def strided_positions(start: int, stride: int, k: int, n: int) -> list[int]:
    """The first ``n`` positions (of ``k``) visited from ``start`` in steps of ``stride``, one lap each."""
    # Distance from the start decides the order: first every stride-th unit, then the next lap.
    order = sorted(range(k), key=lambda d: (d % stride, d))
    return [(start + d) % k for d in order[:n]]


class StridedMasker(Masker):
    """Every rank keeps every W-th unit of each group, starting at its own rank (plus an offset)."""

    @dataclass
    class Config(MaskerConfig):
        """``masker.*`` keys: the ones every masker shares, plus this masker's own."""

        offset: int = 0  # shifts every rank's starting unit; masker.offset=1 starts rank r at unit r+1

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        """Reject bad values before any process starts (``cfg`` is ``masker``, ``root`` the whole config)."""
        if cfg.offset < 0:
            raise ConfigError("masker.offset", cfg.offset, "must be >= 0", "use e.g. masker.offset=1")

    def plan(self, partition: Partition, world_size: int, seed: int) -> MaskPlan:
        # A pure function of its arguments: every rank computes the same plan without talking.
        owned: list[list[int]] = [[] for _ in range(world_size)]
        for ids in group_units(partition, self.cfg.group_by).values():
            k = len(ids)
            n = units_kept(float(self.cfg.coverage), k)
            for r in range(world_size):
                start = (r + int(self.cfg.offset)) % k
                owned[r].extend(ids[p] for p in strided_positions(start, world_size, k, n))
        return MaskPlan(world_size, owned, len(partition.units))


@hookimpl
def subnetdp_register_maskers(registry: Registry) -> None:
    registry.add(NAME, StridedMasker)


@hookimpl
def subnetdp_on_run_end(context: RunContext, state: TrainStateView) -> None:
    """Print the plan's digest once (rank 0), and only in runs that use this masker.

    A lifecycle hook takes the keyword parameters it needs (here not ``result``), all read-only.
    """
    if context.rank != 0 or context.cfg.masker.name != NAME:
        return
    plan = state.plan
    kept = len(plan.owned[0])
    print(f"strided: plan {plan.digest()}, offset {context.cfg.masker.offset}: "
          f"rank 0 kept {kept} of {plan.num_units} units", flush=True)

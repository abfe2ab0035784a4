"""Owners prove they agree: a digest of every unit's bytes, compared among its owners, the odd one repaired.

The synchroniser's invariant is that all owners of a unit hold bit-identical values and optimizer
state after every step. Silent data corruption (a flipped bit in memory, a faulty device) breaks it
without any error: the owners then train apart, and the checkpoint keeps whichever copy its writer
held. :func:`unit_digests` hashes, on each rank, every unit it owns (shared tensors are one more
unit, owned by every rank): its parameter pieces and their optimizer state, as raw bytes.

Why blake2b over the bytes rather than a sum of values: a sum of floats can absorb a flipped low
mantissa bit (rounding) and is blind to reorderings; a cryptographic digest of the exact bytes
changes for any single flipped bit (for any change at all, up to a 2**-64 collision with 8-byte
digests), costs about one pass over memory on the host, and needs no exact reduction.

Buffers are left out on purpose: BatchNorm running statistics are per rank by design (each owner
sees its own data; the union model averages them, docs/union_eval.md), so owners' buffers differ.

:func:`compare` gathers one small dict per rank over the world (8 bytes per owned unit, no tensor
traffic), so every rank reaches the same verdict from the same data, and :func:`repair` makes the
majority's bytes those of the odd owners by a broadcast over each disagreeing unit's owner group.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from subnetdp.core.contracts import Communicator, ParamMap, Partition
from subnetdp.core.errors import SubnetdpError
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.pieces import LocalIndex, global_items

SHARED = -1  # the unit id that stands for the shared tensors (owned by every rank)
DIGEST_BYTES = 8


class OwnersDisagree(SubnetdpError):
    """Owners of a unit hold different bytes and no majority can repair them (two owners, or a tie)."""


def unit_name(unit: int) -> str:
    return "the shared tensors" if unit == SHARED else f"unit {unit}"


@dataclass
class Mismatch:
    """One unit whose owners disagree: ``groups`` maps each digest (hex) to the ranks holding it."""

    unit: int
    owners: tuple[int, ...]
    groups: dict[str, list[int]]

    @property
    def majority(self) -> list[int] | None:
        """The ranks of a strict majority digest, or None (two owners, or no digest held by more than half)."""
        best = max(self.groups.values(), key=len)
        return sorted(best) if len(best) * 2 > len(self.owners) else None

    @property
    def odd(self) -> list[int]:
        keep = set(self.majority or ())
        return sorted(r for r in self.owners if r not in keep)

    def line(self, step: int) -> str:
        held = "; ".join(f"ranks {g} hold {d}" for d, g in sorted(self.groups.items(), key=lambda x: x[1]))
        return f"owners of {unit_name(self.unit)} (ranks {list(self.owners)}) disagree after step {step}: {held}"


@dataclass
class Verdict:
    """What one verification found: every unit compared, and those whose owners disagree."""

    units: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def repairable(self) -> bool:
        return all(m.majority is not None for m in self.mismatches)


def unit_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, pmap: ParamMap, partition: Partition,
                  plan: MaskPlan, rank: int) -> Iterator[tuple[int, tuple[int, ...], str, torch.Tensor]]:
    """``(unit, owners, key, view)`` of every parameter piece this rank owns and of its optimizer state,
    in the same global order on every owner (local layouts may differ, the items do not)."""
    index = LocalIndex(model, pmap)
    params = dict(model.named_parameters())
    for it in global_items(partition, plan):
        if rank not in it.owners:
            continue
        found = index.find(it)
        if found is None:
            raise RuntimeError(f"rank {rank} owns {it.name} but does not hold it (model and plan disagree)")
        local, dim, start, stop = found
        unit = SHARED if it.unit is None else it.unit
        key = f"{it.name}[{it.dim}:{it.start}:{it.stop}]"
        param = params[local]
        yield unit, it.owners, key, param if dim is None else param.narrow(dim, start, stop - start)
        state = optimizer.state.get(param, {})
        for name in sorted(state):
            v = state[name]
            if not isinstance(v, torch.Tensor):
                continue  # None (SGD without momentum): nothing to compare
            if dim is not None and v.dim() > 0 and tuple(v.shape) == tuple(param.shape):
                v = v.narrow(dim, start, stop - start)
            yield unit, it.owners, f"{key}/{name}", v


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def unit_digests(model: nn.Module, optimizer: torch.optim.Optimizer, pmap: ParamMap, partition: Partition,
                 plan: MaskPlan, rank: int) -> dict[int, bytes]:
    """Unit id (:data:`SHARED` for the shared tensors) -> blake2b digest of the bytes this rank holds for it."""
    hashes: dict[int, Any] = {}
    for unit, _, key, t in unit_tensors(model, optimizer, pmap, partition, plan, rank):
        h = hashes.setdefault(unit, hashlib.blake2b(digest_size=DIGEST_BYTES))
        h.update(key.encode())  # names too: a piece moved to another place is a different state
        h.update(_bytes(t))
    return {u: h.digest() for u, h in hashes.items()}


def compare(comm: Communicator, plan: MaskPlan, mine: dict[int, bytes]) -> Verdict:
    """Gather every rank's digests and find the units whose owners disagree (the same verdict on every rank)."""
    gathered = comm.all_gather_object(mine)  # collective: every rank reaches this (a few bytes per owned unit)
    verdict = Verdict()
    world = tuple(range(plan.world_size))
    for unit in [SHARED, *range(plan.num_units)]:
        owners = world if unit == SHARED else tuple(plan.owners(unit))
        groups: dict[str, list[int]] = {}
        for r in owners:
            d = gathered[r].get(unit)
            groups.setdefault(d.hex() if d is not None else "nothing", []).append(r)
        verdict.units += 1
        if len(groups) > 1:
            verdict.mismatches.append(Mismatch(unit, owners, groups))
    return verdict


def repair(comm: Communicator, model: nn.Module, optimizer: torch.optim.Optimizer, pmap: ParamMap,
           partition: Partition, plan: MaskPlan, mismatches: Sequence[Mismatch]) -> None:
    """Give each disagreeing unit's odd owners the majority's values and optimizer state.

    One majority owner (the lowest rank) broadcasts every tensor of the unit over the unit's owner
    group; every rank walks the same mismatches in the same order, so the groups meet.
    """
    rank = comm.rank
    for m in sorted(mismatches, key=lambda m: m.unit):
        src = min(m.majority or ())
        group = None if m.unit == SHARED else list(m.owners)
        if group is not None:
            comm.new_group(group)  # collective: every rank, in this order (a no-op for a group that exists)
        if rank not in m.owners:
            continue
        with torch.no_grad():
            for unit, _, _, view in unit_tensors(model, optimizer, pmap, partition, plan, rank):
                if unit != m.unit:
                    continue
                buf = view.detach().contiguous()
                comm.broadcast(buf, src, group)  # collective: every owner of the unit, tensor by tensor
                if buf.data_ptr() != view.data_ptr():
                    view.copy_(buf)

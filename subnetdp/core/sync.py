"""Owner-group gradient averaging.

Every parameter of a rank's subnetwork belongs to a unit (owned by ``plan.owners(u)``) or is shared
(owned by the world). Gradients live in flat buckets, one set of buckets per owner set; each
parameter's ``.grad`` is a view into its bucket (as DDP's ``gradient_as_bucket_view``), so the
buckets cost no memory beyond the gradients themselves. A bucket is all-reduced over its owner group
as soon as backward has produced all of its gradients (post-accumulate-grad hooks), so
communication overlaps the rest of backward, then divided by the owner count.

Which tensors go to which bucket is computed once, from global information (the partition and the
plan), so every member of an owner set builds the same buckets in the same order.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from subnetdp.core.contracts import Communicator, Handle, ParamMap, Partition
from subnetdp.core.errors import ConfigError
from subnetdp.core.plan import MaskPlan


@dataclass
class Bucket:
    """Gradients of several parameters that share one owner set, in one flat buffer."""

    owners: tuple[int, ...]
    params: list[nn.Parameter]
    names: list[str]
    buffer: torch.Tensor
    pending: int = 0
    launched: bool = False
    handle: Handle | None = None
    offsets: list[int] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.owners)


class OwnerGroupAverager:
    """Averages each gradient among exactly the ranks that own it.

    Use per step::

        averager.prepare()               # zero the buckets, point .grad at them
        loss.backward()                  # buckets launch from hooks as they fill
        averager.finish()                # wait, divide by owner counts
        norm = averager.clip_grad_norm_(max_norm)

    Args:
        model: the materialised subnetwork (on its device).
        pmap: its :class:`ParamMap` (local name -> global pieces).
        plan: the mask plan.
        partition: the full model's partition.
        comm: the communicator (already initialised).
        bucket_cap_mb: largest bucket, in MiB.
        max_groups: the most distinct owner sets that get their own process group.
    """

    def __init__(self, model: nn.Module, pmap: ParamMap, plan: MaskPlan, partition: Partition,
                 comm: Communicator, bucket_cap_mb: float = 25.0, max_groups: int = 64) -> None:
        self.comm = comm
        self.plan = plan
        self.rank = comm.rank
        self.world = tuple(range(comm.world_size))
        self._sync_enabled = True
        params = dict(model.named_parameters())
        for name, pieces in pmap.pieces.items():
            if name in params and any(p.dim is not None for p in pieces):
                raise NotImplementedError("sliced (neuron-level) parameters are not supported by this synchroniser yet")

        owner_sets = plan.owner_sets()
        if len(owner_sets) > max_groups:
            raise ConfigError("sync.max_groups", max_groups,
                              f"the plan has {len(owner_sets)} distinct owner sets",
                              f"set sync.max_groups={len(owner_sets)} or use the cyclic masker")
        # collective: every rank creates every owner group, in the same (sorted) order, members or not.
        for s in owner_sets:
            if 1 < len(s) < comm.world_size:
                comm.new_group(s)

        # Global order of parameters: the full model's order. Buckets fill in reverse of it.
        position = {name: i for i, name in enumerate(partition.shapes)}
        entries: dict[tuple[int, ...], list[tuple[int, str, nn.Parameter]]] = {}
        for name, p in params.items():
            if not p.requires_grad:
                continue
            unit = pmap.unit_of.get(name)
            owners = self.world if unit is None else plan.owners(unit)
            gname = pmap.pieces[name][0].global_name
            entries.setdefault(owners, []).append((position.get(gname, -1), name, p))

        cap = max(1, int(bucket_cap_mb * 1024 * 1024))
        self.buckets: list[Bucket] = []
        # Owner sets in plan order (world last); within a set, reverse forward order.
        for owners in sorted(entries, key=lambda s: (s == self.world, s)):
            items = sorted(entries[owners], key=lambda e: -e[0])
            current: list[tuple[int, str, nn.Parameter]] = []
            size = 0
            for item in items:
                nbytes = item[2].numel() * item[2].element_size()
                if current and size + nbytes > cap:
                    self.buckets.append(self._make_bucket(owners, current))
                    current, size = [], 0
                current.append(item)
                size += nbytes
            if current:
                self.buckets.append(self._make_bucket(owners, current))
        self._bucket_of: dict[int, Bucket] = {}
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[id(p)] = b
        # Each owner set launches its buckets in this fixed order: collectives within one group must
        # be issued in the same order on all its members.
        self._order: dict[tuple[int, ...], list[Bucket]] = {}
        for b in self.buckets:
            self._order.setdefault(b.owners, []).append(b)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for b in self.buckets for p in b.params]
        # Weight of each parameter in the global norm: each unit counted once over the world.
        self._norm_weight = {id(p): 1.0 / b.k for b in self.buckets for p in b.params}

    def _make_bucket(self, owners: tuple[int, ...], items: list[tuple[int, str, nn.Parameter]]) -> Bucket:
        params = [it[2] for it in items]
        total = sum(p.numel() for p in params)
        dtype = params[0].dtype
        buffer = torch.zeros(total, dtype=dtype, device=params[0].device)
        offsets, off = [], 0
        for p in params:
            offsets.append(off)
            off += p.numel()
        return Bucket(owners, params, [it[1] for it in items], buffer, offsets=offsets)

    # ------------------------------------------------------------------ per step
    def prepare(self) -> None:
        """Zero the buckets and make every ``.grad`` a view into its bucket (replaces ``zero_grad``)."""
        for b in self.buckets:
            b.buffer.zero_()
            b.pending = len(b.params)
            b.launched = False
            b.handle = None
            for p, off in zip(b.params, b.offsets):
                p.grad = b.buffer[off:off + p.numel()].view_as(p)
        self._next = {owners: 0 for owners in self._order}

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communicating (all micro-batches but the last)."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync_enabled:
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        if b.pending == 0:
            self._launch_ready(b.owners)

    def _launch_ready(self, owners: tuple[int, ...], force: bool = False) -> None:
        order = self._order[owners]
        i = self._next[owners]
        while i < len(order) and (force or order[i].pending <= 0):
            self._launch(order[i])
            i += 1
        self._next[owners] = i

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        if b.k > 1:
            # collective: every member of b.owners issues this bucket, in the same order.
            b.handle = self.comm.all_reduce(b.buffer, b.owners, async_op=True)

    def finish(self) -> None:
        """Launch what backward did not (parameters without gradient), wait, divide by owner counts."""
        for owners in self._order:
            self._launch_ready(owners, force=True)
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
            if b.k > 1:
                b.buffer.div_(b.k)

    # ------------------------------------------------------------------ clipping
    def grad_norm(self) -> float:
        """Norm of the averaged full-model gradient, each unit counted once.

        Every owner of a unit holds the same averaged gradient, so each contributes ``|g_u|^2 / k``;
        one world all-reduce then sums every unit exactly once. Collective: every rank calls it.
        """
        local = torch.zeros((), dtype=torch.float64, device=self.buckets[0].buffer.device if self.buckets else "cpu")
        for b in self.buckets:
            local += torch.linalg.vector_norm(b.buffer).double() ** 2 / b.k  # no copy of the bucket
        # collective: every rank reaches this, once per step where the norm is needed.
        self.comm.all_reduce(local, self.world).wait()
        return math.sqrt(float(local))

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient by the same factor so the global norm is at most ``max_norm``."""
        norm = self.grad_norm()
        if max_norm > 0:
            coef = min(1.0, max_norm / (norm + 1e-6))
            if coef < 1.0:
                for b in self.buckets:
                    b.buffer.mul_(coef)
        return norm

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def owner_groups(self) -> list[tuple[int, ...]]:
        return sorted({b.owners for b in self.buckets})

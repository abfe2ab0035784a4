"""Owner-group gradient averaging: :class:`OwnerGroupAverager`.

Every parameter piece of a rank's model belongs to a unit (owned by ``plan.owners(u)``) or is shared
(owned by the world). The pieces are the :class:`~subnetdp.sdp.pieces.Item` list, computed from the
partition and the plan alone, so every owner of a piece packs it at the same bucket offset whatever
its local layout.

Grouped mode (default): one set of buckets per owner set, each all-reduced over its owner group and
divided by the owner count. A bucket closes once it holds ``sync.bucket_cap_mb`` (torch DDP's rule).
A parameter whose pieces all land side by side in one bucket (a whole tensor, or dim-0 slices in
local order) gets its ``.grad`` as a view into the bucket, as DDP's ``gradient_as_bucket_view``; the
slices of a tensor that mixes owner sets are copied in when its gradient is ready and out after the
reduction. Buckets launch from post-accumulate-grad hooks as soon as they are full, so communication
overlaps the rest of backward.

Dense mode (more distinct owner sets than ``sync.max_groups``): no sub-groups; the items are cut into
chunks of at most ``sync.bucket_cap_mb`` in one global order, and each chunk is filled with this
rank's owned gradients (zeros elsewhere), all-reduced over the world, and divided coordinate by
coordinate by the owner counts. Never more than one chunk is allocated at a time.

Every synchroniser is made by :func:`subnetdp.sdp.sync.factory.make_synchronizer` from
:class:`SyncSettings` (the ``sync.*`` keys, read once) and answers :class:`GradSynchronizer`: the
loop, the checkpointer and the plan's dry runs ask it what they need, never which kind it is.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import nn

from subnetdp.core.contracts import Communicator, ParamMap, Partition
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.pieces import Item, LocalIndex, global_items
from subnetdp.sdp.sync.buckets import Bucket, Segment, _split
from subnetdp.sdp.sync.norm import clip_to, world_norm
from subnetdp.sdp.sync.protocol import EveryStepSync
from subnetdp.sdp.sync.settings import FLAG_SLOTS, uses_dense_sync



class OwnerGroupAverager(EveryStepSync):
    """Averages each gradient piece among exactly the ranks that own it.

    Use per step::

        averager.prepare()               # zero the buckets, point .grad at them
        loss.backward()                  # buckets launch from hooks as they fill
        averager.finish()                # wait, divide by owner counts
        norm = averager.clip_grad_norm_(max_norm)

    Args:
        model: the rank's model (on its device).
        pmap: its :class:`ParamMap` (local name -> global pieces).
        plan: the mask plan.
        partition: the full model's partition.
        comm: the communicator (already initialised).
        bucket_cap_mb: largest bucket (dense mode: largest chunk), in MiB.
        max_groups: the most distinct owner sets that get their own process group; above it, dense mode.
        dense: force dense (True) or grouped (False) mode; None chooses by ``max_groups``.
    """

    def __init__(self, model: nn.Module, pmap: ParamMap, plan: MaskPlan, partition: Partition,
                 comm: Communicator, bucket_cap_mb: float = 25.0, max_groups: int = 64,
                 dense: bool | None = None) -> None:
        self.comm = comm
        self.plan = plan
        self.rank = comm.rank
        self.world = tuple(range(comm.world_size))
        self._sync_enabled = True
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.index = LocalIndex(model, pmap)
        owner_sets = plan.owner_sets()
        self.dense = uses_dense_sync(len(owner_sets), max_groups) if dense is None else bool(dense)
        elem = next(iter(self.params.values())).element_size() if self.params else 4
        cap = max(1, int(bucket_cap_mb * 1024 * 1024) // elem)
        items = global_items(partition, plan)
        if self.dense:
            self.buckets = [self._bucket(self.world, chunk, own_only=False) for chunk in _split(items, cap)]
        else:
            # collective: every rank creates every owner group, in the same (sorted) order, members or not.
            for s in owner_sets:
                if 1 < len(s) < comm.world_size:
                    comm.new_group(s)
            by_set: dict[tuple[int, ...], list[Item]] = {}
            for it in items:
                if self.rank in it.owners:
                    by_set.setdefault(it.owners, []).append(it)
            self.buckets = [self._bucket(owners, chunk, own_only=True)
                            for owners in sorted(by_set, key=lambda s: (s == self.world, s))
                            for chunk in _split(by_set[owners], cap, reach=True)]
        # Every piece averaged over the world (C = 1): all ranks hold the same averaged gradient.
        self.replicated = all(it.k == comm.world_size for it in items)
        # The world's last bucket carries 2W extra slots: per-rank flags (non-finite loss, pending stop
        # signal) summed with the gradients, so at C = 1 neither the guard nor the stop needs a collective.
        self._carrier: Bucket | None = None
        world_buckets = [b for b in self.buckets if b.owners == self.world and comm.world_size > 1]
        if world_buckets:
            self._carrier = world_buckets[-1]
            self._carrier.numel += FLAG_SLOTS * comm.world_size
        self._flags: torch.Tensor | None = None
        self._carried: torch.Tensor | None = None
        # Where the step stands: "idle" (built), "open" (prepared), "finished" (averaged). finish() runs
        # once per step: the wrapper's end-of-backward callback runs it, and the framework's step calls
        # it again afterwards for the synchronisers that finish only there.
        self._phase = "idle"
        self._bind()

    def _bucket(self, owners: tuple[int, ...], items: list[Item], own_only: bool) -> Bucket:
        segments, off = [], 0
        for it in items:
            found = self.index.find(it) if self.rank in it.owners else None
            if found is None and own_only:
                raise RuntimeError(f"rank {self.rank} owns {it.name} but its model does not hold it")
            if found is not None and found[0] not in self.params:
                found = None  # frozen locally (not trained here)
            local, dim, start, stop = found if found is not None else (None, None, 0, 0)
            segments.append(Segment(it, off, local, dim, start, stop))
            off += it.numel
        return Bucket(owners, segments, off)

    def _bind(self) -> None:
        """Decide, per parameter, between a gradient view into a bucket and copying slices."""
        self._segments_of: dict[str, list[tuple[Bucket, Segment]]] = {}
        for b in self.buckets:
            for s in b.segments:
                if s.local is not None and (self.dense or b.k > 1):
                    self._segments_of.setdefault(s.local, []).append((b, s))
                    b.contributors.add(s.local)
        self._view: dict[str, tuple[Bucket, int]] = {}
        if not self.dense:
            for name, segs in self._segments_of.items():
                if self._viewable(self.params[name], segs):
                    first = min(s.offset for _, s in segs)
                    self._view[name] = (segs[0][0], first)
                    segs[0][0].persistent = True
            for b in self.buckets:
                if b.persistent:
                    b.buffer = torch.zeros(b.numel, dtype=self._dtype(), device=self._device())
        # A parameter whose pieces all go through buckets can drop its own gradient once copied in
        # (it gets a fresh one at copy-out), so sliced tensors do not hold their gradient twice.
        self._release = {n for n, segs in self._segments_of.items() if n not in self._view
                         and sum(s.item.numel for _, s in segs) == self.params[n].numel()}
        # Each owner set launches its buckets in this fixed order: collectives within one group must
        # be issued in the same order on all its members.
        self._order: dict[tuple[int, ...], list[Bucket]] = {}
        for b in self.buckets:
            if self.dense or b.k > 1:
                self._order.setdefault(b.owners, []).append(b)
        self._hooks = [] if self.dense else [self.params[n].register_post_accumulate_grad_hook(self._on_grad_ready)
                                             for n in self._segments_of]
        self._name_of = {id(p): n for n, p in self.params.items()}
        # Every trainable local piece with its owner count: each unit counted once in the norm.
        self._norm_pieces: list[tuple[str, int | None, int, int, int]] = []
        for b in self.buckets:
            for s in b.segments:
                if s.local is not None:
                    self._norm_pieces.append((s.local, s.dim, s.start, s.stop, s.item.k))

    def _dtype(self) -> torch.dtype:
        return next(iter(self.params.values())).dtype if self.params else torch.float32

    def _device(self) -> torch.device:
        return next(iter(self.params.values())).device if self.params else torch.device("cpu")

    @staticmethod
    def _viewable(p: torch.Tensor, segs: list[tuple[Bucket, Segment]]) -> bool:
        if len({id(b) for b, _ in segs}) != 1 or not p.is_contiguous():
            return False
        ordered = sorted((s for _, s in segs), key=lambda s: s.start)
        if sum(s.item.numel for s in ordered) != p.numel():
            return False
        if any(a.offset + a.item.numel != c.offset for a, c in zip(ordered, ordered[1:])):
            return False
        if len(ordered) == 1:
            return True  # covers the whole local tensor
        return all(s.dim == 0 for s in ordered)

    # ------------------------------------------------------------------ per step
    def prepare(self, keep_grads: bool = False) -> None:
        """Zero the buckets and point ``.grad`` of viewable parameters into them (replaces ``zero_grad``).

        ``keep_grads``: the gradients already in ``.grad`` stay, and the coming backward adds to them
        (a user loop that did not zero them: DDP accumulates averaged gradients the same way).
        """
        # Cloned: a kept gradient may be a view into the bucket zeroed below.
        kept = {n: p.grad.clone() for n, p in self.params.items() if p.grad is not None} if keep_grads else {}
        for name, p in self.params.items():
            p.grad = None
        for b in self.buckets:
            b.handle = None
            b.pending = len(b.contributors)
            if b.persistent:
                b.buffer.zero_()
            else:
                b.buffer = None
        for name, (b, off) in self._view.items():
            p = self.params[name]
            p.grad = b.buffer[off:off + p.numel()].view_as(p)
        for name, g in kept.items():
            if name in self._view:
                self.params[name].grad.copy_(g)
            else:
                self.params[name].grad = g
        self._flags, self._carried = None, None
        self._copied: set[str] = set()
        self._next = {owners: 0 for owners in self._order}
        self._phase = "open"

    @property
    def in_step(self) -> bool:
        """Prepared and not yet finished: a step's gradients are being collected."""
        return self._phase == "open"

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communicating (all micro-batches but the last)."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def carry(self, flags: torch.Tensor) -> bool:
        """Have ``flags`` (:data:`FLAG_SLOTS` values per rank) summed over the world with this step's gradients.

        Call it before the last micro-batch's backward (the carrying bucket may launch during it).
        Returns False when no bucket goes to the whole world (one rank, or no shared tensors): the
        caller then needs a collective of its own.
        """
        if self._carrier is None:
            return False
        if flags.numel() != FLAG_SLOTS * self.comm.world_size:  # would overwrite gradients, silently
            raise ValueError(f"carry takes {FLAG_SLOTS} flags per rank, got {flags.numel()} for {self.comm.world_size} ranks")
        self._flags = flags.to(self._dtype())
        if not self.dense:
            self._ensure_buffer(self._carrier)[-self._flags.numel():].copy_(self._flags)
        return True

    def carried(self) -> torch.Tensor | None:
        """The world's sum of the flags given to :meth:`carry` this step (after :meth:`finish`)."""
        return self._carried

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's (averaged, after :meth:`finish`) gradients."""
        return [p.grad for p in self.params.values() if p.grad is not None]

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._sync_enabled:
            self._contribute(self._name_of[id(p)])

    def _contribute(self, name: str) -> None:
        """Copy a parameter's slices into their buckets (unless a view) and launch full buckets."""
        if name in self._copied:
            return
        self._copied.add(name)
        p = self.params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        touched = []
        for b, s in self._segments_of.get(name, []):
            if name not in self._view:
                self._ensure_buffer(b)[s.offset:s.offset + s.item.numel].view(s.item.shape).copy_(
                    self._local(p.grad, s))
            if all(b is not t for t in touched):
                touched.append(b)
        if name in self._release:
            p.grad = None
        for b in touched:
            b.pending -= 1
            if b.pending == 0:
                self._launch_ready(b.owners)

    def _ensure_buffer(self, b: Bucket) -> torch.Tensor:
        if b.buffer is None:
            b.buffer = torch.zeros(b.numel, dtype=self._dtype(), device=self._device())
        return b.buffer

    @staticmethod
    def _local(t: torch.Tensor, s: Segment) -> torch.Tensor:
        return t if s.dim is None else t.narrow(s.dim, s.start, s.stop - s.start)

    def _launch_ready(self, owners: tuple[int, ...], force: bool = False) -> None:
        order = self._order[owners]
        i = self._next[owners]
        while i < len(order) and (force or order[i].pending <= 0):
            # collective: every member of the owner set issues its buckets in the same order.
            order[i].handle = self.comm.all_reduce(self._ensure_buffer(order[i]), order[i].owners, async_op=True)
            i += 1
        self._next[owners] = i

    def finish(self) -> None:
        """Complete the step's averaging: launch what backward did not, wait, divide, copy out.

        Idempotent: once a step is finished, a second call does nothing until the next :meth:`prepare`.
        """
        if self._phase == "finished":
            return
        if self.dense:
            self._finish_dense()
        else:
            self._finish_grouped()
        self._phase = "finished"

    def _finish_grouped(self) -> None:
        for name in self._segments_of:
            self._contribute(name)
        for owners in self._order:
            self._launch_ready(owners, force=True)
        for b in self.buckets:
            if b.k == 1:
                continue
            b.handle.wait()
            b.handle = None  # the work object keeps the buffer alive: let per-step buckets go now
            if b is self._carrier and self._flags is not None:
                self._carried = b.buffer[-self._flags.numel():].clone()
            b.buffer.div_(b.k)
            for s in b.segments:
                if s.local is not None and s.local not in self._view:
                    p = self.params[s.local]
                    if p.grad is None:
                        p.grad = torch.empty_like(p)  # released at copy-in; every piece is written here
                    self._local(p.grad, s).copy_(b.buffer[s.offset:s.offset + s.item.numel].view(s.item.shape))
            if not b.persistent:
                b.buffer = None  # per-step buckets live from the first copy-in to the copy-out

    def _finish_dense(self) -> None:
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for b in self.buckets:
            chunk = torch.zeros(b.numel, dtype=self._dtype(), device=self._device())
            for s in b.segments:
                if s.local is not None:
                    chunk[s.offset:s.offset + s.item.numel].view(s.item.shape).copy_(
                        self._local(self.params[s.local].grad, s))
            if b is self._carrier and self._flags is not None:
                chunk[-self._flags.numel():].copy_(self._flags)
            # collective: every rank issues every chunk, in the same global order.
            self.comm.all_reduce(chunk, self.world).wait()
            if b is self._carrier and self._flags is not None:
                self._carried = chunk[-self._flags.numel():].clone()
            for s in b.segments:
                if s.local is not None:
                    piece = chunk[s.offset:s.offset + s.item.numel].view(s.item.shape)
                    self._local(self.params[s.local].grad, s).copy_(piece / s.item.k)
            del chunk

    # ------------------------------------------------------------------ clipping
    def grad_norm(self, flags: torch.Tensor | None = None) -> float:
        """Norm of the averaged full-model gradient, each unit counted once.

        Every owner of a piece holds the same averaged gradient, so each contributes ``|g|^2 / k``;
        one world all-reduce then sums every piece exactly once. With ``flags`` (a float64 tensor),
        the same all-reduce sums them over the world in place (see :func:`world_norm`). At C = 1 (:attr:`replicated`) every
        rank holds the whole averaged gradient and no collective is needed. Collective otherwise:
        every rank calls it.
        """
        collective = not self.replicated or (flags is not None and self.comm.world_size > 1)
        local = torch.zeros((), dtype=torch.float64, device=self._device())
        for name, dim, start, stop, k in self._norm_pieces:
            g = self.params[name].grad
            if g is not None:
                g = g if dim is None else g.narrow(dim, start, stop - start)
                local += torch.linalg.vector_norm(g).double() ** 2 / (k if collective else 1)
        if not collective:
            return math.sqrt(float(local))
        return world_norm(self.comm, local, flags)  # collective: every rank, once per step that needs it

    def scale_grads_(self, coef: float) -> None:
        for p in self.params.values():
            if p.grad is not None:
                p.grad.mul_(coef)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient by the same factor so the global norm is at most ``max_norm``."""
        norm = self.grad_norm()
        clip_to(self, norm, max_norm)
        return norm

    def bytes_per_step(self) -> int:
        """Payload this rank hands to gradient collectives per step."""
        return sum(b.numel for b in self.buckets if self.dense or b.k > 1) * torch.empty((), dtype=self._dtype()).element_size()

    def state_tensors(self) -> list[torch.Tensor]:
        """The persistent bucket buffers (grouped mode), for memory accounting."""
        return [b.buffer for b in self.buckets if b.buffer is not None]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def owner_groups(self) -> list[tuple[int, ...]]:
        return sorted({b.owners for b in self.buckets})

"""Owner-group gradient averaging.

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

Every synchroniser is made by :func:`subnetdp.sdp.synchronizers.make_synchronizer` from
:class:`SyncSettings` (the ``sync.*`` keys, read once) and answers :class:`GradSynchronizer`: the
loop, the checkpointer and the plan's dry runs ask it what they need, never which kind it is.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Mapping, NamedTuple, Optional, Protocol

import torch
from torch import nn

from subnetdp.core.contracts import Communicator, Handle, ParamMap, Partition
from subnetdp.core.errors import NonFiniteError
from subnetdp.sdp.pieces import Item, LocalIndex, global_items
from subnetdp.core.plan import MaskPlan

#: Values per rank that ride in the world's last gradient bucket and in the guard's reduction: the
#: first W slots hold each rank's inf/NaN flag, the next W its pending stop signal (0: none).
FLAG_SLOTS = 2


@dataclass(eq=False)
class Segment:
    """Where one item sits in a bucket and in this rank's local parameter."""

    item: Item
    offset: int
    local: str | None  # None: this rank does not hold the item (dense mode only)
    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(eq=False)
class Bucket:
    """Gradient pieces that share one owner set (a world chunk in dense mode), in one flat buffer."""

    owners: tuple[int, ...]
    segments: list[Segment]
    numel: int
    buffer: torch.Tensor | None = None
    pending: int = 0
    handle: Handle | None = None
    contributors: set[str] = field(default_factory=set)
    persistent: bool = False  # holds gradient views: lives across steps; else allocated per step

    @property
    def k(self) -> int:
        return len(self.owners)


def _split(items: list[Item], cap_elems: int, reach: bool = False) -> list[list[Item]]:
    """Cut ``items`` (kept in order) into buckets.

    ``reach=False``: at most ``cap_elems`` each (an item larger than the cap alone), which bounds the
    memory of dense mode's chunks. ``reach=True``: a bucket closes once it holds at least
    ``cap_elems``, torch DDP's rule: the early buckets are full and the remainder goes to the last
    bucket, the one still in flight after backward has ended (capping them instead left ResNet-18's
    last bucket 9 MiB larger than DDP's: docs/network.md).
    """
    out: list[list[Item]] = []
    current: list[Item] = []
    size = 0
    for it in items:
        if current and (size >= cap_elems if reach else size + it.numel > cap_elems):
            out.append(current)
            current, size = [], 0
        current.append(it)
        size += it.numel
    if current:
        out.append(current)
    return out


def uses_dense_sync(owner_sets: int, max_groups: int) -> bool:
    """Whether a plan with ``owner_sets`` distinct owner sets is averaged densely over the world
    (``sync.max_groups``: the most owner sets that get a process group of their own)."""
    return owner_sets > max_groups


@dataclass(frozen=True)
class SyncSettings:
    """How a run synchronises: the ``sync.*`` keys (and ``train.on_nonfinite``), read from the config once.

    Attributes:
        mode: ``every_step`` (gradients averaged among owners after every backward) or
            ``local_steps`` (owners average parameter deltas every ``every`` steps).
        bucket_cap_mb: the largest bucket (dense mode: chunk), in MiB.
        max_groups: the most distinct owner sets that get a process group; above it, dense mode.
        every, outer_lr, outer_momentum, outer_on_host: local steps' cycle and outer optimizer.
        warmup_steps: local steps begin after this many steps synchronised every step.
        on_nonfinite: ``stop`` or ``skip``: what local steps do at a synchronisation that hears of inf/NaN.
    """

    mode: str = "every_step"
    bucket_cap_mb: float = 25.0
    max_groups: int = 64
    every: int = 1
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    outer_on_host: bool = False
    warmup_steps: int = 0
    on_nonfinite: str = "stop"

    @classmethod
    def from_config(cls, cfg: Any) -> "SyncSettings":
        s = cfg.sync
        return cls(mode=str(s.mode), bucket_cap_mb=float(s.bucket_cap_mb), max_groups=int(s.max_groups),
                   every=int(s.every), outer_lr=float(s.outer_lr), outer_momentum=float(s.outer_momentum),
                   outer_on_host=bool(s.outer_on_host), warmup_steps=int(s.warmup_steps),
                   on_nonfinite=str(cfg.train.on_nonfinite))

    @property
    def cycle(self) -> int:
        """Steps between two points where owners agree: ``every`` with local steps, else 1."""
        return self.every if self.mode == "local_steps" else 1


class GradSynchronizer(Protocol):
    """What the step, the loop and the checkpointer ask of a synchroniser (:class:`OwnerGroupAverager`,
    FSDP's ``ShardedOwnerAverager``, :class:`~subnetdp.sdp.local_steps.LocalStepsSynchronizer`).

    Per step: :meth:`prepare`, the micro-batches' backward (all but the last inside :meth:`no_sync`),
    :meth:`carry` of the inf/NaN flags, :meth:`finish` (collective: owner groups average), then
    :meth:`grad_norm` / :meth:`scale_grads_` for clipping, the optimizer update, and
    :meth:`after_update`. Checkpoints save and restore what it keeps besides the model
    (:meth:`extra_tensors`, :meth:`rank_state`).
    """

    dense: bool
    replicated: bool
    #: Whether owners' copies of a piece differ between synchronisations (local steps), so every
    #: owner writes its own copy to a checkpoint instead of one writer per piece.
    owners_diverge: bool

    def prepare(self, keep_grads: bool = False) -> None:
        """Drop the last step's gradients (before the memory baseline of a measured step).

        ``keep_grads``: keep them instead, so the coming backward adds to them (a user loop that did not
        zero its gradients, as DDP accumulates).
        """

    def no_sync(self) -> ContextManager[None]:
        """Accumulate gradients locally: no collective inside the block."""

    #: Whether the guard's check stays on this rank (local steps between synchronisations): the
    #: step then agrees on no world flags; stop signals wait for :meth:`after_update`'s
    #: synchronisation (or, with ``sync.stop_every_step``, the loop's collective of its own).
    checks_locally: bool

    def carry(self, flags: torch.Tensor) -> bool:
        """Let ``flags`` (:data:`FLAG_SLOTS` per rank) ride along this step's collectives; False if it cannot."""

    def carried(self) -> Optional[torch.Tensor]:
        """The world's sum of the carried flags, after :meth:`finish`."""

    def finish(self) -> None:
        """Average this step's gradients over each unit's owners. Collective."""

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's (averaged, after :meth:`finish`) gradients."""

    def grad_norm(self, flags: Optional[torch.Tensor] = None) -> float:
        """Norm of the averaged full-model gradient, each unit once; ``flags`` are summed over the world."""

    def scale_grads_(self, coef: float) -> None:
        """Multiply every gradient by ``coef`` in place."""

    def defer_nonfinite(self, step: int) -> bool:
        """A non-finite loss or gradient at ``step`` was seen on some rank: True if this synchroniser
        takes it over (local steps: this rank skips its inner step and every rank hears of it at the
        next synchronisation), False to let the guard apply ``train.on_nonfinite`` now."""

    def after_update(self, step: int, last_step: int, signum: int = 0) -> Optional[dict[int, int]]:
        """After the optimizer update of ``step`` (of ``last_step``): local steps' outer synchronisation
        when a cycle ends (collective then, on every rank at the same steps); nothing for every-step.

        Returns the stop signals agreed in it (rank -> signal number, ``signum`` this rank's pending
        one, 0 for none), or None when it issued no world reduction."""

    def extra_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """``(key prefix, local parameter name, tensor)`` of the state it keeps per piece (local steps'
        anchor and outer momentum), each of its parameter's local shape, so a checkpoint keys it by
        unit like the parameter. Empty for every-step synchronisers."""

    def resume_at(self, step: int) -> None:
        """The run continues after ``step`` (a checkpoint's), called before the pieces are loaded:
        local steps with ``sync.warmup_steps`` take the phase of that step here (per-step
        synchronisation before it, local steps and their outer state from it on)."""

    def restore_extra(self, found: set[str]) -> None:
        """After the pieces were loaded: ``found`` are the prefixes of :meth:`extra_tensors` the source
        held; make up for what it lacked (local steps without an anchor restart their cycle here)."""

    def rank_state(self) -> dict[str, Any]:
        """Per-rank state for the rank's checkpoint file (local steps: the cycle's skipped-step counts)."""

    def load_rank_state(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`rank_state` saved, from a rank's checkpoint file (keys it lacks are skipped)."""

    def bytes_per_step(self) -> float:
        """Payload this rank hands to gradient collectives per step (over a cycle with local steps)."""

    def log_figures(self) -> dict[str, float]:
        """Per-rank figures of a log step (local steps: the last synchronisation's bytes per step of its cycle)."""

    def state_tensors(self) -> list[torch.Tensor]:
        """Persistent buffers, for memory accounting."""

    def remove_hooks(self) -> None:
        """Detach from the model (before the plan changes)."""

    def owner_groups(self) -> list[tuple[int, ...]]:
        """The owner sets this rank averages with."""

    def describe(self) -> dict[str, Any]:
        """This synchroniser's fields of the summary (per rank): ``sync_mode`` and its figures."""


class EveryStepSync:
    """What the synchronisers that average every step (:class:`OwnerGroupAverager`, FSDP's
    ``ShardedOwnerAverager``) answer alike: no state besides the model, nothing after an update."""

    owners_diverge = False  # every owner holds the same averaged values after every step
    checks_locally = False  # every step's flags reach the world (carried, or in the guard's reduction)

    def defer_nonfinite(self, step: int) -> bool:
        return False  # every step is synchronised: the guard applies train.on_nonfinite at once

    def after_update(self, step: int, last_step: int, signum: int = 0) -> Optional[dict[int, int]]:
        return None  # the gradients were averaged before the update

    def extra_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return []

    def resume_at(self, step: int) -> None:
        return None  # the same synchronisation at every step

    def restore_extra(self, found: set[str]) -> None:
        return None

    def rank_state(self) -> dict[str, Any]:
        return {}

    def load_rank_state(self, state: Mapping[str, Any]) -> None:
        return None

    def log_figures(self) -> dict[str, float]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"sync_mode": "every_step"}


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
        """Complete the step's averaging: launch what backward did not, wait, divide, copy out."""
        if self.dense:
            self._finish_dense()
            return
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


def clip_to(averager: "OwnerGroupAverager", norm: float, max_norm: float) -> None:
    """Scale every gradient by ``max_norm / norm`` when the norm is above ``max_norm`` (0: no clipping)."""
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            averager.scale_grads_(coef)


def world_norm(comm: Communicator, local_squares: torch.Tensor, flags: torch.Tensor | None = None) -> float:
    """``sqrt`` of the world's sum of ``local_squares`` (float64 scalar); ``flags`` ride along, summed in place.

    With ``flags`` (:data:`FLAG_SLOTS` values per rank), this rank's flag is raised first when its own share is not
    finite: inf and NaN in any gradient propagate into it, so the norm doubles as the inf/NaN check.
    Collective: every rank of the world calls it.
    """
    if flags is not None:
        flags[comm.rank] += (~torch.isfinite(local_squares)).to(flags.dtype)
    both = torch.cat([local_squares.view(1), flags.to(local_squares)]) if flags is not None else local_squares.view(1)
    comm.all_reduce(both, tuple(range(comm.world_size))).wait()
    if flags is not None:
        flags.copy_(both[1:])
    return math.sqrt(float(both[0]))


class Checked(NamedTuple):
    """What :meth:`NonFiniteGuard.check` learnt of a step."""

    finite: bool  # every rank's loss and averaged gradients are finite
    norm: float | None  # the averaged gradient's global norm, when it was needed
    #: rank -> pending stop signal, the same on every rank (empty: none); None when the step issued no
    #: world reduction that carried them (local steps: their synchronisation carries them instead).
    stops: dict[int, int] | None


class NonFiniteGuard:
    """The synchroniser's inf/NaN guard: a step whose loss or gradients are not finite on any rank.

    The loss flags ride with the gradients (:meth:`carry`, in the bucket that goes to the whole
    world); the gradient flags ride in the gradient-norm all-reduce when the norm is needed (the
    norm is then the gradient check: one pass over the gradients, not two), or in one small
    all-reduce of their own. At C = 1 every rank holds the same averaged gradient, so its own check
    is everyone's and no collective is issued. The guard's scalars are counted in phase ``"guard"``.

    Each rank's pending stop signal (SIGINT/SIGTERM, :class:`~subnetdp.train.stopping.StopRequest`)
    rides in the same world reduction, beside its flag (:data:`FLAG_SLOTS`), so every rank learns in
    the step whether any rank was asked to stop, and the loop needs no collective of its own for it.

    Args:
        comm: the communicator.
        policy: ``train.on_nonfinite``: ``stop`` raises :class:`NonFiniteError` on every rank,
            ``skip`` skips the update (rank 0 prints a warning).
        last_good: gives the last good checkpoint (for the error message), or None.
    """

    def __init__(self, comm: Communicator, policy: str = "stop", last_good: Callable[[], Any] = lambda: None) -> None:
        self.comm, self.policy, self.last_good = comm, policy, last_good

    def carry(self, sync: GradSynchronizer, loss: torch.Tensor, signum: int = 0) -> None:
        """Hand this rank's "loss is not finite" flag and its pending signal ``signum`` (0: none) to
        the synchroniser, before the last backward.

        No host synchronisation happens here.
        """
        world, rank = self.comm.world_size, self.comm.rank
        flags = torch.zeros(FLAG_SLOTS * world, dtype=torch.float32, device=loss.device)
        flags[rank] = (~torch.isfinite(loss)).any().float()
        flags[world + rank] = float(signum)
        sync.carry(flags)

    def check(self, step: int, sync: GradSynchronizer, loss: torch.Tensor, need_norm: bool,
              signum: int = 0) -> Checked:
        """Whether every rank's loss and averaged gradients are finite; the gradient norm if asked;
        and which ranks hold a stop signal (``signum``: this rank's, 0 for none).

        Collective below C = 1 (every rank calls it once per step).
        """
        comm, world = self.comm, self.comm.world_size
        flags = torch.zeros(FLAG_SLOTS * world, dtype=torch.float64, device=loss.device)
        carried = sync.carried()
        if carried is None:
            flags[comm.rank] += (~torch.isfinite(loss)).any().double()
        fold = world > 1 and not (sync.replicated and carried is not None)  # flags need a collective
        if fold or carried is None:
            flags[world + comm.rank] = float(signum)  # read now: a signal since carry still counts this step
        norm = None
        with comm.bytes.phase("guard"):  # a guard, not a training step's traffic
            if need_norm:
                # inf and NaN in any gradient make the norm non-finite: it is the gradient check too.
                norm = sync.grad_norm(flags if fold else None)  # collective unless C = 1
                if not fold and not math.isfinite(norm):
                    flags[comm.rank] += 1.0
            else:
                grads = sync.local_grads()
                if grads:
                    # One fused pass of 2-norms (as torch's clip_grad_norm_): inf and NaN propagate into
                    # the norm and nothing gradient-sized is allocated. (The max-norm would cost ten times
                    # as much on the CPU; a norm that overflows only for gradients above 1e19 counts as
                    # non-finite, as it should.)
                    norms = torch.stack(torch._foreach_norm(grads, 2.0))
                    flags[comm.rank] += (~torch.isfinite(norms)).any().double()
                if fold:
                    # collective: every rank, once a step: who saw inf/NaN, who holds a stop signal.
                    comm.all_reduce(flags, comm.world).wait()
        if carried is not None:
            flags[:world] += carried[:world].double()
            if not fold:  # the signals the gradients carried (when the guard's reduction did, they are in flags)
                flags[world:] = carried[world:].double()
        values = flags.tolist()
        ranks = [r for r, f in enumerate(values[:world]) if f]
        agreed = world == 1 or not sync.checks_locally
        stops = {r: int(s) for r, s in enumerate(values[world:]) if s} if agreed else None
        if not ranks:
            return Checked(True, norm, stops)
        if sync.defer_nonfinite(step):
            # Local steps: no collective between synchronisations; this rank skips its step, and every
            # rank hears of it at the next synchronisation (which applies train.on_nonfinite).
            return Checked(False, norm, stops)
        where = f"step {step}, rank(s) {', '.join(map(str, ranks))}"
        if self.policy == "skip":
            if comm.rank == 0:
                print(f"warning: non-finite loss or gradients at {where}: step skipped", flush=True)
            return Checked(False, norm, stops)
        raise NonFiniteError(f"non-finite loss or gradients at {where}; the last good checkpoint is "
                             f"{self.last_good() or 'none (no checkpoint was written yet)'} — lower optim.lr, set "
                             "optim.clip_grad_norm, or set train.on_nonfinite=skip")

    def clip(self, sync: GradSynchronizer, norm: float | None, max_norm: float) -> None:
        """Scale the gradients so their global norm is at most ``max_norm`` (0: no clipping)."""
        if max_norm > 0:
            clip_to(sync, float(norm), max_norm)

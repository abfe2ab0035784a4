"""Backward masking (Bb-SDP, Nb-SDP): every rank runs the full model, only owned units learn.

Every rank holds the full model and runs the full forward and backward. Parameters of units the
rank does not own get no gradient storage and no optimizer state:

- a whole tensor of a non-owned unit (block level) is frozen with ``requires_grad=False``;
- a tensor cut into pieces of several units (neuron level) that the rank owns only in part is split
  into one tensor per piece: owned pieces become separate leaf parameters (``weight__u3``), the others
  frozen parameters (``weight__f5``, ``requires_grad=False``), and a forward pre-hook concatenates them into the layer's tensor
  for each forward, so autograd produces gradients for the owned rows only.

After the owners have averaged and stepped, :class:`Refresher` broadcasts each unit's parameters and
float buffers from ``min(owners)`` to the world every ``masker.refresh_every`` steps, so with the
default of 1 every rank holds the identical full model after each step.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from subnetdp.core.contracts import Communicator, ParamMap, Partition, Piece, TensorSlice
from subnetdp.sdp.pieces import Item, LocalIndex, global_items
from subnetdp.core.plan import MaskPlan


class _Assemble:
    """Forward pre-hook: set ``module.<attr>`` to the concatenation of its pieces along ``dim``."""

    def __init__(self, attr: str, pieces: list[str], dim: int) -> None:
        self.attr, self.pieces, self.dim = attr, pieces, dim

    def __call__(self, module: nn.Module, args: Any) -> None:
        module.__dict__[self.attr] = torch.cat([getattr(module, p) for p in self.pieces], self.dim)


class _Release:
    """Forward hook: drop the assembled tensor (autograd keeps what backward needs)."""

    def __init__(self, attr: str) -> None:
        self.attr = attr

    def __call__(self, module: nn.Module, args: Any, out: Any) -> None:
        module.__dict__.pop(self.attr, None)


def apply_backward_masking(model: nn.Module, partition: Partition, owned: Sequence[int]) -> tuple[nn.Module, ParamMap]:
    """Freeze or split the full ``model`` in place so only ``owned`` units are trainable."""
    mine = set(owned)
    sliced: dict[str, list[tuple[TensorSlice, int]]] = {}
    for unit in partition.units:
        for s in unit.slices:
            if s.dim is None:
                if unit.id not in mine:
                    model.get_parameter(s.name).requires_grad_(False)
            else:
                sliced.setdefault(s.name, []).append((s, unit.id))
    pieces: dict[str, list[Piece]] = {}
    unit_of: dict[str, int | None] = {}
    for name, parts in sliced.items():
        parts.sort(key=lambda su: su[0].start)
        param = model.get_parameter(name)
        owners = [uid in mine for _, uid in parts]
        if all(owners) or not any(owners):
            param.requires_grad_(all(owners))
            continue
        dims = {s.dim for s, _ in parts}
        covered = sum(s.stop - s.start for s, _ in parts)
        if len(dims) != 1 or covered != param.shape[parts[0][0].dim]:
            raise ValueError(f"{name}: backward masking needs unit slices that tile one dimension")
        prefix, _, attr = name.rpartition(".")
        module = model.get_submodule(prefix)
        full = param.detach()
        del module._parameters[attr]
        names = []
        for s, uid in parts:
            t = full.narrow(s.dim, s.start, s.stop - s.start).clone()
            local_attr = f"{attr}__{'u' if uid in mine else 'f'}{uid}"
            module.register_parameter(local_attr, nn.Parameter(t, requires_grad=uid in mine))
            local = f"{prefix}.{local_attr}" if prefix else local_attr
            pieces[local] = [Piece(name, s.dim, s.start, s.stop, 0, s.stop - s.start)]
            unit_of[local] = uid
            names.append(local_attr)
        module.register_forward_pre_hook(_Assemble(attr, names, parts[0][0].dim))
        module.register_forward_hook(_Release(attr))
    whole_unit = {s.name: u.id for u in partition.units for s in u.slices + u.buffers if s.dim is None}
    for local, _ in list(model.named_parameters()) + list(model.named_buffers()):
        if local not in pieces:
            pieces[local] = [Piece(local)]
            unit_of[local] = whole_unit.get(local)
    return model, ParamMap(pieces, unit_of)


class Refresher:
    """Broadcasts every unit's parameters and float buffers from ``min(owners)`` to the world.

    Items are packed per source rank, in one global order, into chunks of at most ``bucket_cap_mb``,
    so each refresh is a few large broadcasts. Collective: every rank calls :meth:`refresh`.

    Args:
        model, pmap: the rank's (full) model and its map.
        plan, partition: the mask plan and the partition.
        comm: the communicator.
        every: refresh every this many steps (``masker.refresh_every``).
        bucket_cap_mb: largest broadcast, in MiB.
    """

    def __init__(self, model: nn.Module, pmap: ParamMap, plan: MaskPlan, partition: Partition,
                 comm: Communicator, every: int = 1, bucket_cap_mb: float = 25.0) -> None:
        self.comm, self.every = comm, max(1, int(every))
        self.index = LocalIndex(model, pmap)
        items = [it for it in global_items(partition, plan) if it.unit is not None]
        items += [it for it in global_items(partition, plan, buffers=True)
                  if it.unit is not None and partition.dtypes[it.name].is_floating_point]
        cap = max(1, int(bucket_cap_mb * 1024 * 1024) // 4)
        self.chunks: list[tuple[int, list[Item], int]] = []
        for src in range(comm.world_size):
            current, size = [], 0
            for it in (i for i in items if i.owners and i.owners[0] == src):
                if current and size + it.numel > cap:
                    self.chunks.append((src, current, size))
                    current, size = [], 0
                current.append(it)
                size += it.numel
            if current:
                self.chunks.append((src, current, size))
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def bytes_per_refresh(self) -> int:
        """Payload this rank hands to broadcasts in one refresh."""
        return sum(numel for _, _, numel in self.chunks) * torch.empty((), dtype=self.dtype).element_size()

    @torch.no_grad()
    def refresh(self) -> int:
        """One refresh; returns the bytes this rank handed to broadcasts."""
        sent = 0
        if self.comm.world_size == 1 or not self.chunks:
            return sent
        # One buffer for every chunk: a communication library may release a finished collective's
        # tensor a little late, so a fresh buffer per chunk could briefly hold two chunks at once.
        whole = torch.empty(max(numel for _, _, numel in self.chunks), dtype=self.dtype, device=self.device)
        for src, items, numel in self.chunks:
            buf = whole[:numel]
            if self.comm.rank == src:
                off = 0
                for it in items:
                    buf[off:off + it.numel].view(it.shape).copy_(self.index.view(it))
                    off += it.numel
            # collective: every rank issues every chunk, sources in rank order.
            self.comm.broadcast(buf, src)  # counted by the communicator, under the caller's "refresh" phase
            sent += buf.numel() * buf.element_size()
            if self.comm.rank != src:
                off = 0
                for it in items:
                    self.index.view(it).copy_(buf[off:off + it.numel].view(it.shape))
                    off += it.numel
            del buf
        del whole
        return sent

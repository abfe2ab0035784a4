"""Global pieces of the full model and where a rank holds them locally.

A :class:`Item` is the unit of synchronisation: a whole tensor, or the slice ``[start, stop)`` of a
tensor along one dimension, with the ranks that own it. The list of items is computed from global
information only (the partition and the plan), so every rank sees the same items in the same order
and can pack buckets that line up coordinate for coordinate even when the ranks' local layouts differ
(a rank that owns neuron units 2 and 5 of a layer holds them side by side in a narrower tensor).
:class:`LocalIndex` finds the local view of an item on this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from subnetdp.core.contracts import ParamMap, Partition, Piece, TensorSlice
from subnetdp.core.plan import MaskPlan


@dataclass(frozen=True)
class Item:
    """One global piece of a tensor and its owner set.

    Attributes:
        name: global tensor name.
        dim: sliced dimension, or None for the whole tensor.
        start, stop: the range along ``dim``.
        owners: sorted ranks that own the piece (every rank for shared tensors).
        shape: the piece's shape.
        unit: the unit id, or None for a shared tensor.
    """

    name: str
    dim: int | None
    start: int
    stop: int
    owners: tuple[int, ...]
    shape: tuple[int, ...]
    unit: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def k(self) -> int:
        return len(self.owners)


def _piece_shape(shape: tuple[int, ...], s: TensorSlice) -> tuple[int, ...]:
    if s.dim is None:
        return tuple(shape)
    out = list(shape)
    out[s.dim] = s.stop - s.start
    return tuple(out)


def global_items(partition: Partition, plan: MaskPlan, buffers: bool = False) -> list[Item]:
    """Every parameter piece (or, with ``buffers``, every buffer piece) of the full model.

    Ordered in reverse forward order of the tensors (gradients become ready in that order during
    backward), and within a tensor by ascending ``start``, so a tensor's dim-0 pieces held side by
    side locally are also side by side in a bucket.
    """
    position = {name: i for i, name in enumerate(partition.shapes)}
    world = tuple(range(plan.world_size))
    items: list[Item] = []
    for unit in partition.units:
        for s in (unit.buffers if buffers else unit.slices):
            items.append(Item(s.name, s.dim, s.start, s.stop, plan.owners(unit.id),
                              _piece_shape(partition.shapes[s.name], s), unit.id))
    for name in (partition.shared_buffers if buffers else partition.shared):
        items.append(Item(name, None, 0, 0, world, tuple(partition.shapes[name])))
    items.sort(key=lambda it: (-position.get(it.name, -1), it.start))
    return items


def piece_key(name: str, dim: int | None, start: int, stop: int) -> str:
    """A piece's key in checkpoints and in the model's Stateful: the global name, and its slice if cut."""
    return name if dim is None else f"{name}@{dim}:{start}:{stop}"


def item_key(it: Any) -> str:
    return piece_key(it.name, it.dim, it.start, it.stop)


class LocalIndex:
    """Finds this rank's local tensor (parameter or buffer) that holds a global piece.

    Args:
        model: the rank's model (materialised subnetwork, or the full model for backward masking).
        pmap: its :class:`ParamMap`.
    """

    def __init__(self, model: nn.Module, pmap: ParamMap) -> None:
        tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
        tensors.update(dict(model.named_buffers()))
        self.tensors = tensors
        self._by_global: dict[str, list[tuple[str, Piece]]] = {}
        for local, pieces in pmap.pieces.items():
            if local not in tensors:
                continue
            for p in pieces:
                self._by_global.setdefault(p.global_name, []).append((local, p))

    def find(self, item: Item | TensorSlice) -> tuple[str, int | None, int, int] | None:
        """``(local name, dim, local start, local stop)`` holding ``item``, or None if not held."""
        dim = item.dim
        for local, p in self._by_global.get(item.name, []):
            if p.dim is None:
                if dim is None:
                    return local, None, 0, 0
                return local, dim, item.start, item.stop
            if dim == p.dim and p.global_start <= item.start and item.stop <= p.global_stop:
                off = p.local_start + item.start - p.global_start
                return local, dim, off, off + item.stop - item.start
        return None

    def holds(self, item: Item | TensorSlice) -> bool:
        return self.find(item) is not None

    def view(self, item: Item | TensorSlice, grad: bool = False) -> torch.Tensor:
        """The local view of ``item`` (of the tensor's ``.grad`` with ``grad``); may be non-contiguous."""
        found = self.find(item)
        if found is None:
            raise KeyError(f"this rank does not hold {item.name}[{item.dim}:{item.start}:{item.stop}]")
        local, dim, start, stop = found
        t = self.tensors[local]
        if grad:
            t = t.grad
        return t if dim is None else t.narrow(dim, start, stop - start)


def full_tensors(model: nn.Module, pmap: ParamMap, partition: Partition,
                 names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Global name -> full-shaped copy, for every tensor whose pieces this rank holds completely.

    Used to compare ranks that hold the whole model (backward masking) and in tests.
    """
    index = LocalIndex(model, pmap)
    wanted = list(names) if names is not None else list(partition.shapes)
    pieces: dict[str, list[TensorSlice]] = {}
    for unit in partition.units:
        for s in unit.slices + unit.buffers:
            pieces.setdefault(s.name, []).append(s)
    out: dict[str, torch.Tensor] = {}
    for name in wanted:
        slices = pieces.get(name) or [TensorSlice(name)]
        if not all(index.holds(s) for s in slices):
            continue
        full = torch.empty(partition.shapes[name], dtype=partition.dtypes[name])
        for s in slices:
            src = index.view(s).detach().cpu()
            (full if s.dim is None else full.narrow(s.dim, s.start, s.stop - s.start)).copy_(src)
        out[name] = full
    return out

"""Gradient buckets: where each piece sits in a flat buffer, and how the pieces are cut into buckets."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from subnetdp.core.contracts import Handle
from subnetdp.sdp.pieces import Item

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

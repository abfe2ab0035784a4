"""Pieces the neuron-level adapters share: range cutting, owned indices, narrowing, the ParamMap.

A neuron-level group is one hidden dimension of width ``w`` cut into ``k`` equal ranges
``[j*w//k, (j+1)*w//k)``; every unit's first slice is its range. A materialised layer keeps the
owned ranges in ascending unit order, so a tensor cut by several owned units holds their pieces
back to back, and a tensor cut by no owned unit is empty (it holds nothing global).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from subnetdp import ConfigError, ParamMap, Partition, Piece, Unit
from subnetdp.plugins.models._blocks import tensor_names


class ScaleInput:
    """Forward pre-hook: multiply a layer's input by ``scale`` in training (``K/n`` rescaling)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, module: nn.Module, args: tuple) -> tuple | None:
        if module.training and self.scale != 1.0:
            return (args[0] * self.scale,) + tuple(args[1:])
        return None


class ScaleOutput:
    """Forward hook: multiply a module's output by ``scale`` in training (``K/n`` rescaling)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if module.training and self.scale != 1.0:
            return out * self.scale
        return None


def check_units_per_layer(units_per_layer: int, width: int, what: str) -> None:
    """Raise a :class:`ConfigError` when a hidden dimension of ``width`` cannot hold the units.

    Args:
        units_per_layer: ``masker.units_per_layer``.
        width: the hidden dimension.
        what: the reason, e.g. ``"block layer1.0 has only 64 inner channels"``.
    """
    if units_per_layer > width:
        raise ConfigError("masker.units_per_layer", units_per_layer, what,
                          f"use masker.units_per_layer <= {width}")


def cut_ranges(width: int, units_per_layer: int) -> list[tuple[int, int]]:
    """The ``units_per_layer`` equal ranges ``[a, b)`` of a hidden dimension of ``width``."""
    return [(j * width // units_per_layer, (j + 1) * width // units_per_layer) for j in range(units_per_layer)]


def owned_by_group(partition: Partition, owned: Sequence[int]) -> dict[str, list[Unit]]:
    """The owned units of every group (empty for a group of which none is owned), ascending ids."""
    kept: dict[str, list[Unit]] = {g: [] for g in partition.groups()}
    for uid in sorted(set(owned)):
        kept[partition.units[uid].group].append(partition.units[uid])
    return kept


def owned_index(kept: Sequence[Unit]) -> torch.Tensor:
    """Indices of the hidden neurons ``kept`` hold (their first slice's range), in unit order."""
    ranges = [(u.slices[0].start, u.slices[0].stop) for u in kept]
    return torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)


def rescale_factor(n_units: int, n_kept: int, rescale: bool) -> float:
    """``K/n`` for a group of ``K = n_units`` units of which ``n = n_kept`` are kept (inverted-dropout
    style) when ``rescale``, else 1."""
    return n_units / max(1, n_kept) if rescale else 1.0


def narrow_parameter(t: torch.Tensor, dim: int, idx: torch.Tensor) -> nn.Parameter:
    """A new parameter holding entries ``idx`` of ``t`` along ``dim``, with ``t``'s ``requires_grad``."""
    return nn.Parameter(t.detach().index_select(dim, idx).clone(), requires_grad=t.requires_grad)


def add_pieces(pieces: dict[str, list[Piece]], unit_of: dict[str, int | None], kept: Sequence[Unit]) -> None:
    """Append the slices of ``kept`` (ascending ids) to the local layout of their tensors.

    A tensor holding one unit's piece maps to that unit; one holding several maps to None.
    """
    for u in kept:
        for s in u.slices + u.buffers:
            local = pieces.setdefault(s.name, [])
            off = local[-1].local_stop if local else 0
            local.append(Piece(s.name, s.dim, s.start, s.stop, off, off + s.stop - s.start))
            unit_of[s.name] = u.id if len(local) == 1 else None


def complete_param_map(model: nn.Module, partition: Partition, pieces: dict[str, list[Piece]],
                       unit_of: dict[str, int | None]) -> ParamMap:
    """The :class:`ParamMap` of a narrowed model, given the pieces of its cut tensors.

    A cut tensor of which no unit is owned holds nothing global; every tensor no unit cuts is the
    whole global tensor of the same name (shared).
    """
    for u in partition.units:
        for s in u.slices + u.buffers:
            pieces.setdefault(s.name, [])
            unit_of.setdefault(s.name, None)
    for name in tensor_names(model):
        if name not in pieces:
            pieces[name] = [Piece(name)]
            unit_of[name] = None
    return ParamMap(pieces, unit_of)

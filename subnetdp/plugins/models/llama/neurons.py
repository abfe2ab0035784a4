"""Neuron-level units of the LLaMA adapter: ranges of each block's SwiGLU hidden dimension.

Per transformer layer ``i`` one group ``layers.i.feed_forward`` of ``units_per_layer`` equal ranges
``[a, b)`` of the hidden dimension. A unit holds rows ``[a, b)`` of the gate ``w1`` and the up
projection ``w3`` (dim 0) and columns ``[a, b)`` of the down projection ``w2`` (dim 1). Attention,
norms, the embedding and the head are shared. A materialised MLP is physically narrower: it keeps
only the owned ranges, in ascending unit order.

Cost of a unit, analytically: ``2 * 3 * dim * (b - a)`` forward FLOPs per token (three matrix
products of ``dim x (b - a)``, two FLOPs per multiply-add; the SiLU and the product are ignored),
times the sequence length, so per sample as for block level.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from subnetdp import DataSpec, ParamMap, Partition, Piece, TensorSlice, Unit
from subnetdp.plugins.models._blocks import assemble_partition
from subnetdp.plugins.models._neurons import (ScaleOutput, add_pieces, check_units_per_layer, complete_param_map,
                                              cut_ranges, narrow_parameter, owned_by_group, owned_index,
                                              rescale_factor)

MLP_WEIGHTS = (("w1", 0), ("w3", 0), ("w2", 1))  # (linear, dim cut along)


def neuron_partition(model: nn.Module, spec: DataSpec, units_per_layer: int) -> Partition:
    """Cut every block's SwiGLU hidden dimension into ``units_per_layer`` equal ranges."""
    a_ = model.args
    check_units_per_layer(units_per_layer, a_.hidden_dim, f"the SwiGLU hidden dimension is only {a_.hidden_dim}")
    seq = spec.seq_len or a_.max_seq_len
    units: list[Unit] = []
    for key in model.layers.keys():
        group = f"layers.{key}.feed_forward"
        for j, (a, b) in enumerate(cut_ranges(a_.hidden_dim, units_per_layer)):
            params = tuple(TensorSlice(f"{group}.{w}.weight", dim, a, b) for w, dim in MLP_WEIGHTS)
            units.append(Unit(len(units), f"{group}.n{j}", group, 6.0 * a_.dim * (b - a) * seq, params))
    return assemble_partition(model, "neuron", units)


def _narrow(linear: nn.Linear, dim: int, idx: torch.Tensor) -> None:
    """Keep rows (``dim=0``) or columns (``dim=1``) ``idx`` of a bias-free ``linear``, in place."""
    linear.weight = narrow_parameter(linear.weight, dim, idx)
    if dim == 0:
        linear.out_features = int(idx.numel())
    else:
        linear.in_features = int(idx.numel())


def materialize_neurons(model: nn.Module, owned: Sequence[int], partition: Partition,
                        rescale: bool) -> tuple[nn.Module, ParamMap]:
    """Narrow every block's MLP to its owned hidden ranges; returns the model and its :class:`ParamMap`."""
    groups = partition.groups()
    kept = owned_by_group(partition, owned)
    pieces: dict[str, list[Piece]] = {}
    unit_of: dict[str, int | None] = {}
    for key, block in model.layers.items():
        group = f"layers.{key}.feed_forward"
        mine = kept[group]
        idx = owned_index(mine)
        for w, dim in MLP_WEIGHTS:
            _narrow(getattr(block.feed_forward, w), dim, idx)
        scale = rescale_factor(len(groups[group]), len(mine), rescale)
        block.feed_forward.hidden_scale = scale
        block.feed_forward.register_forward_hook(ScaleOutput(scale))
        add_pieces(pieces, unit_of, mine)
    return model, complete_param_map(model, partition, pieces, unit_of)

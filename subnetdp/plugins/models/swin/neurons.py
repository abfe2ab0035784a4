"""Neuron-level units of torchvision Swin Transformers: ranges of each block's MLP hidden dimension.

A Swin block's MLP is ``nn.Sequential(Linear(dim, h), GELU, Dropout, Linear(h, dim), Dropout)``. For
every block ``features.s.b`` the hidden dimension ``h`` is cut into ``units_per_layer`` equal ranges
``[a, b)``, one group ``features.s.b.mlp`` per block; a unit holds rows ``[a, b)`` of ``mlp.0.weight``,
entries ``[a, b)`` of ``mlp.0.bias`` and columns ``[a, b)`` of ``mlp.3.weight``. Attention, norms,
relative-position tables and ``mlp.3.bias`` are shared; the residual stream is never cut.

A materialised block's MLP holds only the owned ranges, in ascending unit order, as physically
narrower ``nn.Linear`` layers. With ``rescale`` the hidden activation (the input of ``mlp.3``) is
multiplied by ``K_g / n_g`` in training, as inverted dropout does; ``mlp.3.bias`` is not scaled.

Cost: forward FLOPs per sample of ``mlp.0`` plus ``mlp.3``, measured with ``FlopCounterMode`` and
divided evenly among the block's units (both matmuls are linear in ``h``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from subnetdp import DataSpec, ParamMap, Partition, Piece, TensorSlice, Unit
from subnetdp.plugins.models._blocks import assemble_partition, measure_module_flops
from subnetdp.plugins.models._neurons import (ScaleInput, add_pieces, check_units_per_layer, complete_param_map,
                                              cut_ranges, owned_by_group, owned_index, rescale_factor)


def mlp_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of every Swin block, in order (``features.1.0``, ``features.1.1``, ...)."""
    return [(f"features.{si}.{bi}", block) for si in range(1, len(model.features), 2)
            for bi, block in enumerate(model.features[si])]


def neuron_partition(model: nn.Module, spec: DataSpec, units_per_layer: int) -> Partition:
    """Cut every block's MLP hidden dimension into ``units_per_layer`` equal ranges (one group per block)."""
    flops = measure_module_flops(model, spec, default_size=224)
    units: list[Unit] = []
    for name, block in mlp_blocks(model):
        mlp = f"{name}.mlp"
        width = block.mlp[0].out_features
        check_units_per_layer(units_per_layer, width, f"block {name} has only {width} MLP hidden neurons")
        cost = (flops.get(f"{mlp}.0", 0.0) + flops.get(f"{mlp}.3", 0.0)) / units_per_layer
        for j, (a, b) in enumerate(cut_ranges(width, units_per_layer)):
            params = (TensorSlice(f"{mlp}.0.weight", 0, a, b), TensorSlice(f"{mlp}.0.bias", 0, a, b),
                      TensorSlice(f"{mlp}.3.weight", 1, a, b))
            units.append(Unit(len(units), f"{mlp}.n{j}", mlp, cost, params, ()))
    return assemble_partition(model, "neuron", units)


def _narrow_linear(layer: nn.Linear, dim: int, idx: torch.Tensor) -> nn.Linear:
    """A new ``nn.Linear`` keeping rows (``dim=0``, with the bias) or columns (``dim=1``) ``idx``."""
    n = int(idx.numel())
    in_f, out_f = (layer.in_features, n) if dim == 0 else (n, layer.out_features)
    has_bias = layer.bias is not None
    new = nn.Linear(in_f, out_f, bias=has_bias, device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(layer.weight.index_select(dim, idx))
        if has_bias:
            new.bias.copy_(layer.bias.index_select(0, idx) if dim == 0 else layer.bias)
    new.weight.requires_grad_(layer.weight.requires_grad)
    if has_bias:
        new.bias.requires_grad_(layer.bias.requires_grad)
    return new


def materialize_neurons(model: nn.Module, owned: Sequence[int], partition: Partition,
                        rescale: bool) -> tuple[nn.Module, ParamMap]:
    """Narrow every block's MLP to its owned hidden ranges; returns the model and its :class:`ParamMap`."""
    groups = partition.groups()
    kept_by_group = owned_by_group(partition, owned)
    pieces: dict[str, list[Piece]] = {}
    unit_of: dict[str, int | None] = {}
    for name, block in mlp_blocks(model):
        group = f"{name}.mlp"
        kept = kept_by_group[group]
        idx = owned_index(kept)
        block.mlp[0] = _narrow_linear(block.mlp[0], 0, idx)
        block.mlp[3] = _narrow_linear(block.mlp[3], 1, idx)
        scale = rescale_factor(len(groups[group]), len(kept), rescale)
        block.hidden_scale = scale
        block.mlp[3].register_forward_pre_hook(ScaleInput(scale))
        add_pieces(pieces, unit_of, kept)
    return model, complete_param_map(model, partition, pieces, unit_of)

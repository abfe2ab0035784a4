"""Neuron-level units of torchvision ResNets: ranges of a block's inner channels.

BasicBlock: ``conv1`` out = ``bn1`` = ``conv2`` in. Bottleneck: ``conv2`` out = ``bn2`` = ``conv3``
in (``conv1`` stays whole). The residual stream (block outputs, ``bn2``/``bn3``, shortcuts) is never
cut. A materialised block keeps only the owned channels, in ascending unit order, as physically
narrower layers.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from subnetdp import DataSpec, ParamMap, Partition, Piece, TensorSlice, Unit
from subnetdp.plugins.models._blocks import assemble_partition, measure_module_flops
from subnetdp.plugins.models._neurons import (ScaleInput, add_pieces, check_units_per_layer, complete_param_map,
                                              cut_ranges, narrow_parameter, owned_by_group, owned_index,
                                              rescale_factor)

STAGES = ("layer1", "layer2", "layer3", "layer4")


def hidden_layers(block: nn.Module) -> tuple[str, str, str]:
    """Names of (producing conv, its BatchNorm, consuming conv) of a block's inner channels."""
    if isinstance(block, Bottleneck):
        return "conv2", "bn2", "conv3"
    if isinstance(block, BasicBlock):
        return "conv1", "bn1", "conv2"
    raise TypeError(f"not a torchvision ResNet block: {type(block).__name__}")


def neuron_partition(model: nn.Module, spec: DataSpec, units_per_layer: int) -> Partition:
    """Cut every block's inner channels into ``units_per_layer`` equal ranges (one group per block)."""
    flops = measure_module_flops(model, spec, default_size=32)
    units: list[Unit] = []
    for stage in STAGES:
        for bi, block in enumerate(getattr(model, stage)):
            prefix = f"{stage}.{bi}."
            prod, bn, cons = hidden_layers(block)
            width = getattr(block, prod).out_channels
            check_units_per_layer(units_per_layer, width, f"block {prefix[:-1]} has only {width} inner channels")
            cost = (flops.get(prefix + prod, 0.0) + flops.get(prefix + cons, 0.0)) / units_per_layer
            for j, (a, b) in enumerate(cut_ranges(width, units_per_layer)):
                params = (TensorSlice(f"{prefix}{prod}.weight", 0, a, b), TensorSlice(f"{prefix}{bn}.weight", 0, a, b),
                          TensorSlice(f"{prefix}{bn}.bias", 0, a, b), TensorSlice(f"{prefix}{cons}.weight", 1, a, b))
                buffers = (TensorSlice(f"{prefix}{bn}.running_mean", 0, a, b),
                           TensorSlice(f"{prefix}{bn}.running_var", 0, a, b))
                units.append(Unit(len(units), f"{prefix}n{j}", prefix[:-1], cost, params, buffers))
    return assemble_partition(model, "neuron", units)


def _narrow_batchnorm(bn: nn.BatchNorm2d, idx: torch.Tensor) -> nn.BatchNorm2d:
    """A new BatchNorm over channels ``idx`` of ``bn`` (affine parameters and running statistics)."""
    narrow = nn.BatchNorm2d(int(idx.numel()), eps=bn.eps, momentum=bn.momentum)
    with torch.no_grad():
        narrow.weight.copy_(bn.weight[idx])
        narrow.bias.copy_(bn.bias[idx])
        narrow.running_mean.copy_(bn.running_mean[idx])
        narrow.running_var.copy_(bn.running_var[idx])
        narrow.num_batches_tracked.copy_(bn.num_batches_tracked)
    return narrow


def materialize_neurons(model: nn.Module, owned: Sequence[int], partition: Partition,
                        rescale: bool) -> tuple[nn.Module, ParamMap]:
    """Narrow every block to its owned channel ranges; returns the model and its :class:`ParamMap`."""
    groups = partition.groups()
    by_group = owned_by_group(partition, owned)
    pieces: dict[str, list[Piece]] = {}
    unit_of: dict[str, int | None] = {}
    for stage in STAGES:
        for bi, block in enumerate(getattr(model, stage)):
            group = f"{stage}.{bi}"
            kept = by_group[group]
            prod_name, bn_name, cons_name = hidden_layers(block)
            prod, bn, cons = (getattr(block, n) for n in (prod_name, bn_name, cons_name))
            idx = owned_index(kept)
            n = int(idx.numel())
            prod.weight = narrow_parameter(prod.weight, 0, idx)
            prod.out_channels = n
            setattr(block, bn_name, _narrow_batchnorm(bn, idx))
            cons.weight = narrow_parameter(cons.weight, 1, idx)
            cons.in_channels = n
            scale = rescale_factor(len(groups[group]), len(kept), rescale)
            block.hidden_scale = scale
            cons.register_forward_pre_hook(ScaleInput(scale))
            add_pieces(pieces, unit_of, kept)
    return model, complete_param_map(model, partition, pieces, unit_of)

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
from torch.utils.flop_counter import FlopCounterMode
from torchvision.models.resnet import BasicBlock, Bottleneck

from subnetdp.core.contracts import DataSpec, ParamMap, Partition, Piece, TensorSlice, Unit
from subnetdp.core.errors import ConfigError

STAGES = ("layer1", "layer2", "layer3", "layer4")


def hidden_layers(block: nn.Module) -> tuple[str, str, str]:
    """Names of (producing conv, its BatchNorm, consuming conv) of a block's inner channels."""
    if isinstance(block, Bottleneck):
        return "conv2", "bn2", "conv3"
    if isinstance(block, BasicBlock):
        return "conv1", "bn1", "conv2"
    raise TypeError(f"not a torchvision ResNet block: {type(block).__name__}")


def _module_flops(model: nn.Module, spec: DataSpec) -> dict[str, float]:
    size = spec.image_size or 32
    x = torch.zeros(1, spec.in_channels or 3, size, size)
    counter = FlopCounterMode(display=False)
    was_training = model.training
    model.eval()
    with torch.no_grad(), counter:
        model(x)
    model.train(was_training)
    return {k.split(".", 1)[1] if "." in k else k: float(sum(v.values())) for k, v in counter.get_flop_counts().items()}


def neuron_partition(model: nn.Module, spec: DataSpec, units_per_layer: int) -> Partition:
    """Cut every block's inner channels into ``units_per_layer`` equal ranges (one group per block)."""
    flops = _module_flops(model, spec)
    units: list[Unit] = []
    in_unit: set[str] = set()
    for stage in STAGES:
        for bi, block in enumerate(getattr(model, stage)):
            prefix = f"{stage}.{bi}."
            prod, bn, cons = hidden_layers(block)
            width = getattr(block, prod).out_channels
            if units_per_layer > width:
                raise ConfigError("masker.units_per_layer", units_per_layer,
                                  f"block {prefix[:-1]} has only {width} inner channels",
                                  f"use masker.units_per_layer <= {width}")
            cost = (flops.get(prefix + prod, 0.0) + flops.get(prefix + cons, 0.0)) / units_per_layer
            for j in range(units_per_layer):
                a, b = j * width // units_per_layer, (j + 1) * width // units_per_layer
                params = (TensorSlice(f"{prefix}{prod}.weight", 0, a, b), TensorSlice(f"{prefix}{bn}.weight", 0, a, b),
                          TensorSlice(f"{prefix}{bn}.bias", 0, a, b), TensorSlice(f"{prefix}{cons}.weight", 1, a, b))
                buffers = (TensorSlice(f"{prefix}{bn}.running_mean", 0, a, b),
                           TensorSlice(f"{prefix}{bn}.running_var", 0, a, b))
                in_unit.update(s.name for s in params + buffers)
                units.append(Unit(len(units), f"{prefix}n{j}", prefix[:-1], cost, params, buffers))
    shapes, dtypes = Partition.tensor_info(model)
    shared = [n for n, _ in model.named_parameters() if n not in in_unit]
    shared_buffers = [n for n, _ in model.named_buffers() if n not in in_unit]
    return Partition("neuron", units, shared, shared_buffers, shapes, dtypes)


class ScaleInput:
    """Forward pre-hook: multiply a layer's input by ``scale`` in training (``K/n`` rescaling)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, module: nn.Module, args: tuple) -> tuple | None:
        if module.training and self.scale != 1.0:
            return (args[0] * self.scale,) + tuple(args[1:])
        return None


def _narrow_param(t: torch.Tensor, dim: int, idx: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().index_select(dim, idx).clone(), requires_grad=t.requires_grad)


def materialize_neurons(model: nn.Module, owned: Sequence[int], partition: Partition,
                        rescale: bool) -> tuple[nn.Module, ParamMap]:
    """Narrow every block to its owned channel ranges; returns the model and its :class:`ParamMap`."""
    mine = sorted(set(owned))
    by_group: dict[str, list[Unit]] = {}
    for u in partition.units:
        by_group.setdefault(u.group, [])
    for uid in mine:
        by_group[partition.units[uid].group].append(partition.units[uid])
    groups = partition.groups()
    pieces: dict[str, list[Piece]] = {}
    unit_of: dict[str, int | None] = {}
    for stage in STAGES:
        for bi, block in enumerate(getattr(model, stage)):
            group = f"{stage}.{bi}"
            kept = by_group[group]
            prod_name, bn_name, cons_name = hidden_layers(block)
            prod, bn, cons = (getattr(block, n) for n in (prod_name, bn_name, cons_name))
            ranges = [(u.slices[0].start, u.slices[0].stop) for u in kept]
            idx = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)
            n = int(idx.numel())
            prod.weight = _narrow_param(prod.weight, 0, idx)
            prod.out_channels = n
            narrow_bn = nn.BatchNorm2d(n, eps=bn.eps, momentum=bn.momentum)
            with torch.no_grad():
                narrow_bn.weight.copy_(bn.weight[idx])
                narrow_bn.bias.copy_(bn.bias[idx])
                narrow_bn.running_mean.copy_(bn.running_mean[idx])
                narrow_bn.running_var.copy_(bn.running_var[idx])
                narrow_bn.num_batches_tracked.copy_(bn.num_batches_tracked)
            setattr(block, bn_name, narrow_bn)
            cons.weight = _narrow_param(cons.weight, 1, idx)
            cons.in_channels = n
            scale = len(groups[group]) / max(1, len(kept)) if rescale else 1.0
            block.hidden_scale = scale
            cons.register_forward_pre_hook(ScaleInput(scale))
            for u in kept:
                for s in u.slices + u.buffers:
                    local = pieces.setdefault(s.name, [])
                    off = local[-1].local_stop if local else 0
                    local.append(Piece(s.name, s.dim, s.start, s.stop, off, off + s.stop - s.start))
                    unit_of[s.name] = u.id if len(local) == 1 else None
    for u in partition.units:  # a tensor of which this rank owns no piece holds nothing global
        for s in u.slices + u.buffers:
            pieces.setdefault(s.name, [])
            unit_of.setdefault(s.name, None)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    for name in names:
        if name not in pieces:
            pieces[name] = [Piece(name)]
            unit_of[name] = None
    return model, ParamMap(pieces, unit_of)

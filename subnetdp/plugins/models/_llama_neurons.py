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

from typing import Any, Sequence

import torch
from torch import nn

from subnetdp.core.contracts import DataSpec, ParamMap, Partition, Piece, TensorSlice, Unit
from subnetdp.core.errors import ConfigError

MLP_WEIGHTS = (("w1", 0), ("w3", 0), ("w2", 1))  # (linear, dim cut along)


def neuron_partition(model: nn.Module, spec: DataSpec, units_per_layer: int) -> Partition:
    """Cut every block's SwiGLU hidden dimension into ``units_per_layer`` equal ranges."""
    a_ = model.args
    if units_per_layer > a_.hidden_dim:
        raise ConfigError("masker.units_per_layer", units_per_layer,
                          f"the SwiGLU hidden dimension is only {a_.hidden_dim}",
                          f"use masker.units_per_layer <= {a_.hidden_dim}")
    seq = spec.seq_len or a_.max_seq_len
    units: list[Unit] = []
    in_unit: set[str] = set()
    for key in model.layers.keys():
        group = f"layers.{key}.feed_forward"
        for j in range(units_per_layer):
            a, b = j * a_.hidden_dim // units_per_layer, (j + 1) * a_.hidden_dim // units_per_layer
            params = tuple(TensorSlice(f"{group}.{w}.weight", dim, a, b) for w, dim in MLP_WEIGHTS)
            in_unit.update(s.name for s in params)
            units.append(Unit(len(units), f"{group}.n{j}", group, 6.0 * a_.dim * (b - a) * seq, params))
    shapes, dtypes = Partition.tensor_info(model)
    shared = [n for n, _ in model.named_parameters() if n not in in_unit]
    return Partition("neuron", units, shared, [n for n, _ in model.named_buffers()], shapes, dtypes)


class ScaleOutput:
    """Forward hook: multiply a module's output by ``scale`` in training (``K/n`` rescaling)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if module.training and self.scale != 1.0:
            return out * self.scale
        return None


def _narrow(linear: nn.Linear, dim: int, idx: torch.Tensor) -> None:
    w = linear.weight
    linear.weight = nn.Parameter(w.detach().index_select(dim, idx).clone(), requires_grad=w.requires_grad)
    if dim == 0:
        linear.out_features = int(idx.numel())
    else:
        linear.in_features = int(idx.numel())


def materialize_neurons(model: nn.Module, owned: Sequence[int], partition: Partition,
                        rescale: bool) -> tuple[nn.Module, ParamMap]:
    """Narrow every block's MLP to its owned hidden ranges; returns the model and its :class:`ParamMap`."""
    groups = partition.groups()
    kept: dict[str, list[Unit]] = {g: [] for g in groups}
    for uid in sorted(set(owned)):
        kept[partition.units[uid].group].append(partition.units[uid])
    pieces: dict[str, list[Piece]] = {}
    unit_of: dict[str, int | None] = {}
    for key, block in model.layers.items():
        group = f"layers.{key}.feed_forward"
        mine = kept[group]
        ranges = [(u.slices[0].start, u.slices[0].stop) for u in mine]
        idx = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)
        for w, dim in MLP_WEIGHTS:
            _narrow(getattr(block.feed_forward, w), dim, idx)
        scale = len(groups[group]) / max(1, len(mine)) if rescale else 1.0
        block.feed_forward.hidden_scale = scale
        block.feed_forward.register_forward_hook(ScaleOutput(scale))
        for u in mine:
            for s in u.slices:
                local = pieces.setdefault(s.name, [])
                off = local[-1].local_stop if local else 0
                local.append(Piece(s.name, s.dim, s.start, s.stop, off, off + s.stop - s.start))
                unit_of[s.name] = u.id if len(local) == 1 else None
    for u in partition.units:  # a tensor of which this rank owns no piece holds nothing global
        for s in u.slices:
            pieces.setdefault(s.name, [])
            unit_of.setdefault(s.name, None)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    for name in names:
        if name not in pieces:
            pieces[name] = [Piece(name)]
            unit_of[name] = None
    return model, ParamMap(pieces, unit_of)

"""What the model adapters share: FLOP counts, block units, partition assembly, identity maps,
classification metrics, and the two base classes built from them.

A block-level unit is one module taken whole: every parameter and buffer under it (optionally
less those under a skipped child, such as a ResNet block's shortcut) is a full-tensor
:class:`TensorSlice`. Whatever no unit holds is shared. A block-level subnetwork keeps the owned
modules under their original names, so its :class:`ParamMap` is the identity.

:class:`BlockAdapter` is that recipe as a base class (llama, resnet, swin): block level from the
blocks a subclass names, neuron level handed to the model's ``neurons.py``.
:class:`ImageClassifierAdapter` adds what the torchvision classifiers (resnet, swin) also share:
block costs measured with one forward of a zero image, cross entropy, accuracy.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from subnetdp import ConfigError, DataSpec, ModelAdapter, ParamMap, Partition, TensorSlice, Unit, suggest


def check_variant(variant: str, variants: Sequence[str]) -> None:
    """``model.variant`` must be one of ``variants``: else one line naming them (and the closest)."""
    if variant not in variants:
        raise ConfigError("model.variant", variant, f"valid choices: {', '.join(variants)}" + suggest(variant, variants))


def measure_module_flops(model: nn.Module, spec: DataSpec, default_size: int) -> dict[str, float]:
    """Forward FLOPs per sample of every module, from one eval-mode forward of a zero image.

    Args:
        model: an image model taking ``(N, C, H, W)``; its training flag is restored afterwards.
        spec: the data; ``image_size`` and ``in_channels`` size the input (``default_size`` and 3
            when unset).
        default_size: the image side when ``spec.image_size`` is 0.

    Returns:
        module name (as in ``model.named_modules()``) -> FLOPs; the root appears under its class name.
    """
    size = spec.image_size or default_size
    # On the model's device: a model on ``meta`` is measured without computing anything.
    x = torch.zeros(1, spec.in_channels or 3, size, size, device=next(model.parameters()).device)
    counter = FlopCounterMode(display=False)
    was_training = model.training
    model.eval()
    with torch.no_grad(), counter:
        model(x)
    model.train(was_training)
    # FlopCounterMode prefixes every name with the root's class name: strip it.
    return {k.split(".", 1)[1] if "." in k else k: float(sum(v.values()))
            for k, v in counter.get_flop_counts().items()}


def make_block_unit(uid: int, name: str, group: str, cost: float, block: nn.Module,
                    skip: str | None = None) -> Unit:
    """A unit holding every parameter and buffer of ``block`` whole, under global prefix ``name``.

    Args:
        uid: the unit's id (its position in the partition).
        name: the block's global module name, e.g. ``layer2.1``.
        group: the group the masker draws from in equal measure.
        cost: forward FLOPs per sample of the unit.
        block: the module.
        skip: a child of ``block`` whose tensors stay out of the unit (shared), e.g. ``downsample``.
    """
    def kept(n: str) -> bool:
        return skip is None or not n.startswith(skip + ".")

    params = tuple(TensorSlice(f"{name}.{n}") for n, _ in block.named_parameters() if kept(n))
    buffers = tuple(TensorSlice(f"{name}.{n}") for n, _ in block.named_buffers() if kept(n))
    return Unit(uid, name, group, cost, params, buffers)


def assemble_partition(model: nn.Module, granularity: str, units: list[Unit]) -> Partition:
    """The :class:`Partition` of ``model`` into ``units``; every tensor no unit names is shared."""
    in_unit = {s.name for u in units for s in u.slices + u.buffers}
    shapes, dtypes = Partition.tensor_info(model)
    shared = [n for n, _ in model.named_parameters() if n not in in_unit]
    shared_buffers = [n for n, _ in model.named_buffers() if n not in in_unit]
    return Partition(granularity, units, shared, shared_buffers, shapes, dtypes)


def tensor_names(model: nn.Module) -> list[str]:
    """Names of every parameter, then every buffer, of ``model``."""
    return [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]


def identity_param_map(model: nn.Module, partition: Partition) -> ParamMap:
    """The map of a block-level subnetwork: local names are global names, whole tensors each.

    Args:
        model: the subnetwork (owned blocks under their original names).
        partition: the full model's partition; a tensor of a unit maps to that unit, others to None.
    """
    unit_of: dict[str, int | None] = {s.name: u.id for u in partition.units for s in u.slices + u.buffers}
    return ParamMap.identity(tensor_names(model), unit_of)


def classification_metrics(outputs: Sequence[torch.Tensor], batches: Sequence[Any]) -> dict[str, float]:
    """Accuracy and mean cross entropy of logits ``outputs`` against labels ``batch[1]``."""
    logits = torch.cat(list(outputs))
    labels = torch.cat([b[1] for b in batches])
    return {"accuracy": float((logits.argmax(1) == labels).float().mean()),
            "loss": float(F.cross_entropy(logits, labels))}


class BlockAdapter(ModelAdapter):
    """A model whose block-level units are its blocks, whole, and whose neuron-level code lives in
    its ``neurons.py``: the adapter's ``partition`` and ``materialize`` for both levels.

    A subclass names its blocks (:meth:`named_blocks`) and their costs (:meth:`block_costs`), says
    how a subnetwork loses the blocks it does not own (:meth:`drop_blocks`, which is called again on a
    subnetwork it made, to drop more of them in place: :meth:`drop_units`), and sets
    ``neuron_partition`` and ``materialize_neurons`` (as ``staticmethod``) to its neuron-level functions.
    """

    granularities = ("block", "neuron")
    regularizers = ("stochastic_depth", "hidden_dropout")
    #: A child of every block whose tensors stay shared (a ResNet block's shortcut), or None.
    shortcut: ClassVar[str | None] = None
    #: ``(model, spec, units_per_layer) -> Partition`` at neuron level.
    neuron_partition: Callable[..., Partition]
    #: ``(model, owned, partition, rescale) -> (submodel, ParamMap)`` at neuron level.
    materialize_neurons: Callable[..., tuple[nn.Module, ParamMap]]

    @abc.abstractmethod
    def named_blocks(self, model: nn.Module) -> list[tuple[str, str, nn.Module]]:
        """``(global name, group, block)`` of every block of the full model, in forward order."""

    @abc.abstractmethod
    def block_costs(self, model: nn.Module, spec: DataSpec) -> dict[str, float]:
        """Forward FLOPs per sample of each block-level unit, by block name."""

    @abc.abstractmethod
    def drop_blocks(self, model: nn.Module, keep: set[str]) -> None:
        """Remove from ``model``, in place, every block whose name is not in ``keep``."""

    def partition(self, model: nn.Module, granularity: str, spec: DataSpec, units_per_layer: int = 8) -> Partition:
        if granularity == "neuron":
            return self.neuron_partition(model, spec, units_per_layer)
        if granularity != "block":
            raise ConfigError("masker.granularity", granularity, f"the {self.name} adapter supports: block, neuron")
        costs = self.block_costs(model, spec)
        units = [make_block_unit(i, name, group, costs[name], block, skip=self.shortcut)
                 for i, (name, group, block) in enumerate(self.named_blocks(model))]
        return assemble_partition(model, "block", units)

    def materialize(self, model: nn.Module, owned: Sequence[int], partition: Partition,
                    rescale: bool = False) -> tuple[nn.Module, ParamMap]:
        if partition.granularity == "neuron":
            return self.materialize_neurons(model, owned, partition, rescale)
        self.drop_blocks(model, {partition.units[u].name for u in owned})
        return model, identity_param_map(model, partition)

    def drop_units(self, submodel: nn.Module, owned: Sequence[int], partition: Partition) -> ParamMap | None:
        """Block level: :meth:`drop_blocks` again, on the subnetwork (it keys blocks by their original
        indices); neuron level: None (a narrowed tensor would change shape)."""
        if partition.granularity != "block":
            return None
        self.drop_blocks(submodel, {partition.units[u].name for u in owned})
        return identity_param_map(submodel, partition)


class ImageClassifierAdapter(BlockAdapter):
    """A torchvision image classifier cut into blocks (resnet, swin): logits scored with cross entropy
    and accuracy, block costs measured with ``FlopCounterMode``."""

    #: The image side the costs are measured at when the data does not give one.
    default_image_size: ClassVar[int] = 32

    def block_costs(self, model: nn.Module, spec: DataSpec) -> dict[str, float]:
        """Forward FLOPs per sample of each block less its shared ``shortcut`` (the residual branch
        alone, for a ResNet block), measured with one eval-mode forward of a zero image."""
        flops = measure_module_flops(model, spec, default_size=self.default_image_size)
        return {name: flops.get(name, 0.0) - (flops.get(f"{name}.{self.shortcut}", 0.0) if self.shortcut else 0.0)
                for name, _, _ in self.named_blocks(model)}

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(output, batch[1])

    def metrics(self, outputs: Sequence[torch.Tensor], batches: Sequence[Any]) -> dict[str, float]:
        return classification_metrics(outputs, batches)

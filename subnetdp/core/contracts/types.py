"""The data types the core and its plugins exchange: units, partitions, pieces, the launch environment."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch
    from torch import nn

# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class TensorSlice:
    """A piece of one global tensor: the whole tensor (``dim`` None) or ``[start, stop)`` along ``dim``."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


@dataclass(frozen=True)
class Unit:
    """The smallest thing a mask keeps or drops.

    Attributes:
        id: position in the partition (units are numbered 0..K-1 in forward order).
        name: human-readable name, e.g. ``layer2.1``.
        group: the group the masker draws from in equal measure (``layer2`` for a ResNet stage).
        cost: forward FLOPs per sample of the unit (measured with ``FlopCounterMode``).
        slices: the parameter pieces the unit consists of.
        buffers: the buffer pieces (BatchNorm statistics) that belong to the unit.
    """

    id: int
    name: str
    group: str
    cost: float
    slices: tuple[TensorSlice, ...]
    buffers: tuple[TensorSlice, ...] = ()


@dataclass
class Partition:
    """How a full model divides into units and shared tensors.

    Attributes:
        granularity: ``block`` or ``neuron``.
        units: the units in forward order; ``units[i].id == i``.
        shared: global names of the parameters outside every unit (averaged over all ranks).
        shared_buffers: global names of buffers outside every unit.
        shapes: global name -> shape, for every parameter and buffer of the full model.
        dtypes: global name -> dtype, likewise.
    """

    granularity: str
    units: list[Unit]
    shared: list[str]
    shared_buffers: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, "torch.dtype"] = field(default_factory=dict)

    @staticmethod
    def tensor_info(model: "nn.Module") -> tuple[dict[str, tuple[int, ...]], dict[str, "torch.dtype"]]:
        """Shapes and dtypes of every parameter and buffer of ``model``, in module order."""
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, "torch.dtype"] = {}
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            shapes[name] = tuple(t.shape)
            dtypes[name] = t.dtype
        return shapes, dtypes

    def unit_numel(self, unit: Unit) -> int:
        """Number of parameter elements in ``unit``."""
        total = 0
        for s in unit.slices:
            shape = self.shapes[s.name]
            n = 1
            for d in shape:
                n *= d
            if s.dim is not None:
                n = n // shape[s.dim] * (s.stop - s.start)
            total += n
        return total

    def shared_numel(self) -> int:
        total = 0
        for name in self.shared:
            n = 1
            for d in self.shapes[name]:
                n *= d
            total += n
        return total

    def groups(self) -> dict[str, list[Unit]]:
        """Units by group, groups in order of first appearance."""
        out: dict[str, list[Unit]] = {}
        for u in self.units:
            out.setdefault(u.group, []).append(u)
        return out


@dataclass(frozen=True)
class Piece:
    """Where part of a local tensor lives in the full model.

    ``local[local_start:local_stop]`` along ``dim`` equals ``global_name[global_start:global_stop]``;
    ``dim`` None means the whole tensor maps to the whole global tensor.
    """

    global_name: str
    dim: int | None = None
    global_start: int = 0
    global_stop: int = 0
    local_start: int = 0
    local_stop: int = 0


@dataclass
class ParamMap:
    """For each tensor of a materialised subnetwork, the pieces of the full model it holds.

    Attributes:
        pieces: local name -> pieces (owned units sit in ascending id order in the local layout).
        unit_of: local name -> id of the unit the tensor belongs to, or None for a shared tensor
            or one that holds pieces of several units (its pieces then say where each lies).
    """

    pieces: dict[str, list[Piece]]
    unit_of: dict[str, int | None]

    @classmethod
    def identity(cls, names: Iterable[str], unit_of: dict[str, int | None]) -> "ParamMap":
        """A map in which every local tensor is the global tensor of the same name."""
        names = list(names)
        return cls({n: [Piece(n)] for n in names}, {n: unit_of.get(n) for n in names})

    def global_names(self) -> list[str]:
        return [p.global_name for ps in self.pieces.values() for p in ps]


@dataclass(frozen=True)
class DataSpec:
    """What the model needs to know about the data before it is built."""

    in_channels: int = 0
    image_size: int = 0
    num_classes: int = 0
    vocab_size: int = 0
    seq_len: int = 0


@dataclass(frozen=True)
class HiddenSite:
    """Where a block's hidden channels can be reached (what :meth:`ModelAdapter.hidden_sites` returns).

    Attributes:
        module: the module whose input (``where="input"``) or output (``where="output"``) they are.
        dim: their dimension in that activation.
        where: ``input`` or ``output``.
    """

    module: "nn.Module"
    dim: int
    where: str = "input"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits: filled by :mod:`subnetdp.launchers` from the environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"

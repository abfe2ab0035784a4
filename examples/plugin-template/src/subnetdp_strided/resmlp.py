"""Model ``resmlp``: a residual MLP classifier whose residual blocks are the units.

``stem`` (flatten, Linear to ``model.width``), ``model.depth`` blocks ``x + fc2(relu(fc1(norm(x))))``
and a ``head``. Each block is one unit, all in one group; the stem and the head are shared. A dropped
block is the identity, so a rank's subnetwork is the same model with fewer blocks, and its tensors
keep the full model's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from subnetdp import ConfigError, DataSpec, ModelAdapter, ModelConfig, ParamMap, Partition, TensorSlice, Unit, hookimpl


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class ResMLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        # Keyed by the block's index, so a subnetwork's names are the full model's names.
        self.blocks = nn.ModuleDict({str(i): Block(width) for i in range(depth)})
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images.flatten(1))
        for block in self.blocks.values():  # only the blocks this rank holds
            x = block(x)
        return self.head(x)


class ResMLPAdapter(ModelAdapter):
    """Builds the model, cuts it into units and keeps a rank's own blocks."""

    @dataclass
    class Config(ModelConfig):  # model.name and model.variant, plus:
        width: int = 64
        depth: int = 4

    granularities = ("block",)  # the masker.granularity values this adapter supports
    data_kind = "image"  # pairs it with image datasets in the conformance tests

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        if cfg.depth < 1:
            raise ConfigError("model.depth", cfg.depth, "must be >= 1", "use e.g. model.depth=4")

    def build(self, spec: DataSpec) -> nn.Module:
        features = (spec.in_channels or 1) * (spec.image_size or 8) ** 2
        return ResMLP(features, int(self.cfg.width), int(self.cfg.depth), spec.num_classes or 10)

    def partition(self, model: nn.Module, granularity: str, spec: DataSpec) -> Partition:
        width = int(self.cfg.width)
        cost = 2 * (2 * width * width) * 2 + 5 * width  # FLOPs of one block per sample (two matmuls, norm)
        units = []
        for i, (key, block) in enumerate(model.blocks.items()):
            slices = tuple(TensorSlice(f"blocks.{key}.{n}") for n, _ in block.named_parameters())
            units.append(Unit(id=i, name=f"blocks.{key}", group="blocks", cost=float(cost), slices=slices))
        in_units = {s.name for u in units for s in u.slices}
        shapes, dtypes = Partition.tensor_info(model)
        shared = [n for n, _ in model.named_parameters() if n not in in_units]
        return Partition("block", units, shared, [n for n, _ in model.named_buffers()], shapes, dtypes)

    def materialize(self, model: nn.Module, owned: Sequence[int], partition: Partition) -> tuple[nn.Module, ParamMap]:
        keep = {partition.units[u].name for u in owned}
        for key in list(model.blocks.keys()):
            if f"blocks.{key}" not in keep:
                del model.blocks[key]  # never used again: its tensors are freed
        unit_of = {s.name: u.id for u in partition.units for s in u.slices}
        names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
        return model, ParamMap.identity(names, unit_of)

    def blocks(self, submodel: nn.Module) -> list[nn.Module]:
        return list(submodel.blocks.values())

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(output, batch[1])

    @torch.no_grad()
    def metrics(self, outputs: Sequence[torch.Tensor], batches: Sequence[Any]) -> dict[str, float]:
        logits = torch.cat(list(outputs))
        labels = torch.cat([b[1] for b in batches])
        return {"accuracy": float((logits.argmax(1) == labels).float().mean()),
                "loss": float(F.cross_entropy(logits, labels))}


@hookimpl
def subnetdp_register_models(registry: Any) -> None:
    registry.add("resmlp", ResMLPAdapter)  # model.name=resmlp selects it

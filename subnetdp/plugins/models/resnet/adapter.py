"""Model ``resnet``: torchvision ResNet-18/34/50, with block-level and neuron-level units.

Block level: units are the residual branches of the blocks. A block's shortcut (identity, or the 1x1 projection with its BatchNorm) is shared, so every block is
maskable: a dropped block computes ``relu(shortcut(x))``, which is what the block computes when its
residual branch is zero. Blocks with an identity shortcut vanish entirely (their input is already
the output of a ReLU). Blocks are grouped per stage, so every subnetwork keeps the same number of
blocks in every stage and ranks cost the same.

Neuron level: units are ranges of a block's inner channels, cut into ``masker.units_per_layer``
equal ranges (BasicBlock: ``conv1`` out = ``bn1`` = ``conv2`` in; Bottleneck: ``conv2`` out = ``bn2``
= ``conv3`` in, ``conv1`` stays whole). One group per block, so every subnetwork has the same width
in a block. A materialised block is physically narrower; with ``rescale`` its hidden activation is
scaled by ``K/n`` in training (inverted-dropout style), so the union model is consistent at eval.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from subnetdp import DataSpec, HiddenSite, ModelConfig, hookimpl
from subnetdp.plugins.models._blocks import ImageClassifierAdapter, check_variant
from subnetdp.plugins.models.resnet.model import VARIANTS, build_reference
from subnetdp.plugins.models.resnet.neurons import STAGES, hidden_layers, materialize_neurons, neuron_partition


@dataclass
class ResNetConfig(ModelConfig):
    variant: str = "resnet18"
    cifar_stem: bool = True
    zero_init_residual: bool = False


class DroppedBlock(nn.Module):
    """What a dropped block with a projection shortcut computes: ``relu(downsample(x))``."""

    def __init__(self, downsample: nn.Module) -> None:
        super().__init__()
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.downsample(x))


class ResNetAdapter(ImageClassifierAdapter):
    """torchvision ResNets with block-level units (residual branches)."""

    Config = ResNetConfig
    shortcut = "downsample"  # shared: a dropped block still computes relu(downsample(x))
    default_image_size = 32
    neuron_partition = staticmethod(neuron_partition)
    materialize_neurons = staticmethod(materialize_neurons)

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        check_variant(cfg.variant, VARIANTS)

    def init_module(self, name: str, module: nn.Module) -> None:
        """torchvision's ResNet initialisation, module by module: convolutions Kaiming-normal (fan out),
        BatchNorm weight 1 and bias 0 (0 for a residual branch's last BatchNorm with
        ``zero_init_residual``), the classifier PyTorch's default."""
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
            module.reset_parameters()  # weight 1, bias 0, fresh running statistics
            last = "bn3" if self.cfg.variant == "resnet50" else "bn2"
            if self.cfg.zero_init_residual and name.startswith("layer") and name.endswith(f".{last}"):
                nn.init.zeros_(module.weight)
        else:
            super().init_module(name, module)

    def build(self, spec: DataSpec) -> nn.Module:
        return build_reference(self.cfg.variant, spec.num_classes, spec.in_channels or 3,
                               self.cfg.cifar_stem, self.cfg.zero_init_residual)

    @staticmethod
    def _held_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(global name, block)`` of the residual blocks ``model`` holds (not dropped ones)."""
        return [(f"{stage}.{key}", block) for stage in STAGES for key, block in getattr(model, stage).named_children()
                if not isinstance(block, DroppedBlock)]

    def residual_branches(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """A block's residual branch ends in its last BatchNorm (``bn2``; ``bn3`` for Bottleneck)."""
        return {name: [block.bn3 if hasattr(block, "bn3") else block.bn2] for name, block in self._held_blocks(model)}

    def branch_output_layers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        return self.residual_branches(model)  # the BatchNorm's affine weight and bias

    def hidden_sites(self, model: nn.Module) -> list[HiddenSite]:
        """The inner channels are the input of ``conv2`` (BasicBlock) or ``conv3`` (Bottleneck)."""
        return [HiddenSite(getattr(block, hidden_layers(block)[2]), 1, "input") for _, block in self._held_blocks(model)]

    def reference_options(self, spec: DataSpec) -> dict[str, Any]:
        return {"variant": self.cfg.variant, "num_classes": spec.num_classes,
                "in_channels": spec.in_channels or 3, "cifar_stem": self.cfg.cifar_stem,
                "zero_init_residual": self.cfg.zero_init_residual}

    @staticmethod
    def reference_model(options: dict[str, Any]) -> nn.Module:
        """The plain torchvision model for :meth:`reference_options` (used by ``subnetdp export``)."""
        return build_reference(**options)

    def named_blocks(self, model: nn.Module) -> list[tuple[str, str, nn.Module]]:
        """``(name, stage, block)`` of every residual block, in forward order (``layer1.0``, ...)."""
        return [(f"{stage}.{bi}", stage, block) for stage in STAGES for bi, block in enumerate(getattr(model, stage))]

    def drop_blocks(self, model: nn.Module, keep: set[str]) -> None:
        # By the blocks' keys, their original indices: a subnetwork this made loses more blocks the same way.
        for stage in STAGES:
            kept: OrderedDict[str, nn.Module] = OrderedDict()
            for key, block in getattr(model, stage).named_children():
                if f"{stage}.{key}" in keep or isinstance(block, DroppedBlock):
                    kept[key] = block
                elif block.downsample is not None:
                    kept[key] = DroppedBlock(block.downsample)
            setattr(model, stage, nn.Sequential(kept))

    def blocks(self, submodel: nn.Module) -> list[nn.Module]:
        return [b for stage in STAGES for b in getattr(submodel, stage)
                if not isinstance(b, DroppedBlock)]


@hookimpl
def subnetdp_register_models(registry) -> None:
    registry.add("resnet", ResNetAdapter)

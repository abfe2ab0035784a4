"""ResNet's own block-level properties: projection shortcuts of dropped blocks, the partition of a variant."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torchvision.models.resnet import BasicBlock, Bottleneck

from subnetdp.core.contracts import DataSpec
from subnetdp.plugins.models.resnet.adapter import DroppedBlock, ResNetAdapter, ResNetConfig


def _adapter(variant: str) -> ResNetAdapter:
    cfg = OmegaConf.structured(ResNetConfig)
    cfg.variant = variant
    return ResNetAdapter(cfg)


@pytest.mark.parametrize("variant,owned", [("resnet18", [0, 3, 5, 6]), ("resnet50", [1, 2, 7, 10, 15])])
def test_dropped_blocks_keep_only_their_projection_shortcut(variant, owned):
    # That the subnetwork computes what the full model computes without the dropped branches, and holds
    # exactly its tensors, is checked for every adapter in test_adapter_contract.py.
    adapter = _adapter(variant)
    spec = DataSpec(in_channels=3, image_size=16, num_classes=7)
    torch.manual_seed(0)
    full = adapter.build(spec)
    sub, _ = adapter.materialize(full, owned, adapter.partition(full, "block", spec))
    kinds = [type(b) for stage in ("layer1", "layer2", "layer3", "layer4") for b in getattr(sub, stage)]
    assert sum(k in (BasicBlock, Bottleneck) for k in kinds) == len(owned)
    assert all(k in (BasicBlock, Bottleneck, DroppedBlock) for k in kinds)


def test_partition_covers_every_tensor_once():
    adapter = _adapter("resnet34")
    spec = DataSpec(in_channels=1, image_size=8, num_classes=10)
    model = adapter.build(spec)
    partition = adapter.partition(model, "block", spec)
    assert [u.group for u in partition.units].count("layer3") == 6  # resnet34: 3, 4, 6, 3 blocks
    names = [s.name for u in partition.units for s in u.slices] + partition.shared
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert len(names) == len(set(names))
    assert all("downsample" not in s.name for u in partition.units for s in u.slices)
    assert "fc.weight" in partition.shared and "conv1.weight" in partition.shared
    # Costs are measured FLOPs: later stages' blocks cost as much as earlier ones (channels x4, pixels /4).
    assert all(u.cost > 0 for u in partition.units)
    assert model.conv1.in_channels == 1 and model.conv1.kernel_size == (3, 3)

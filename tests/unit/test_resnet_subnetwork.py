"""A materialised ResNet subnetwork computes what the full model computes without the dropped branches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchvision.models.resnet import BasicBlock, Bottleneck

from subnetdp.core.contracts import DataSpec
from subnetdp.plugins.models.resnet.adapter import DroppedBlock, ResNetAdapter, ResNetConfig


def _adapter(variant: str) -> ResNetAdapter:
    cfg = OmegaConf.structured(ResNetConfig)
    cfg.variant = variant
    return ResNetAdapter(cfg)


def _drop_branches(model: torch.nn.Module, dropped: set[str]) -> None:
    """Reference: the full model in which the dropped blocks' residual branches are zero."""
    for name, module in model.named_modules():
        if name in dropped:
            def forward(x, m=module):
                return F.relu(m.downsample(x) if m.downsample is not None else x)
            module.forward = forward


@pytest.mark.parametrize("variant,owned", [("resnet18", [0, 3, 5, 6]), ("resnet50", [1, 2, 7, 10, 15])])
def test_subnetwork_matches_full_model_without_dropped_branches(variant, owned):
    adapter = _adapter(variant)
    spec = DataSpec(in_channels=3, image_size=16, num_classes=7)
    torch.manual_seed(0)
    full = adapter.build(spec)
    partition = adapter.partition(full, "block", spec)
    reference = copy.deepcopy(full)
    dropped = {u.name for u in partition.units if u.id not in owned}
    _drop_branches(reference, dropped)

    sub, pmap = adapter.materialize(full, owned, partition)
    x = torch.randn(4, 3, 16, 16)
    reference.eval(), sub.eval()
    with torch.no_grad():
        assert torch.equal(sub(x), reference(x))  # bit for bit
    reference.train(), sub.train()
    assert torch.equal(sub(x), reference(x))

    # It holds exactly the shared tensors plus the owned units' tensors.
    held = {n for n, _ in sub.named_parameters()}
    expected = set(partition.shared) | {s.name for u in owned for s in partition.units[u].slices}
    assert held == expected
    assert sum(p.numel() for p in sub.parameters()) == partition.shared_numel() + sum(
        partition.unit_numel(partition.units[u]) for u in owned)
    # Every local tensor maps to the full model's tensor of the same name and unit.
    for name in held:
        assert pmap.pieces[name][0].global_name == name
        assert (pmap.unit_of[name] in owned) or name in partition.shared
    # Dropped blocks with a projection shortcut keep only the shortcut.
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

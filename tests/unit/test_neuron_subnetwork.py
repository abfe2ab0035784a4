"""A materialised neuron-level ResNet computes what the full model computes with dropped channels zeroed."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from torchvision.models.resnet import Bottleneck

from subnetdp.core.contracts import DataSpec
from subnetdp.plugins.models.resnet.neurons import hidden_layers
from subnetdp.plugins.models.resnet.adapter import ResNetAdapter, ResNetConfig
from tests.helpers import assert_pieces_at_global_coordinates


def _adapter(variant: str) -> ResNetAdapter:
    cfg = OmegaConf.structured(ResNetConfig)
    cfg.variant = variant
    return ResNetAdapter(cfg)


def _zero_dropped(model: torch.nn.Module, partition, owned: set[int], rescale: bool) -> None:
    """Reference: the full model whose dropped hidden channels are zeroed (kept ones scaled by K/n)."""
    for group, units in partition.groups().items():
        block = model.get_submodule(group)
        width = getattr(block, hidden_layers(block)[0]).out_channels
        mask = torch.zeros(width)
        kept = [u for u in units if u.id in owned]
        for u in kept:
            mask[u.slices[0].start:u.slices[0].stop] = 1.0
        scale = len(units) / len(kept) if rescale else 1.0

        def hook(module, args, mask=mask, scale=scale):
            return (args[0] * mask.view(1, -1, 1, 1) * (scale if module.training else 1.0),)
        getattr(block, hidden_layers(block)[2]).register_forward_pre_hook(hook)


@pytest.mark.parametrize("variant,units_per_layer,owned", [
    ("resnet18", 4, [0, 2, 3, 5, 9, 10, 13, 17, 20, 21, 26, 30]),
    ("resnet50", 8, list(range(0, 128, 3))),
])
def test_narrowed_blocks_match_zeroed_channels(variant, units_per_layer, owned):
    adapter = _adapter(variant)
    spec = DataSpec(in_channels=3, image_size=16, num_classes=7)
    torch.manual_seed(0)
    full = adapter.build(spec)
    partition = adapter.partition(full, "neuron", spec, units_per_layer=units_per_layer)
    assert len(partition.units) == units_per_layer * len(partition.groups())
    owned_set = set(owned)
    # Every group keeps at least one unit in these plans.
    assert all(any(u.id in owned_set for u in us) for us in partition.groups().values())
    reference = copy.deepcopy(full)
    _zero_dropped(reference, partition, owned_set, rescale=True)
    sub, pmap = adapter.materialize(full, owned, partition, rescale=True)

    x = torch.randn(4, 3, 16, 16)
    y = torch.randint(0, 7, (4,))
    for train in (True, False):
        sub.train(train), reference.train(train)
        out_sub, out_ref = sub(x), reference(x)
        torch.testing.assert_close(out_sub, out_ref, rtol=1e-5, atol=1e-5)
        if train:
            torch.nn.functional.cross_entropy(out_sub, y).backward()
            torch.nn.functional.cross_entropy(out_ref, y).backward()
    # Gradients agree at global coordinates: the ParamMap puts each owned piece where it belongs.
    checked = assert_pieces_at_global_coordinates(sub, pmap, reference, partition, owned, rtol=1e-3, atol=2e-4)
    assert checked == len(partition.shared) + 4 * len(owned)

    # The expected parameter count: shared tensors plus the owned units' pieces.
    expected = partition.shared_numel() + sum(partition.unit_numel(partition.units[u]) for u in owned)
    assert sum(p.numel() for p in sub.parameters()) == expected
    block = sub.layer1[0]
    prod = getattr(block, hidden_layers(block)[0])
    kept_in_block = sum(1 for u in partition.groups()["layer1.0"] if u.id in owned_set)
    assert prod.out_channels == kept_in_block * (prod.weight.shape[0] // kept_in_block)
    assert block.hidden_scale == pytest.approx(units_per_layer / kept_in_block)
    if variant == "resnet50":
        assert isinstance(block, Bottleneck) and block.conv1.weight.shape[0] == 64  # conv1 stays whole


def test_neuron_partition_cuts_only_the_hidden_dimension():
    adapter = _adapter("resnet18")
    spec = DataSpec(in_channels=1, image_size=8, num_classes=10)
    model = adapter.build(spec)
    partition = adapter.partition(model, "neuron", spec)  # units_per_layer defaults to 8
    assert len(partition.units) == 8 * 8 and len(partition.groups()) == 8
    # Every parameter element belongs to exactly one unit or is shared.
    total = partition.shared_numel() + sum(partition.unit_numel(u) for u in partition.units)
    assert total == sum(p.numel() for p in model.parameters())
    for u in partition.units:
        dims = {s.name: s.dim for s in u.slices}
        assert dims[f"{u.group}.conv1.weight"] == 0 and dims[f"{u.group}.conv2.weight"] == 1
        assert f"{u.group}.bn2.weight" not in dims  # the residual stream is never cut
        assert u.cost > 0
    with pytest.raises(Exception, match="masker.units_per_layer"):
        adapter.partition(model, "neuron", spec, units_per_layer=65)

"""A materialised neuron-level Swin computes what the full model computes with dropped MLP neurons zeroed."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from subnetdp.core.contracts import DataSpec
from subnetdp.core.errors import ConfigError
from subnetdp.plugins.models.swin.adapter import SwinAdapter, SwinConfig
from tests.helpers import assert_pieces_at_global_coordinates

SMALL = {"variant": "cifar", "patch_size": 2, "window_size": 2, "embed_dim": 16, "depths": [2, 2],
         "num_heads": [2, 4], "stochastic_depth_prob": 0.0}


def _adapter() -> SwinAdapter:
    cfg = OmegaConf.structured(SwinConfig)
    for k, v in SMALL.items():
        cfg[k] = v
    return SwinAdapter(cfg)


def _zero_dropped(model: torch.nn.Module, partition, owned: set[int], rescale: bool) -> None:
    """Reference: the full model whose dropped MLP hidden neurons are zeroed (kept ones scaled by K/n)."""
    for group, units in partition.groups().items():
        mlp = model.get_submodule(group)
        mask = torch.zeros(mlp[0].out_features)
        kept = [u for u in units if u.id in owned]
        for u in kept:
            mask[u.slices[0].start:u.slices[0].stop] = 1.0
        scale = len(units) / len(kept) if rescale else 1.0

        def hook(module, args, mask=mask, scale=scale):
            return (args[0] * mask * (scale if module.training else 1.0),)
        mlp[3].register_forward_pre_hook(hook)


def test_narrowed_mlps_match_zeroed_neurons():
    adapter = _adapter()
    spec = DataSpec(in_channels=1, image_size=8, num_classes=7)
    torch.manual_seed(0)
    full = adapter.build(spec)
    partition = adapter.partition(full, "neuron", spec, units_per_layer=4)
    groups = partition.groups()
    assert list(groups) == ["features.1.0.mlp", "features.1.1.mlp", "features.3.0.mlp", "features.3.1.mlp"]
    assert len(partition.units) == 16 and all(u.cost > 0 for u in partition.units)
    total = partition.shared_numel() + sum(partition.unit_numel(u) for u in partition.units)
    assert total == sum(p.numel() for p in full.parameters())
    for u in partition.units:
        assert {(s.name.rsplit(".", 2)[-2:][0], s.dim) for s in u.slices} == {("0", 0), ("3", 1)}
    assert "features.1.0.mlp.3.bias" in partition.shared and "features.1.0.attn.qkv.weight" in partition.shared

    owned = [0, 2, 3, 5, 9, 10, 11, 12]  # 3, 1, 3 and 1 of 4 ranges per block
    owned_set = set(owned)
    reference = copy.deepcopy(full)
    _zero_dropped(reference, partition, owned_set, rescale=True)
    sub, pmap = adapter.materialize(full, owned, partition, rescale=True)
    mlp = sub.get_submodule("features.1.0.mlp")
    assert mlp[0].weight.shape == (48, 16) and mlp[0].bias.shape == (48,) and mlp[3].weight.shape == (16, 48)
    assert sub.get_submodule("features.1.0").hidden_scale == pytest.approx(4 / 3)
    assert sub.get_submodule("features.1.1").hidden_scale == pytest.approx(4.0)
    # The expected parameter count: shared tensors plus the owned units' pieces.
    expected = partition.shared_numel() + sum(partition.unit_numel(partition.units[u]) for u in owned)
    assert sum(p.numel() for p in sub.parameters()) == expected < sum(p.numel() for p in reference.parameters())

    x = torch.randn(4, 1, 8, 8)
    y = torch.randint(0, 7, (4,))
    for train in (False, True):  # eval: no scaling; train: K/n on the hidden activation (dropout is 0)
        sub.train(train), reference.train(train)
        out_sub, out_ref = sub(x), reference(x)
        torch.testing.assert_close(out_sub, out_ref, rtol=1e-5, atol=1e-6)
        if train:
            torch.nn.functional.cross_entropy(out_sub, y).backward()
            torch.nn.functional.cross_entropy(out_ref, y).backward()
    # Gradients agree at global coordinates: the ParamMap puts each owned piece where it belongs.
    checked = assert_pieces_at_global_coordinates(sub, pmap, reference, partition, owned, rtol=1e-4, atol=1e-6, values=True)
    assert checked == len(partition.shared) + 3 * len(owned)


def test_rescale_off_and_bad_units_per_layer():
    adapter = _adapter()
    spec = DataSpec(in_channels=1, image_size=8, num_classes=7)
    torch.manual_seed(0)
    full = adapter.build(spec)
    with pytest.raises(ConfigError, match=r"masker.units_per_layer.*only 64 MLP hidden"):
        adapter.partition(full, "neuron", spec, units_per_layer=65)
    partition = adapter.partition(full, "neuron", spec, units_per_layer=2)
    owned = [1, 2, 5, 7]
    reference = copy.deepcopy(full)
    _zero_dropped(reference, partition, set(owned), rescale=False)
    sub, _ = adapter.materialize(full, owned, partition, rescale=False)
    sub.train(), reference.train()
    x = torch.randn(3, 1, 8, 8)
    torch.testing.assert_close(sub(x), reference(x), rtol=1e-5, atol=1e-6)

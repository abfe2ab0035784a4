"""Swin's own block-level properties: its units, kept blocks' shifts and stochastic depth, the partition of swin_t."""

from __future__ import annotations

import pytest
import torch
import torchvision
from omegaconf import OmegaConf
from torchvision.models.swin_transformer import SwinTransformerBlock

from subnetdp.train.configure import load_config
from subnetdp.core.contracts import DataSpec
from subnetdp.core.errors import ConfigError
from subnetdp.plugins.models.swin.adapter import VARIANTS, SwinAdapter, SwinConfig, build_reference
from tests.helpers import plugin_manager

SMALL = {"variant": "cifar", "patch_size": 2, "window_size": 2, "embed_dim": 16, "depths": [2, 4, 2],
         "num_heads": [2, 4, 8], "stochastic_depth_prob": 0.3}


def _adapter(**values) -> SwinAdapter:
    cfg = OmegaConf.structured(SwinConfig)
    for k, v in values.items():
        cfg[k] = v
    return SwinAdapter(cfg)


def test_kept_blocks_are_the_original_modules_with_their_shifts_and_stochastic_depth():
    adapter = _adapter(**SMALL)
    spec = DataSpec(in_channels=1, image_size=16, num_classes=7)
    torch.manual_seed(0)
    full = adapter.build(spec)
    partition = adapter.partition(full, "block", spec)
    assert [u.name for u in partition.units] == ["features.1.0", "features.1.1", "features.3.0", "features.3.1",
                                                 "features.3.2", "features.3.3", "features.5.0", "features.5.1"]
    owned = [1, 2, 5, 6]  # unshifted and shifted blocks, 1 of 2, 2 of 4 and 1 of 2 per stage
    shifts = {u.name: full.get_submodule(u.name).attn.shift_size for u in partition.units}
    sd = {u.name: full.get_submodule(u.name).stochastic_depth.p for u in partition.units}

    # Equality with the full model without the dropped blocks, and the tensors held: test_adapter_contract.py.
    sub, _ = adapter.materialize(full, owned, partition)

    # The kept blocks are the original modules: their own shift and stochastic-depth probability.
    kept = {f"features.{si}.{name}": b for si in (1, 3, 5) for name, b in sub.features[si].named_children()}
    assert set(kept) == {partition.units[u].name for u in owned}
    assert all(isinstance(b, SwinTransformerBlock) for b in kept.values())
    assert {n: b.attn.shift_size for n, b in kept.items()} == {n: shifts[n] for n in kept}
    assert kept["features.1.1"].attn.shift_size == [1, 1] and kept["features.3.0"].attn.shift_size == [0, 0]
    assert {n: b.stochastic_depth.p for n, b in kept.items()} == {n: sd[n] for n in kept}
    assert sd["features.5.1"] == pytest.approx(0.3) and sd["features.1.0"] == 0.0
    assert adapter.blocks(sub) == list(kept.values())


def test_partition_covers_every_tensor_once_and_costs_are_measured():
    adapter = _adapter(variant="t")
    spec = DataSpec(in_channels=3, image_size=224, num_classes=10)
    torch.manual_seed(0)
    model = adapter.build(spec)
    partition = adapter.partition(model, "block", spec)
    assert [u.group for u in partition.units].count("features.5") == 6  # swin_t: 2, 2, 6, 2 blocks
    names = [s.name for u in partition.units for s in u.slices] + partition.shared
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert len(names) == len(set(names))
    buffers = [s.name for u in partition.units for s in u.buffers] + partition.shared_buffers
    assert sorted(buffers) == sorted(n for n, _ in model.named_buffers())
    for shared in ("features.0.0.weight", "features.2.reduction.weight", "norm.weight", "head.weight"):
        assert shared in partition.shared
    assert all(s.name.startswith(("features.1.", "features.3.", "features.5.", "features.7."))
               for u in partition.units for s in u.slices)
    # FLOPs per sample: a block of every stage costs about the same (tokens /4, width x2).
    costs = [u.cost for u in partition.units]
    assert all(c > 0 for c in costs) and max(costs) < 2 * min(costs)
    # Variant t is torchvision's swin_t, parameter for parameter.
    reference = torchvision.models.swin_t(num_classes=10)
    assert {n: p.shape for n, p in model.named_parameters()} == {n: p.shape for n, p in reference.named_parameters()}


def test_input_channels_from_spec_and_config_errors():
    model = build_reference(5, in_channels=1, **VARIANTS["cifar"])
    assert model.features[0][0].in_channels == 1 and model.features[0][0].kernel_size == (2, 2)
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 5)
    registries = plugin_manager().registries
    with pytest.raises(ConfigError, match=r"model.variant='tiny'.*valid choices: t, s, b, cifar"):
        load_config(None, ["model.name=swin", "model.variant=tiny"], registries)
    with pytest.raises(ConfigError, match=r"model.num_heads.*one entry per stage"):
        load_config(None, ["model.name=swin", "model.depths=[2,2]"], registries)
    with pytest.raises(ConfigError, match=r"model.num_heads.*not divisible"):
        load_config(None, ["model.name=swin", "model.variant=cifar", "model.num_heads=[5,6,12,24]"], registries)
    assert load_config(None, ["model.name=swin", "masker.granularity=neuron"], registries).masker.granularity == "neuron"

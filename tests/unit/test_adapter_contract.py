"""Every registered model adapter keeps the block-level contract, checked once over the registry.

A materialised subnetwork computes, bit for bit, what the full model computes with the dropped units'
residual branches zero (evaluation and training mode, values and gradients), holds exactly the shared
tensors plus its units' tensors under their global names, and the partition covers every parameter
once at a measured cost. As timm's test_models.py runs over ``list_models()``, a new adapter is tested
by registering it and adding its tiny variant to ``TINY``; one without fails
``test_every_registered_adapter_has_a_tiny_variant``. What is particular to one model (Swin's shifts,
LLaMA's causality, ResNet's projection shortcuts) stays in that model's own file.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from subnetdp.core.contracts import DataSpec
from subnetdp.plugins.models.llama.adapter import LlamaAdapter, LlamaConfig
from subnetdp.plugins.models.resnet.adapter import ResNetAdapter, ResNetConfig
from subnetdp.plugins.models.swin.adapter import SwinAdapter, SwinConfig
from tests.helpers import plugin_manager


def adapter_of(kind: type, config: type, **values):
    cfg = OmegaConf.structured(config)
    for k, v in values.items():
        cfg[k] = v
    return kind(cfg)


def drop_resnet_branches(model: torch.nn.Module, dropped: set[str]) -> None:
    """Reference: the full ResNet in which the dropped blocks' residual branches are zero."""
    for name, module in model.named_modules():
        if name in dropped:
            def forward(x, m=module):
                return F.relu(m.downsample(x) if m.downsample is not None else x)
            module.forward = forward


def drop_blocks(model: torch.nn.Module, dropped: set[str]) -> None:
    """Reference: the full model in which the dropped blocks are the identity (both branches zero)."""
    for name, module in model.named_modules():
        if name in dropped:
            module.forward = lambda x, *rest: x


@dataclass(frozen=True)
class Tiny:
    """A model small enough for a unit test, the units to keep, and how to drop the others."""

    adapter: Callable[[], object]
    spec: DataSpec
    inputs: Callable[[], torch.Tensor]
    drop: Callable[[torch.nn.Module, set[str]], None]
    owned: tuple[int, ...]


SWIN_SMALL = {"variant": "cifar", "patch_size": 2, "window_size": 2, "embed_dim": 16, "depths": [2, 4, 2],
              "num_heads": [2, 4, 8], "stochastic_depth_prob": 0.3}
LLAMA_SPEC = DataSpec(vocab_size=257, seq_len=32)
_g = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731

# Each adapter's tiny variants: the key's prefix before "-" is the registered adapter name.
TINY: dict[str, Tiny] = {
    "resnet-18": Tiny(lambda: adapter_of(ResNetAdapter, ResNetConfig, variant="resnet18"),
                      DataSpec(in_channels=3, image_size=16, num_classes=7),
                      lambda: torch.randn(4, 3, 16, 16, generator=_g(2)), drop_resnet_branches, (0, 3, 5, 6)),
    "resnet-50": Tiny(lambda: adapter_of(ResNetAdapter, ResNetConfig, variant="resnet50"),
                      DataSpec(in_channels=3, image_size=16, num_classes=7),
                      lambda: torch.randn(4, 3, 16, 16, generator=_g(2)), drop_resnet_branches, (1, 2, 7, 10, 15)),
    # Unshifted and shifted blocks, 1 of 2, 2 of 4 and 1 of 2 per stage; stochastic depth on.
    "swin-small": Tiny(lambda: adapter_of(SwinAdapter, SwinConfig, **SWIN_SMALL),
                       DataSpec(in_channels=1, image_size=16, num_classes=7),
                       lambda: torch.randn(4, 1, 16, 16, generator=_g(2)), drop_blocks, (1, 2, 5, 6)),
    **{f"llama-{'-'.join(map(str, owned))}": Tiny(lambda: adapter_of(LlamaAdapter, LlamaConfig, variant="tiny"),
                                                  LLAMA_SPEC, lambda: torch.randint(0, 257, (2, 32), generator=_g(3)),
                                                  drop_blocks, owned)
       for owned in ((0, 2), (3,), (0, 1, 2, 3))},
}


def test_every_registered_adapter_has_a_tiny_variant():
    registered = set(plugin_manager().registries["model"].names())
    covered = {key.split("-", 1)[0] for key in TINY}
    assert registered - covered == set(), (f"model adapters {sorted(registered - covered)} have no tiny variant in "
                                           "tests/unit/test_adapter_contract.py's TINY: add one so that they are tested")


@pytest.mark.parametrize("key", sorted(TINY))
def test_subnetwork_equals_the_full_model_without_the_dropped_units(key: str):
    tiny = TINY[key]
    adapter = tiny.adapter()
    torch.manual_seed(0)
    full = adapter.build(tiny.spec)
    partition = adapter.partition(full, "block", tiny.spec)
    owned = list(tiny.owned)
    reference = copy.deepcopy(full)
    tiny.drop(reference, {u.name for u in partition.units if u.id not in owned})
    sub, pmap = adapter.materialize(full, owned, partition)

    x = tiny.inputs()
    reference.eval(), sub.eval()
    with torch.no_grad():
        assert torch.equal(sub(x), reference(x))  # bit for bit
    # Training mode: batch statistics and stochastic depth draw the same in the same order.
    reference.train(), sub.train()
    torch.manual_seed(1)
    out_sub = sub(x)
    torch.manual_seed(1)
    out_ref = reference(x)
    assert torch.equal(out_sub, out_ref)
    out_sub.float().square().mean().backward()
    out_ref.float().square().mean().backward()
    ref_params = dict(reference.named_parameters())
    for name, p in sub.named_parameters():
        assert torch.equal(p.grad, ref_params[name].grad), name  # same names, same gradients

    # Exactly the shared tensors plus the owned units' tensors; local names are global names.
    held = {n for n, _ in sub.named_parameters()}
    assert held == set(partition.shared) | {s.name for u in owned for s in partition.units[u].slices}
    assert sum(p.numel() for p in sub.parameters()) == partition.shared_numel() + sum(
        partition.unit_numel(partition.units[u]) for u in owned)
    for name in held:
        assert pmap.pieces[name][0].global_name == name
        assert pmap.unit_of[name] in owned or name in partition.shared
    assert len(adapter.blocks(sub)) == len(owned)


@pytest.mark.parametrize("key", sorted({key.split("-", 1)[0]: key for key in TINY}.values()))
def test_partition_covers_every_parameter_once_at_a_measured_cost(key: str):
    tiny = TINY[key]
    adapter = tiny.adapter()
    torch.manual_seed(0)
    model = adapter.build(tiny.spec)
    partition = adapter.partition(model, "block", tiny.spec)
    names = [s.name for u in partition.units for s in u.slices] + partition.shared
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert len(names) == len(set(names))
    assert partition.units and all(u.cost > 0 for u in partition.units)

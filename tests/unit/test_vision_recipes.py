"""The vision recipes compose, and their plans are valid for the world size they launch with."""

from __future__ import annotations

import pytest

from subnetdp.train.configure import load_config
from subnetdp.train.setup import build_plan
from subnetdp.plugins.data.cifar import Cifar100Data, CifarData
from subnetdp.plugins.data.imagenet import ImageNetData
from tests.helpers import plugin_manager

# recipe -> blocks every rank keeps per stage
RECIPES = {
    "resnet18_cifar10": [1, 1, 1, 1], "resnet18_cifar100": [1, 1, 1, 1],
    "swin_t_cifar10": [1, 1, 3, 1], "swin_t_cifar100": [1, 1, 3, 1],
    "resnet50_imagenet": [2, 2, 3, 2], "swin_t_imagenet": [1, 1, 3, 1],
}
PLANNED = ("resnet18_cifar10", "swin_t_cifar100", "resnet50_imagenet", "swin_t_imagenet")  # each model x data kind
DATA = {"cifar10": CifarData, "cifar100": Cifar100Data, "imagenet": ImageNetData}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_plans_for_its_world_size(recipe, tmp_path):
    pm = plugin_manager()
    cfg = load_config(recipe, [], pm.registries)
    assert cfg.comm.name == "gloo" and cfg.masker.coverage == 0.5 and cfg.train.steps > 10_000
    assert cfg.data.num_workers >= 4 and cfg.eval.every > 0
    if recipe not in PLANNED:
        return
    # Plan it on tiny stand-in data in the real format (small images keep the FLOP count quick).
    overrides = DATA[cfg.data.name].conformance_overrides(tmp_path) + ["data.image_size=32"]
    cfg = load_config(recipe, overrides, pm.registries)
    world = int(cfg.launch.nproc)
    _, spec, _, _, partition, plan = build_plan(cfg, world, pm)
    assert plan.world_size == world and min(plan.owner_counts()) >= 1
    assert spec.image_size == 32 and spec.in_channels == 3
    groups = list(partition.groups())
    for owned in plan.owned:
        kept = [sum(partition.units[u].group == g for u in owned) for g in groups]
        assert kept == RECIPES[recipe]

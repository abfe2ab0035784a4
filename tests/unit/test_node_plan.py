"""Nodes as failure domains: a unit's owners placed on different nodes, node losses reported."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from subnetdp.core.contracts import DataSpec, MaskerConfig
from subnetdp.core.errors import ConfigError
from subnetdp.core.plan import make_plan, node_order
from subnetdp.launchers.nodes import plan_nodes
from subnetdp.plugins.maskers.balanced import BalancedMasker
from subnetdp.plugins.maskers.cyclic import CyclicMasker
from subnetdp.plugins.maskers.random import RandomMasker
from subnetdp.plugins.models.resnet.adapter import ResNetAdapter, ResNetConfig
from tests.helpers import small_config

SPEC = DataSpec(in_channels=1, image_size=8, num_classes=10)
MASKERS = [CyclicMasker, BalancedMasker, RandomMasker]


@pytest.fixture(scope="module")
def partition():
    adapter = ResNetAdapter(OmegaConf.structured(ResNetConfig))
    torch.manual_seed(0)
    return adapter.partition(adapter.build(SPEC), "block", SPEC)


def masker(cls, **kw):
    cfg = OmegaConf.structured(MaskerConfig)
    for k, v in kw.items():
        cfg[k] = v
    return cls(cfg)


def test_node_order_interleaves_the_nodes():
    assert node_order(4, 2) == [0, 2, 1, 3]
    assert node_order(8, 4) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert node_order(6, 1) == list(range(6))


@pytest.mark.parametrize("cls", MASKERS)
@pytest.mark.parametrize("world,nodes", [(4, 2), (8, 4)])
def test_every_masker_survives_one_node_and_keeps_its_unit_sets(partition, cls, world, nodes):
    m = masker(cls, coverage=0.5, min_owners=2)
    one, spread = make_plan(m, partition, world, 0, 2), make_plan(m, partition, world, 0, 2, nodes=nodes)
    if cls is not RandomMasker:  # random draws place neighbours nowhere in particular: reported, not promised
        assert spread.node_failures_survived(nodes) >= 1  # every unit has owners on two nodes
    assert sorted(map(tuple, spread.owned)) == sorted(map(tuple, one.owned))  # the same sets, other ranks
    assert spread.owner_counts() == one.owner_counts() and spread.digest() != one.digest()
    assert spread.to_dict()["node_failures_survived"] == spread.node_failures_survived(nodes)
    assert spread.to_dict()["nodes"] == nodes


def test_the_default_cyclic_plan_loses_a_node_without_the_interleave(partition):
    # What the launcher's layout did before: owners of every second block on one node.
    assert make_plan(masker(CyclicMasker, coverage=0.5), partition, 4, 0).node_failures_survived(2) == 0


@pytest.mark.parametrize("cls", MASKERS)
def test_one_node_is_the_maskers_own_plan(partition, cls):
    m = masker(cls, coverage=0.5)
    plan = make_plan(m, partition, 4, 0, nodes=1)
    assert plan.owned == m.plan(partition, 4, 0).owned
    assert "nodes" not in plan.to_dict() and "node_failures_survived" not in plan.to_dict()


def test_capacities_follow_their_ranks_across_nodes(partition):
    m = masker(CyclicMasker, capacity=[1.0, 0.5, 0.5, 1.0], min_owners=2)
    plan = make_plan(m, partition, 4, 0, 2, nodes=2)
    assert [len(u) for u in plan.owned] == [8, 4, 4, 8]  # rank r keeps capacity[r], wherever it plans


@pytest.mark.parametrize("nodes", [0, 3, 5])
def test_a_bad_node_count_is_one_line_naming_the_key(partition, nodes):
    with pytest.raises(ConfigError, match=rf"masker.nodes={nodes}: .*give a divisor of 4: 1, 2, 4"):
        make_plan(masker(CyclicMasker), partition, 4, 0, nodes=nodes)


def test_the_node_count_comes_from_the_key_or_from_torchrun():
    cfg = small_config()
    assert plan_nodes(cfg, 4, {}) == 1  # no launcher: one node
    assert plan_nodes(cfg, 4, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) == 2  # 2 agents x 2 workers
    assert plan_nodes(cfg, 4, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}) == 1
    cfg.masker.nodes = 4
    assert plan_nodes(cfg, 4, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) == 4  # the key wins
    cfg.masker.nodes = 3
    with pytest.raises(ConfigError, match="masker.nodes=3"):
        plan_nodes(cfg, 4, {})


def test_plan_nodes_reports_node_losses_beside_rank_losses(capsys):
    from subnetdp.cli import main

    args = ["plan", "resnet18_digits", "-n", "4", "--no-estimate", "masker.min_owners=2"]
    assert main(args + ["--nodes", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failures"]["nodes"] == 2 and report["failures"]["nodes_survived"] == 1
    assert report["failures"]["survived"] == 1 and report["node_failures_survived"] == 1
    assert main(args + ["--nodes", "2"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the report wraps long lines
    assert "survives any 1 of 4 ranks dying at once" in text and "survives any 1 of 2 nodes dying at once" in text
    assert main(args + ["--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    assert "nodes" not in single["failures"] and "nodes" not in single
    assert main(args + ["--nodes", "0"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nodes=0: does not split the 4 ranks" in err[0] and "give a divisor of 4" in err[0]

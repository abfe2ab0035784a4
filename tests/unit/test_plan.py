"""MaskPlan and the cyclic masker: ownership, validation, hashing, the mixing graph."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from subnetdp.core.contracts import DataSpec, MaskerConfig
from subnetdp.core.errors import PlanError
from subnetdp.core.plan import MaskPlan, make_plan, units_kept
from subnetdp.plugins.maskers.cyclic import CyclicMasker
from subnetdp.plugins.models.resnet.adapter import ResNetAdapter, ResNetConfig


@pytest.fixture(scope="module")
def partition():
    adapter = ResNetAdapter(OmegaConf.structured(ResNetConfig))
    spec = DataSpec(in_channels=1, image_size=8, num_classes=10)
    torch.manual_seed(0)
    model = adapter.build(spec)
    return adapter.partition(model, "block", spec)


def masker(**kw) -> CyclicMasker:
    cfg = OmegaConf.structured(MaskerConfig)
    for k, v in kw.items():
        cfg[k] = v
    return CyclicMasker(cfg)


def test_units_kept_rounds_half_up():
    assert units_kept(0.69, 16) == 11
    assert units_kept(0.5, 2) == 1
    assert units_kept(0.375, 8) == 3
    assert units_kept(0.01, 8) == 1  # never zero
    assert units_kept(1.0, 5) == 5


def test_cyclic_half_coverage_on_four_ranks(partition):
    plan = make_plan(masker(coverage=0.5), partition, 4, seed=0)
    assert len(partition.units) == 8 and plan.num_units == 8
    assert plan.owner_counts() == [2] * 8  # every residual block held by 2 of the 4
    # One block of every stage per rank: effective coverage 0.5 in each stage.
    assert all(c == [0.5] * 4 for c in plan.effective_coverage(partition).values())
    assert plan.owner_sets() == [(0, 1), (2, 3), (0, 1, 2, 3)]
    # Ranks {0,1} and {2,3} share no unit: two components; shared tensors still mix them.
    assert plan.unit_graph_components() == 2
    gap = plan.spectral_gap(partition)
    assert 0.0 < gap < 1.0
    M = plan.mixing_matrix(partition)
    np.testing.assert_allclose(M.sum(0), 1.0)
    np.testing.assert_allclose(M, M.T)


def test_full_coverage_is_everyone_owning_everything(partition):
    plan = make_plan(masker(coverage=1.0), partition, 3, seed=0)
    assert plan.owned == [list(range(8))] * 3
    assert plan.owner_sets() == [(0, 1, 2)]
    assert plan.spectral_gap(partition) == pytest.approx(1.0)


def test_unowned_units_fail_with_names_and_the_fix(partition):
    with pytest.raises(PlanError) as e:
        make_plan(masker(coverage=0.25, group_by="model"), partition, 2, seed=0)
    msg = str(e.value)
    assert "layer2.0, layer2.1, layer4.0, layer4.1" in msg and "masker.min_owners=1" in msg
    assert "smallest masker.coverage that works with 2 ranks is 0.5" in msg
    assert "works from 4 ranks on" in msg


def test_min_owners_above_coverage_fails(partition):
    with pytest.raises(PlanError, match="fewer than masker.min_owners=3"):
        make_plan(masker(coverage=0.5), partition, 4, seed=0, min_owners=3)


def test_inexpressible_coverage_warns(partition):
    with pytest.warns(UserWarning, match=r"masker.coverage=0.75 is not met exactly: .*2 of 2 units kept \(effective coverage 1.000\)"):
        make_plan(masker(coverage=0.75), partition, 4, seed=0)
    # Drawing across the whole model expresses it: 6 of 8 blocks per rank.
    plan = make_plan(masker(coverage=0.75, group_by="model"), partition, 4, seed=0)
    assert [len(o) for o in plan.owned] == [6] * 4


def test_digest_and_json_round_trip(partition):
    plan = make_plan(masker(coverage=0.5), partition, 4, seed=0)
    d = json.loads(plan.to_json(partition))
    assert d["units"][3]["owners"] == list(plan.owners(3))
    assert sum(d["params_per_rank"]) > 0
    again = MaskPlan.from_dict(d)
    assert again.owned == plan.owned and again.digest() == plan.digest()
    other = make_plan(masker(coverage=1.0), partition, 4, seed=0)
    assert other.digest() != plan.digest()
    d["owned"][0] = [1, 2]
    with pytest.raises(PlanError, match="digest"):
        MaskPlan.from_dict(d)


def test_plan_rejects_units_outside_partition():
    with pytest.raises(PlanError, match="owns unit 5"):
        MaskPlan(2, [[0, 5], [1]], 3)


def test_node_losses_count_the_nodes_a_unit_spans_not_its_owners():
    from subnetdp.core.errors import PlanError as _PlanError
    from subnetdp.core.plan import MaskPlan as _MaskPlan

    # 2 nodes x 2 ranks; unit 0 on ranks 0,1 (both on node 0), unit 1 on ranks 1,2 (across nodes).
    plan = _MaskPlan(4, [[0], [0, 1], [1], []], 2)  # the units each rank owns
    assert plan.failures_survived() == 1  # any one rank may die...
    assert plan.node_failures_survived(2) == 0  # ...but node 0 takes unit 0 with it
    assert plan.node_failures_survived(1) == 0 and plan.node_failures_survived(4) == 1  # one rank per node
    across = _MaskPlan(4, [[0], [1], [0], [1]], 2)  # each unit on a rank of node 0 and one of node 1
    assert across.node_failures_survived(2) == 1
    with pytest.raises(_PlanError, match="--nodes=3"):
        plan.node_failures_survived(3)


def test_without_keeps_surviving_owners_and_heals_only_below_min_owners():
    # 4 ranks, C = 0.5: every unit has 2 owners; rank 2 dies
    plan = MaskPlan(4, [[0, 1, 4], [2, 3, 5], [0, 2, 4], [1, 3, 5]], 6)
    after = plan.without([0, 1, 3], min_owners=2)
    assert after.world_size == 3
    # survivors renumbered in old-rank order, each keeping every unit it held
    for new, old in enumerate([0, 1, 3]):
        assert set(plan.owned[old]) <= set(after.owned[new])
    assert after.owner_counts() == [2] * 6  # units 0, 2, 4 fell to one owner: each gained one
    gained = [sorted(set(after.owned[new]) - set(plan.owned[old])) for new, old in enumerate([0, 1, 3])]
    assert sorted(u for g in gained for u in g) == [0, 2, 4]  # only the dead rank's units move
    assert max(map(len, after.owned)) - min(map(len, after.owned)) <= 1  # to the survivors with fewest units
    # min_owners=1: nothing moves at all
    assert plan.without([0, 1, 3]).owned == [plan.owned[0], plan.owned[1], plan.owned[3]]


def test_without_refuses_a_unit_with_no_surviving_owner():
    plan = MaskPlan(4, [[0], [1], [2], [3]], 4)
    with pytest.raises(PlanError, match=r"unit\(s\) \[2\] have no owner among the surviving ranks \[0, 1, 3\]"):
        plan.without([0, 1, 3], min_owners=2)


def test_without_keeps_the_survivors_on_their_nodes():
    # 2 nodes x 2 ranks (rank r on node r // 2), every unit owned on both nodes
    plan = MaskPlan(4, [[0, 1], [2, 3], [0, 2], [1, 3]], 4, nodes=2)
    assert plan.to_dict()["nodes"] == 2 and plan.to_dict()["node_failures_survived"] == 1
    after = plan.without([0, 1, 3])  # rank 2 (node 1) dies: the survivors stay on nodes 0, 0, 1
    d = after.to_dict()
    assert (d["nodes"], d["node_of_rank"]) == (2, [0, 0, 1])
    assert d["node_failures_survived"] == after.node_failures_survived() == 0  # unit 1: ranks 0 and 2 (both node 0)
    assert MaskPlan.from_dict(d).node_of == (0, 0, 1) and MaskPlan.from_dict(d).digest() == after.digest()
    lost = after.without([0, 1])  # then node 1 whole: one node holds every survivor
    assert (lost.to_dict()["nodes"], lost.to_dict()["node_of_rank"], lost.to_dict()["node_failures_survived"]) == (1, [0, 0], 0)
    assert plan.without([1, 2, 3]).node_of == (0, 1, 1)  # node numbers are the job's: rank 0 gone, node 0 stays
    # a join returns to the job's W-rank plan, whose nodes are its own; a one-node plan stays as it was
    assert "nodes" not in MaskPlan(4, plan.owned, 4).without([0, 1, 3]).to_dict()
    assert plan.replicated(2).replicas(2).node_of == () and after.replicated(2).replicas(2).node_of == (0, 0, 1)
    with pytest.raises(PlanError, match=r"node_of \[0, 0\] does not place 3 ranks"):
        MaskPlan(3, [[0], [1], [2]], 3, nodes=1, node_of=(0, 0))


def test_the_plan_picture_shows_each_ranks_units():
    # What TensorBoard's plan/ownership and `subnetdp plan --png` show: one cell per (rank, unit), dark where
    # the rank owns the unit (drawn with Pillow; matplotlib's import cost rank 0 0.43 s of CPU every run).
    import numpy as np

    from subnetdp.train.picture import CELL, EMPTY, OWNED, plan_picture

    plan = MaskPlan(3, [[0, 1], [1, 2, 3], [4]], 5)
    picture = np.asarray(plan_picture(plan.as_image(), [f"unit{u}" for u in range(5)], plan.owner_counts()))
    assert picture.dtype == np.uint8 and picture.shape[2] == 3
    inside = (CELL - 1) ** 2  # a cell's pixels less the grid lines on its top and left
    owned, empty = (int((picture == np.array(c, dtype=np.uint8)).all(axis=2).sum()) for c in (OWNED, EMPTY))
    assert owned == 6 * inside and empty == (15 - 6) * inside

"""The random and balanced maskers, cyclic at neuron level, min_owners, and the resampling family."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from subnetdp.core.contracts import DataSpec, MaskerConfig
from subnetdp.core.errors import PlanError
from subnetdp.core.plan import make_plan, units_kept
from subnetdp.sdp.resample import draw, family, rotated
from subnetdp.plugins.maskers.balanced import BalancedMasker
from subnetdp.plugins.maskers.cyclic import CyclicMasker
from subnetdp.plugins.maskers.random import RandomMasker
from subnetdp.plugins.models.resnet.adapter import ResNetAdapter, ResNetConfig

SPEC = DataSpec(in_channels=1, image_size=8, num_classes=10)


@pytest.fixture(scope="module")
def partitions():
    adapter = ResNetAdapter(OmegaConf.structured(ResNetConfig))
    torch.manual_seed(0)
    model = adapter.build(SPEC)
    return {"block": adapter.partition(model, "block", SPEC),
            "neuron": adapter.partition(model, "neuron", SPEC, units_per_layer=8)}


def masker(cls, **kw):
    cfg = OmegaConf.structured(MaskerConfig)
    for k, v in kw.items():
        cfg[k] = v
    return cls(cfg)


@pytest.mark.parametrize("coverage,world", [(0.5, 4), (0.375, 8), (0.75, 4), (0.3, 5)])
def test_random_is_seeded_and_even(partitions, coverage, world):
    part = partitions["neuron"]
    m = masker(RandomMasker, coverage=coverage)
    plan = make_plan(m, part, world, seed=3)
    assert plan.digest() == m.plan(part, world, 3).digest()  # pure function of its inputs
    assert plan.digest() != m.plan(part, world, 4).digest()  # the seed matters
    for ids in part.groups().values():
        counts = [plan.k(u.id) for u in ids]
        assert max(counts) - min(counts) <= 1  # as close to C x W owners as integers allow
        n = units_kept(coverage, len(ids))
        assert all(len(set(u.id for u in ids) & set(plan.owned[r])) == n for r in range(world))


def test_balanced_equalises_cost(partitions):
    part = partitions["block"]
    costs = [u.cost for u in part.units]
    assert len(set(costs)) > 1  # ResNet blocks cost different amounts (downsampling blocks)
    plan = make_plan(masker(BalancedMasker, coverage=0.5), part, 4, seed=0)
    assert plan.owner_counts() == [2] * len(part.units)
    per_rank = plan.cost_per_rank(part)
    assert max(per_rank) - min(per_rank) <= max(costs)  # greedy LPT bound
    assert plan.to_dict(part)["cost_per_rank"] == per_rank
    # Better balanced than a cyclic plan of the same coverage (or equal).
    cyc = make_plan(masker(CyclicMasker, coverage=0.5), part, 4, seed=0).cost_per_rank(part)
    assert max(per_rank) - min(per_rank) <= max(cyc) - min(cyc) + 1e-6
    # min_owners raises the owner count of every unit.
    with pytest.warns(UserWarning, match="effective coverage"):  # 3 of 4 owners is more than C = 0.25
        plan3 = make_plan(masker(BalancedMasker, coverage=0.25, min_owners=3), part, 4, seed=0, min_owners=3)
    assert min(plan3.owner_counts()) == 3


def test_cyclic_at_neuron_level_and_min_owners(partitions):
    part = partitions["neuron"]
    plan = make_plan(masker(CyclicMasker, coverage=0.5), part, 4, seed=0)
    assert plan.owner_counts() == [2] * 64
    assert all(c == [0.5] * 4 for c in plan.effective_coverage(part).values())
    assert len(plan.owner_sets()) <= 4 + 1
    with pytest.raises(PlanError, match="masker.min_owners=3.*smallest masker.coverage"):
        make_plan(masker(CyclicMasker, coverage=0.5), part, 4, seed=0, min_owners=3)
    with pytest.raises(PlanError, match="fewer than masker.min_owners=2"):
        make_plan(masker(RandomMasker, coverage=0.25), part, 4, seed=0, min_owners=2)


def test_resampling_family_keeps_owner_sets(partitions):
    part = partitions["neuron"]
    base = make_plan(masker(RandomMasker, coverage=0.5), part, 4, seed=1)
    members = family(base, part)
    assert len(members) == 8 and members[0].digest() == base.digest()
    for m in members:
        assert set(m.owner_sets()) == set(base.owner_sets())  # every group exists from the start
        assert sorted(m.owner_counts()) == sorted(base.owner_counts())
    # Over the whole family every rank owns every unit equally often.
    for r in range(4):
        times = [sum(u in m.owned[r] for m in members) for u in range(base.num_units)]
        assert len(set(times)) == 1
    assert draw(base, part, seed=1, index=0) is base
    assert draw(base, part, 1, 5).digest() == draw(base, part, 1, 5).digest()
    assert rotated(base, part, 8).digest() == base.digest()

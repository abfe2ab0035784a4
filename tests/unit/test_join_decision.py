"""The members' agreement on a join step (``regroup.join_decision``), on a real torch store, no process group."""

from __future__ import annotations

import torch.distributed as dist

from subnetdp.core.plan import MaskPlan
from subnetdp.plugins.comm.regroup import DEAD_KEY, announce, join_decision, joined_membership
from subnetdp.train.rejoin import with_newcomer


def test_every_member_takes_the_newcomer_in_at_the_first_proposal_and_none_a_step_ahead():
    store = dist.HashStore()
    world = (0, 2, 3)  # worker 1 died; the replacement is worker 4, for rank 1
    assert join_decision(store, 5, 100, 2, world, True) is None  # nobody waits: one check, nothing decided
    announce(store, 4, 1)
    # The first member to see it (at the boundary after step 5) proposes the boundary after step 6 ...
    first = join_decision(store, 5, 100, 2, world, True, {"plan": [[0], [1], [2]]})
    assert first is not None and first["step"] == 6 and first["plan"] == [[0], [1], [2]]
    # ... and a member that sees it only a boundary later adopts that one, not one of its own.
    later = join_decision(store, 6, 100, 2, world, True)
    assert later == first
    m = joined_membership(later, 2)
    assert m.members == (0, 4, 2, 3) and m.rank == 2 and m.world_size == 4 and m.commit_step == 6
    assert m.prefix == "subnetdp/join/4/2"  # never a death's re-formation keys (subnetdp/regroup/2)
    # A decision made for another world (a death came between) is void for every member alike.
    assert join_decision(store, 6, 100, 2, (0, 3), True) is None
    assert join_decision(store, 6, 100, 3, world, True) is None


def test_no_join_is_proposed_too_late_after_a_new_death_or_when_the_world_is_not_one_short():
    for step, can_grow, dead in ((99, True, None), (5, False, None), (5, True, 3)):
        store = dist.HashStore()
        announce(store, 4, 1)
        if dead is not None:
            store.set(f"{DEAD_KEY}/{dead}", "exit -9")
        assert join_decision(store, step, 100, 2, (0, 2, 3), can_grow) is None, (step, can_grow, dead)


def test_the_plan_as_it_stands_is_numbered_at_w_with_the_newcomer_holding_nothing():
    plan = MaskPlan(3, [[0, 1], [1, 2], [0, 2]], 3)
    grown = with_newcomer(plan, 1)
    assert grown.world_size == 4 and grown.owned == [[0, 1], [], [1, 2], [0, 2]]
    assert grown.owners(1) == (0, 2)


def test_a_replacement_without_going_on_in_process_is_refused_in_one_line_before_any_worker():
    import pytest

    from subnetdp.core.config import Settings, compose
    from subnetdp.core.errors import ConfigError
    from subnetdp.core.plugins import PluginManager
    from subnetdp.train.command import _start_local_workers

    cfg = compose("resnet18_digits", ["launch.nproc=2", "launch.replace=1"])
    with pytest.raises(ConfigError, match=r"launch.replace=1: .*launch.on_failure=restart .*set launch.on_failure=continue"):
        _start_local_workers(cfg, Settings.from_config(cfg), "resnet18_digits", ["launch.replace=1"], PluginManager())

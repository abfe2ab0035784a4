"""Ranks that disagree stop at start-up with a message saying which rank differs and how.

The real check runs over 2 gloo processes (a config that differs only in ``optim.lr``, so the plans
agree; and one whose coverage, hence plan, differs); the message builder is also checked on its
own for plans and plugin versions.
"""

from __future__ import annotations

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import RankMismatchError
from subnetdp.train.setup import describe_disagreement, setup
from tests.helpers import plugin_manager, run_ranks, small_config


def _disagreeing_worker(rank: int, world: int, init_method: str, key: str, mine: str, theirs: str) -> None:
    """Rank 0 sets ``key=mine``, the others ``key=theirs``: setup must stop every rank."""
    cfg = small_config(f"{key}={mine if rank == 0 else theirs}", "train.steps=1", f"comm.init_method={init_method}",
                       "run.name=disagree", run_dir=init_method.removeprefix("file://") + "-runs")
    try:
        setup(cfg, LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
    except RankMismatchError:
        raise
    raise AssertionError(f"ranks with different {key} were not stopped")


def test_ranks_with_different_configs_stop_naming_the_key(tmp_path):
    errors = run_ranks(_disagreeing_worker, 2, tmp_path, "optim.lr", "0.05", "0.01", expect_error=True)
    for e in errors:
        assert e.startswith("RankMismatchError: rank 1 has a different config than rank 0"), e
        assert "optim.lr=0.01 vs 0.05" in e and "same recipe, overrides and installed plugins" in e


def test_ranks_that_disagree_on_the_plan_stop_with_a_message(tmp_path):
    errors = run_ranks(_disagreeing_worker, 2, tmp_path, "masker.coverage", "0.5", "1.0", expect_error=True)
    for e in errors:
        assert e.startswith("RankMismatchError"), e
        assert "rank 1 has a different plan than rank 0" in e


def _info(owned, lr=0.05, plugins=None):
    return {"plan": str(owned), "config": str(lr), "plugins": plugins or {"resnet": "subnetdp==0.1.0"},
            "owned": owned, "values": {"optim": {"lr": lr}, "seed": 0}}


def test_disagreement_messages_for_plan_and_plugins():
    same = [_info([[0], [1]]), _info([[0], [1]])]
    assert describe_disagreement(same) is None
    msg = describe_disagreement([_info([[0], [1]]), _info([[0], [0, 1]])])
    assert msg.startswith("rank 1 has a different plan than rank 0") and "rank 1 owns [0, 1] vs [1]" in msg
    msg = describe_disagreement([_info([[0]]), _info([[0]]), _info([[0]], plugins={"resnet": "subnetdp==0.2.0"})])
    assert msg.startswith("rank 2 has a different plugins than rank 0")
    assert "resnet: subnetdp==0.2.0 vs subnetdp==0.1.0" in msg

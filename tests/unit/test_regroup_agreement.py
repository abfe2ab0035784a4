"""The survivors' agreement on one real store: one decision for all, a late survivor told to leave."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from subnetdp import SubnetdpError
from subnetdp.launchers.supervisor import DEAD_KEY
from subnetdp.plugins.comm.regroup import agree


def _store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def test_every_survivor_adopts_the_first_decision():
    store = _store()
    store.set(f"{DEAD_KEY}/2", "exit -9")  # the supervisor reaped rank 2
    for r, step in ((1, 7), (3, 6)):  # two survivors registered before rank 0 decides
        store.set(f"subnetdp/regroup/1/alive/{r}", str(step))
    m0 = agree(store, 0, range(4), [], generation=1, last_step=7, timeout_s=5)
    m3 = agree(store, 3, range(4), [], generation=1, last_step=6, timeout_s=5)
    assert m0.members == m3.members == (0, 1, 3) and (m0.rank, m3.rank) == (0, 2)
    assert m0.last_steps == (7, 7, 6) and m0.commit_step == 6 and not m0.consistent


def test_a_survivor_after_the_decision_leaves_with_one_line():
    store = _store()
    store.set("subnetdp/regroup/1/alive/1", "4")
    m1 = agree(store, 1, range(3), [0, 2], generation=1, last_step=4, timeout_s=0.05)  # 0 and 2 lost
    assert m1.members == (1,) and m1.consistent
    with pytest.raises(SubnetdpError, match=r"rank 2 reached the re-formation 1 after the survivors \[1\]"):
        agree(store, 2, range(3), [0], generation=1, last_step=4, timeout_s=0.05)

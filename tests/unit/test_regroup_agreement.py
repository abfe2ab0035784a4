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


class _Counted:
    """A real store whose round trips are counted."""

    def __init__(self, store) -> None:
        self.store, self.trips = store, 0

    def num_keys(self) -> int:
        self.trips += 1
        return self.store.num_keys()

    def check(self, keys) -> bool:
        self.trips += 1
        return self.store.check(keys)


def test_a_collectives_watch_costs_one_round_trip_while_the_store_stands_still():
    # Every supervised collective watches the store while it waits. Looking up each of the 2W marks at
    # every look made a supervised step about twice as slow as torchrun's on this machine (load ~10).
    from subnetdp.plugins.comm.regroup import MarkWatch

    store = _store()
    store.set("subnetdp/node/0/beat", "1")
    counted, watch = _Counted(store), MarkWatch()
    marks = [f"{DEAD_KEY}/{r}" for r in range(4)] + [f"subnetdp/regroup/1/alive/{r}" for r in range(4)]
    assert not watch.marked(counted, marks) and counted.trips == 1 + len(marks)  # the first look reads them all
    counted.trips = 0
    for _ in range(5):
        assert not watch.marked(counted, marks)
    assert counted.trips == 5  # the key count alone: nothing was added
    store.set("subnetdp/join/next", "x")  # an unrelated key: looked up once more, still nothing
    assert not watch.marked(counted, marks) and not watch.marked(counted, marks)
    store.set(f"{DEAD_KEY}/2", "exit -9")  # the supervisor reaped rank 2
    assert watch.marked(counted, marks) and watch.marked(counted, marks)  # and it stays seen

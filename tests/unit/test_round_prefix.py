"""The store prefix of a torchrun round is agreed by every agent's workers, not each agent's restart count."""

from __future__ import annotations

import torch.distributed as dist

from subnetdp.plugins.comm.peers import round_prefix


def test_round_prefix_is_agreed_when_only_one_agent_restarted(monkeypatch):
    store = dist.HashStore()  # the agent store torchrun keeps across rounds
    first = {round_prefix(store, rank) for rank in range(4)}
    assert len(first) == 1
    # Round 2: node 1's agent was killed and restarted fresh (its restart count is 0 again) while
    # node 0's agent is at 1; every worker of both nodes joins again.
    prefixes = {}
    for rank, restart_count in ((0, "1"), (1, "1"), (2, "0"), (3, "0")):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
        prefixes[rank] = round_prefix(store, rank)
    assert len(set(prefixes.values())) == 1, prefixes
    assert set(prefixes.values()) != first  # the new round never reads the dead round's keys
    # Ranks may arrive in any order within a round: the prefix is the same.
    third = {round_prefix(store, rank) for rank in (3, 1, 0, 2)}
    assert len(third) == 1 and third.isdisjoint(first | set(prefixes.values()))

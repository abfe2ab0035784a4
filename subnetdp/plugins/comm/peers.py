"""A failed collective's diagnosis: who is gone (dead on this host, silent, left after the loss), and
why a world did not assemble, for :class:`~subnetdp.plugins.comm.torch_dist.TorchDistCommunicator`.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Sequence

from subnetdp import Communicator


def is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text or "deadline" in text


#: What gloo, NCCL and the TCP store say when the process at the other end is gone (killed, crashed).
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
             "socket closed", "end of file", "remote process exited")


def is_peer_gone(error: BaseException) -> bool:
    text = str(error).lower()
    return any(p in text for p in PEER_GONE)


HOST_KEY = "subnetdp/process"  # + /<rank>: "host pid" of every rank, written when the group is made
#: + /<rank>: written by a rank that met a lost peer, before it leaves: its own exit is no death to name
LEFT_KEY = "subnetdp/left"


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def dead_on_this_host(store: Any, members: Sequence[int], wait_s: float = 0.0) -> tuple[list[int], list[int]]:
    """(members known dead, members on other hosts) from the processes every rank registered.

    A member that left after meeting the loss itself (``LEFT_KEY``) is neither: a survivor that was
    quicker to write its files and exit must not be named beside the rank that died. A dying process
    closes its connections before the kernel marks it dead, so the members of this host are looked
    at again for up to ``wait_s`` seconds while none of them is dead yet.
    """
    me, local, elsewhere = os.uname().nodename, {}, []
    for r in members:
        try:
            if store.check([f"{LEFT_KEY}/{r}"]):
                continue
        except Exception:
            pass
        try:
            # Looked at before it is read: a store's get waits for a missing key (comm.timeout_s), and a
            # replacement started after a death registered none.
            if not store.check([f"{HOST_KEY}/{r}"]):
                elsewhere.append(r)
                continue
            host, pid = store.get(f"{HOST_KEY}/{r}").decode().split()
        except Exception:  # not registered (an older peer) or the store is gone: unknown
            elsewhere.append(r)
            continue
        if host != me:
            elsewhere.append(r)
        else:
            local[r] = int(pid)
    deadline = time.monotonic() + wait_s
    while True:
        dead = [r for r, pid in local.items() if not _process_alive(pid)]
        if dead or time.monotonic() >= deadline:
            return dead, elsewhere
        time.sleep(0.02)


def ranks_named(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 1, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def stalled_peers(store: Any, rank: int, members: Sequence[int], key: str, grace: float,
                  candidates: Sequence[int] | None = None) -> list[int]:
    """The members of a failed collective that never reported the failure themselves.

    Every member that sees it writes ``key/<rank>`` into the world's store; a member that does not
    within ``grace`` seconds was not waiting in the collective: it is the one that stopped answering.
    ``candidates``: only these members are waited for (the others are known).
    """
    store.set(f"{key}/{rank}", "timed out")
    deadline = time.monotonic() + grace
    silent = [r for r in (members if candidates is None else candidates) if r != rank]
    while silent and time.monotonic() < deadline:
        silent = [r for r in silent if not store.check([f"{key}/{r}"])]
        time.sleep(0.05)
    return silent


def round_prefix(store: Any, rank: int) -> str:
    """The store prefix of this rendezvous round, the same on every agent's workers.

    ``TORCHELASTIC_RESTART_COUNT`` is per agent: when only one node's agent restarts, the survivor is
    at attempt 1 and the fresh agent at 0, and their workers would meet under different prefixes (a
    hang until ``comm.timeout_s``). Every round restarts every worker, so each rank joins the shared
    store once per round: the count of rank ``rank``'s joins is the round, on every rank alike.
    """
    joins = int(store.add(f"subnetdp/joins/{rank}", 1))
    return f"subnetdp/round-{joins}"


#: How a closed connection to the store reads in torch's errors (gloo's TCPStore client).
_STORE_HOST_LEFT = ("connection was likely closed", "connection reset", "broken pipe", "failed to recv")


def arrival_error(comm: Communicator, init_method: str, timeout: float, error: BaseException) -> str:
    """A message for a world that did not assemble: how many processes were expected, how many came."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = (f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
             if init_method == "env://" else init_method)
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        arrived = f"only {joined.group(1)} of {comm.world_size} processes arrived"  # rank 0 counts itself
    elif "timed out" in text.lower() or "timeout" in text.lower():
        arrived = f"rank {comm.rank} of {comm.world_size} could not meet the others"
    elif comm.rank != 0 and any(s in text.lower() for s in _STORE_HOST_LEFT):
        # Rank 0 hosts the store: when it gives up first (its own timeout started earlier), the others
        # see their connection close before their timeout. The same case, said the same way.
        arrived = f"rank {comm.rank} of {comm.world_size} could not meet the others (rank 0, the store's host, gave up)"
    else:
        return (f"comm.name={comm.cfg.name}: creating the {comm.world_size}-process group at {where} failed: "
                f"{text}")
    return (f"comm.name={comm.cfg.name}: {arrived} at {where} within comm.timeout_s={timeout:g} s "
            f"(the launcher promised world size {comm.world_size}; {comm.env.launcher} launch). Start "
            f"exactly {comm.world_size} processes with the same MASTER_ADDR/MASTER_PORT, or raise "
            f"comm.timeout_s if some start late. ({text})")

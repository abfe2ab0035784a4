"""Whether the other nodes' supervisors are alive: a beat in the job's store, watched by every supervisor.

Over several nodes (``launch.nodes=N launch.on_failure=continue``) each supervisor reaps its own
workers and marks their deaths in the job's store. A node lost whole (its supervisor and its
workers killed, the machine gone) marks nobody: without a mark the survivors' agreement waits for
its workers until ``comm.timeout_s`` (``plugins/comm/regroup.py``, ``agree``). The workers' closed
connections are no proof of a death (a survivor that aborted its old groups closes them too), so
each supervisor beats a counter in the store (``TCPStore.add``) and watches the others': a node
whose counter stood still for :data:`SILENCE_S` of this supervisor's own clock (no clocks compared
across machines) is lost, and its workers are marked dead here, as its supervisor would have. A node
whose supervisor ended normally says so first and is never marked.
"""

from __future__ import annotations

import time
from typing import Any

#: + /<node>/beat: the node's counter; + /<node>/done: its supervisor ended (its workers with it).
NODE_KEY = "subnetdp/node"
#: Seconds without a beat after which a node is lost. A supervisor beats every poll (20 ms); on a
#: loaded 2-core machine a poll was measured late by well under a second, so 2 s leaves a margin
#: while keeping a node's loss far below the restart it replaces.
SILENCE_S = 2.0


class Liveness:
    """This node's beat and its watch on the other nodes (one per supervisor, called every poll).

    Args:
        store: the job's store (a client on every node but the endpoint's).
        node: this node's place (``launch.node_rank``).
        workers_of: node -> the worker ids (global ranks) it started.
        dead_key: the store key under which a worker's death is marked (``/<id>``).
        silence_s: seconds without a beat that make a node lost.
    """

    def __init__(self, store: Any, node: int, workers_of: dict[int, list[int]], dead_key: str,
                 silence_s: float = SILENCE_S) -> None:
        self.store, self.node, self.workers_of, self.dead_key = store, node, workers_of, dead_key
        self.silence_s = silence_s
        self._seen: dict[int, tuple[int, float]] = {}  # node -> (its last count, when it changed, our clock)
        self.lost: list[int] = []
        self.store_gone = False

    def stop(self) -> None:
        """The store failed (its host, node 0's supervisor, died): beat and watch no more. Every call on a
        dead store fails after torch's client has written a warning with a C++ backtrace; there is nobody
        left to tell anything anyway."""
        self.store_gone = True

    def tick(self) -> list[int]:
        """Beat once, and mark the workers of every node found silent; returns the nodes lost by this tick."""
        if self.store_gone:
            return []
        self.store.add(f"{NODE_KEY}/{self.node}/beat", 1)
        now, newly = time.monotonic(), []
        for n in self.workers_of:
            if n == self.node or n in self.lost:
                continue
            count = int(self.store.add(f"{NODE_KEY}/{n}/beat", 0))
            if count == 0:
                continue  # not arrived yet: its workers' own start-up time-outs cover a node that never comes
            last = self._seen.get(n)
            if last is None or last[0] != count:
                self._seen[n] = (count, now)
            elif now - last[1] > self.silence_s and not self.store.check([f"{NODE_KEY}/{n}/done"]):
                self._mark(n, now - last[1])
                newly.append(n)
        return newly

    def _mark(self, n: int, silent_s: float) -> None:
        for w in self.workers_of[n]:
            if not self.store.check([f"{self.dead_key}/{w}"]):
                self.store.set(f"{self.dead_key}/{w}", f"node {n} lost (no beat for {silent_s:.1f} s)")
        self.lost.append(n)

    def pending(self) -> list[int]:
        """The other nodes that arrived and neither ended nor were lost (node 0 keeps the store up for them)."""
        if self.store_gone:
            return []
        return [n for n in self._seen if n not in self.lost and not self.store.check([f"{NODE_KEY}/{n}/done"])]

    def done(self) -> None:
        """This node's supervisor ends normally: the others must not take its silence for a loss."""
        if not self.store_gone:
            self.store.set(f"{NODE_KEY}/{self.node}/done", "1")

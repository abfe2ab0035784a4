"""A whole node lost and restarted: 2 torchrun agents x 2 workers, owners placed across nodes.

ResNet-18 on digits at C = 0.5 with ``masker.min_owners=2``: the plan interleaves the nodes' ranks,
so every unit has an owner on each node (the default order puts both owners of every second block on
one node). The agent that does not host the rendezvous store is SIGKILLed with its workers (its
whole process group) in the middle of the run and started again with the same command; the
surviving agent restarts its workers for the next rendezvous round, and the job continues from the
last step every survivor finished, assembled from the survivors' files, without a checkpoint on
disk: no finished step is trained twice.
"""

from __future__ import annotations

import json
import re
import time

from subnetdp.launchers.command import launch_command
from subnetdp.launchers.nodes import Nodes
from subnetdp.plugins.comm._rendezvous import free_port
from tests.e2e.test_multinode import ARGS, RDZV, Agent, _assert_nobody_left, _wait_for, agents  # noqa: F401

STEPS = 14
EXTRA = [f"train.steps={STEPS}", "train.log_every=1", f"checkpoint.every={STEPS}", "masker.coverage=0.5",
         "masker.min_owners=2", "eval.bn_recalibrate_batches=0"]


def _logged_steps(metrics) -> list[int]:
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [int(r["step"]) for r in rows if "step" in r and "train/loss" in r]


def _node(agents: list[Agent], tmp, nodes: Nodes, rank: int) -> Agent:
    cmd = launch_command("torchrun", 2, [*ARGS, f"run.dir={tmp}", "run.name=job", *EXTRA], nodes=nodes, node_rank=rank)
    agents.append(Agent(cmd, tmp / f"node{rank}"))
    return agents[-1]


def test_a_lost_node_restarted_alone_continues_from_its_surviving_owners(tmp_path, agents):
    nodes = Nodes(2, 2, f"127.0.0.1:{free_port()}", "job", max_restarts=2, rdzv_conf=RDZV)
    host, lost = (_node(agents, tmp_path, nodes, rank) for rank in (0, 1))
    run = tmp_path / "job"
    metrics = run / "metrics.jsonl"
    _wait_for("a few finished steps", lambda: len(_logged_steps(metrics)) >= 3, timeout=300)
    lost.kill_group()  # the node vanishes: its agent by SIGKILL, its two workers with it
    lost.wait(60)
    before = _logged_steps(metrics)
    again = Agent(lost.cmd, tmp_path / "node1-again")  # the same command, on the same "machine"
    agents.append(again)
    assert host.wait(600) == 0, host.console[-6000:]
    assert again.wait(120) == 0, again.console[-6000:]
    consoles = host.console + again.console
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == STEPS
    recovered = re.search(r"recovered step (\d+) from the surviving owners", consoles)
    assert recovered, consoles[-6000:]
    steps = _logged_steps(metrics)
    assert steps == list(range(1, STEPS + 1)), steps  # every step once: none trained twice, none lost
    assert int(recovered.group(1)) >= max(before)  # the last step every survivor finished, not older
    assert 0 < int(recovered.group(1)) < STEPS
    plan = json.loads((run / "plan.json").read_text())
    assert plan["nodes"] == 2 and plan["node_failures_survived"] == 1  # owners across nodes
    print(f"\nnode 1 lost after step {max(before)}; {recovered.group(0)}")
    for a in (host, again):
        assert "Traceback" not in a.console, a.console[-6000:]
    _assert_nobody_left(str(tmp_path), agents)

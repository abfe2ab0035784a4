"""``launch.on_failure=continue`` over two nodes: a worker dies, then a whole node; the others go on in-process.

Two "nodes" on this machine, each a real ``subnetdp train ... launch.nodes=2 launch.node_rank=R``
(a supervisor and its 2 workers, as tests/e2e/test_multinode.py runs 2 torchrun agents): node 0's
supervisor serves the job's store at the endpoint, node 1's reaches it as a client. One job, two
failures, so one pair of start-ups pays for both:

1. rank 2 (node 1) is SIGKILLed inside step 4's gradient averaging: node 1's supervisor reaps it and
   marks it dead in the shared store, and the 3 survivors on both nodes go on in-process;
2. later, node 1 vanishes whole (its supervisor SIGKILLed, its last worker with it): nobody is left
   there to reap, so node 0's supervisor finds node 1's beat silent and marks its worker dead, and
   the 2 workers of node 0 go on (the plan places every unit's owners on both nodes).

Neither agreement may wait out ``comm.timeout_s`` for an unmarked rank (the survivors say so in one
line when they have to); no finished step is trained twice; the owners' digests agree after every
step (``recovery.verify_every=1``), after both heals.

Node 0 lost whole is the other case: its supervisor hosts the job's store, so nobody can agree on
anything after it. The smallest job that shows it (a worker per node, every unit owned on both):
node 1's worker must take the restart path within seconds (its files, the ``resume=auto`` line, exit
2), its supervisor say so in one line, and those files alone let a restart resume the last step.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest
from omegaconf import OmegaConf

from subnetdp.core.contracts import DataSpec
from subnetdp.plugins.comm._rendezvous import free_port
from subnetdp.sdp.construct import meta_model
from subnetdp.sdp.variants import partition_model
from subnetdp.train import faults
from subnetdp.train.checkpoints import lineage, survivors
from tests.helpers import plugin_manager
from tests.e2e.test_multinode import ENV, Agent, _assert_nobody_left, _wait_for, agents  # noqa: F401

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and uses prctl")

STEPS = 14
ARGS = ["resnet18_digits", f"train.steps={STEPS}", "train.batch_size=4", "train.log_every=1", "train.progress=false",
        "eval.bn_recalibrate_batches=0", "eval.every=0", "optim.warmup_steps=0", "masker.coverage=0.5",
        "masker.min_owners=2", "recovery.verify_every=1", "launch.threads_per_rank=1", "comm.timeout_s=30",
        "launch.nproc=2", "launch.nodes=2", "launch.on_failure=continue"]


def _steps(metrics) -> list[int]:
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [int(r["step"]) for r in rows if "train/loss" in r]


def test_survivors_on_both_nodes_go_on_after_a_worker_and_then_a_whole_node_die(tmp_path, agents):
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**ENV, faults.KILL_IN_SYNC: "4", faults.KILL_RANK: "2"}
    for node in (0, 1):  # node 0 first: its supervisor serves the store (node 1's waits for it anyway)
        cmd = [sys.executable, "-m", "subnetdp", "train", *ARGS, f"run.dir={tmp_path}", "run.name=job",
               f"launch.rdzv_endpoint={endpoint}", f"launch.node_rank={node}"]
        agents.append(Agent(cmd, tmp_path / f"node{node}", env))
    host, lost = agents
    run = tmp_path / "job"
    metrics = run / "metrics.jsonl"
    # The first death is over when the 3 survivors finished two more steps; then node 1 goes whole.
    _wait_for("the 3 survivors' steps after the first death", lambda: max(_steps(metrics), default=0) >= 7, timeout=400)
    assert "the 3 survivors (old ranks [0, 1, 3]) go on in-process from step 3" in host.console, host.console[-4000:]
    # plan.json of the 3 survivors: they still sit on both nodes (ranks 0, 1 on node 0, rank 2 on node 1)
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["world_size"], plan["nodes"], plan["node_of_rank"]) == (3, 2, [0, 0, 1]), plan
    lost.kill_group()  # node 1's supervisor by SIGKILL; its worker dies with it (PR_SET_PDEATHSIG)
    last_before = max(_steps(metrics))
    assert host.wait(400) == 0, host.console[-6000:]
    lost.wait(60)
    console = host.console
    assert faults.fault_marker(run, faults.KILL_IN_SYNC, 4, 2).exists()  # the first SIGKILL happened
    assert "the 3 survivors (old ranks [0, 1, 3]) go on in-process from step 3" in console
    # Node 0's supervisor saw node 1's beat stop and marked its remaining worker (rank 3) dead.
    assert re.search(r"node 1 lost \(no beat for [\d.]+ s\): its workers \[2, 3\] are marked dead", console), console[-6000:]
    second = re.search(r"the 2 survivors \(old ranks \[0, 1\]\) go on in-process from step (\d+): (\d+) piece", console)
    assert second and int(second.group(2)) > 0, console[-6000:]  # rank 3's units gained owners on node 0
    assert int(second.group(1)) >= last_before  # the last step both survivors finished, not older
    # Every death was marked: no agreement waited out comm.timeout_s for a rank nobody accounted for.
    assert "neither checked in nor were marked dead" not in console, console[-6000:]
    assert "owners disagree" not in console and "Traceback" not in console, console[-6000:]
    steps, commit = _steps(metrics), int(second.group(1))
    # Every step's row once, and the run ended: where node 1 went between the survivors' update of the commit
    # step and its row, the survivors wrote that row after going on (docs/inprocess.md, Logging).
    assert steps == list(range(1, STEPS + 1)), (steps, commit)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    plan = json.loads((run / "plan.json").read_text())  # node 0 holds both survivors: one node left
    assert (plan["nodes"], plan["node_of_rank"], plan["node_failures_survived"]) == (1, [0, 0], 0), plan
    _assert_nobody_left(str(tmp_path), agents)


def _expected(run, step: int, rank: int) -> survivors.Expected:
    """What ``resume=auto`` checks the survivors' files against (the model's partition, built on ``meta``)."""
    frag = survivors.fragment_dir(run, step, rank)
    header = json.loads((frag / survivors.FRAGMENT).read_text())["header"]
    cfg = OmegaConf.load(frag / "config.yaml")
    adapter = plugin_manager().registries["model"].get(cfg.model.name)(cfg.model)
    spec = DataSpec(**header["data_spec"])
    return survivors.Expected(lineage.read(run), header["model"], partition_model(adapter, meta_model(adapter, spec),
                                                                                  cfg.masker, spec))


def test_when_node_0_the_stores_host_dies_whole_node_1_keeps_its_units_and_leaves_at_once(tmp_path, agents):
    timeout_s = 60
    # A worker per node, every unit owned by both (C = 1 at W = 2); the run is far from its end when node 0 goes.
    args = ["resnet18_digits", "train.steps=40", "train.batch_size=4", "train.log_every=1", "train.progress=false",
            "eval.bn_recalibrate_batches=0", "eval.every=0", "optim.warmup_steps=0", "masker.coverage=1",
            "masker.min_owners=2", "launch.threads_per_rank=1", f"comm.timeout_s={timeout_s}", "launch.nproc=1",
            "launch.nodes=2", "launch.on_failure=continue"]
    endpoint = f"127.0.0.1:{free_port()}"
    for node in (0, 1):
        cmd = [sys.executable, "-m", "subnetdp", "train", *args, f"run.dir={tmp_path}", "run.name=job",
               f"launch.rdzv_endpoint={endpoint}", f"launch.node_rank={node}"]
        agents.append(Agent(cmd, tmp_path / f"node{node}"))
    host, other = agents
    run = tmp_path / "job"
    metrics = run / "metrics.jsonl"
    _wait_for("two finished steps", lambda: max(_steps(metrics), default=0) >= 2, timeout=400, every=0.05)
    host.kill_group()  # node 0's supervisor by SIGKILL, the job's store with it; its worker dies with it
    killed = time.monotonic()
    last_before = max(_steps(metrics))
    assert other.wait(400) == 2, other.console[-6000:]
    seconds = time.monotonic() - killed
    host.wait(60)
    print(f"\nnode 0 SIGKILLed after step {last_before} -> node 1's supervisor ended: {seconds:.1f} s")  # docs' figure
    console = other.console
    # Node 1's worker met the closed connection at once and the store's absence at the agreement: no wait
    # ran into comm.timeout_s, which is all a bound of half of it can rule out on a loaded machine.
    assert seconds < timeout_s / 2, (seconds, console[-6000:])
    kept = re.search(r"subnetdp: error: rank 1 stopped in step \d+: .*; it kept its units as of step (\d+) in "
                     r"(\S+); continue with: .* resume=auto ", console)
    assert kept, console[-6000:]
    assert "not going on in-process: the survivors did not re-form (the job's store is gone" in console, console
    assert console.count("subnetdp supervisor: the job's store is gone (") == 1, console
    # One line per process: torch's C++ store warnings (and their backtraces) are in the run's logs/.
    assert "Traceback" not in console and "DistNetworkError" not in console and "TCPStore" not in console, console
    assert not re.search(r"frame #\d+:|\.cpp:\d+", console), console
    warned = (run / "logs" / "supervisor_node1.stderr").read_text()
    assert warned.count("[c10d]") == 1, warned  # once the store failed, the supervisor used it no more
    _assert_nobody_left(str(tmp_path), agents)
    # resume=auto picks the step node 1's worker finished last: every unit had an owner there.
    step = int(kept.group(1))
    assert last_before <= step <= last_before + 1 and kept.group(2) == str(survivors.fragment_dir(run, step, 1))
    done = survivors.assemble(run, _expected(run, step, 1), None)
    assert done is not None and done.checkpoint is not None and done.checkpoint.name == f"step_{step:08d}", done
    assert done.message.startswith(f"recovered step {step} from the surviving owners (ranks [1]; lost: [0])"), done

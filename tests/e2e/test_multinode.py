"""Several torchrun agents as the nodes of one job, on this machine, sharing one run directory.

Each "node" is a real torchrun agent started by the command ``subnetdp launch`` prints for it,
meeting the others at a c10d rendezvous on a port found free at run time. A fixed 2-node job, each
node started by ``subnetdp launch``, restarts both nodes' workers after one is killed and runs to the
end (one job for both properties: a 2-node job costs four processes that import torch); an elastic job (``--nnodes 1:2``) loses a node
to SIGKILL and finishes at the smaller world; a node that joins a running elastic job makes the
running worker stop at a step boundary with a checkpoint, and the larger world resumes from exactly
that step. Every path ends with no process of the job left and no traceback on any console.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from subnetdp.launchers.command import launch_command
from subnetdp.launchers.nodes import Nodes
from subnetdp.plugins.comm._rendezvous import free_port
from subnetdp.train.checkpoints import files as ck

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and uses prctl")

ARGS = ["resnet18_digits", "optim.warmup_steps=0", "train.batch_size=8", "train.log_every=2", "train.progress=false",
        "eval.bn_recalibrate_batches=2", "eval.every=0", "launch.threads_per_rank=1", "checkpoint.keep=1",
        "resume=auto"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# Quick rendezvous rounds for a test: close a round 2 s after its fewest nodes arrived, and call a
# node dead after 3 missed heartbeats of 1 s (torch's defaults: 30 s and 15 s).
RDZV = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


class Agent:
    """One node: a torchrun agent in a process group of its own, its console written to files."""

    def __init__(self, cmd: list[str], out: Path, env: dict[str, str] | None = None) -> None:
        self.out, self.cmd = out, cmd
        self._stdout, self._stderr = open(f"{out}.out", "w"), open(f"{out}.err", "w")
        self.proc = subprocess.Popen(cmd, stdout=self._stdout, stderr=self._stderr, env=env or ENV,
                                     start_new_session=True)

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._stdout.close()
            self._stderr.close()

    @property
    def console(self) -> str:
        return Path(f"{self.out}.out").read_text() + Path(f"{self.out}.err").read_text()

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _job_processes(marker: str) -> list[str]:
    """Live processes whose command line names ``marker`` (the test's run directory)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(f"{d.name}: {cmd[:160]}")
    return found


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    kids = []
    for d in Path("/proc").iterdir():
        try:
            ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if d.name.isdigit() and int(ppid) == pid:
            kids.append(int(d.name))
    return kids


def _assert_nobody_left(marker: str, agents: list[Agent]) -> None:
    deadline = time.monotonic() + 20
    while _job_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _job_processes(marker) == []
    for a in agents:
        with pytest.raises(ProcessLookupError):
            os.killpg(a.proc.pid, 0)  # the agent's process group is gone


@pytest.fixture
def agents(tmp_path):
    """The agents a test starts; whatever a failing test leaves is killed."""
    started: list[Agent] = []
    yield started
    for a in started:
        a.kill_group()
        if a.proc.poll() is None:
            a.wait(30)


def _node(agents: list[Agent], tmp: Path, nodes: Nodes, rank: int, *extra: str, env: dict | None = None) -> Agent:
    cmd = launch_command("torchrun", 1, [*ARGS, f"run.dir={tmp}", "run.name=job", *extra], nodes=nodes, node_rank=rank)
    agent = Agent(cmd, tmp / f"node{rank}", env)
    agents.append(agent)
    return agent


def _wait_for(what: str, ok, timeout: float = 180, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def _checkpoint_ranks(run: Path) -> int:
    """The world size of the newest complete checkpoint (0: none yet)."""
    latest = ck.latest_checkpoint(run)
    return 0 if latest is None else len(list(latest.glob("rank_*.state.pt")))


def _agent_logs(run: Path) -> str:
    """What the torchrun agents of the job logged (``RUN_DIR/logs/agent_<host>_<pid>.log``)."""
    return "".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("agent_*.log")))


def _first_step_after(run: Path, moment: float, resumed: int) -> float:
    """Seconds from ``moment`` to the end of rank 0's first step after the resumed one."""
    acc = EventAccumulator(str(run / "tensorboard" / "rank_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return min(e.wall_time for e in acc.Scalars("rank/loss") if e.step == resumed + 1) - moment


def test_elastic_job_loses_a_node_and_finishes_at_the_smaller_world(tmp_path, agents):
    nodes = Nodes(1, 2, f"127.0.0.1:{free_port()}", "job", max_restarts=1, rdzv_conf=RDZV)
    extra = ["train.steps=16", "checkpoint.every=2", "masker.coverage=1"]  # full replicas: any world works
    host = _node(agents, tmp_path, nodes, 0, *extra)
    lost = _node(agents, tmp_path, nodes, 1, *extra)
    run = tmp_path / "job"
    _wait_for("a checkpoint of the 2-node world", lambda: _checkpoint_ranks(run) == 2)
    killed_after = ck.latest_checkpoint(run)
    lost.kill_group()  # the node vanishes: its agent by SIGKILL, its workers with it
    killed_at = time.time()
    assert host.wait() == 0, host.console[-5000:]
    lost.wait()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 16
    resumed = re.search(r"resumed from (\S+) \(step (\d+)\) on a new plan", host.console)
    assert resumed, host.console[-5000:]
    assert int(resumed.group(2)) >= int(killed_after.name.split("_")[1])
    seconds = _first_step_after(run, killed_at, int(resumed.group(2)))
    print(f"\nSIGKILL of node 1 -> first step of the 1-node world done: {seconds:.1f} s")
    assert "Traceback" not in host.console, host.console[-5000:]
    _assert_nobody_left(str(tmp_path), agents)


def test_a_node_that_joins_makes_the_job_stop_at_a_step_and_resume_it_on_the_larger_world(tmp_path, agents):
    nodes = Nodes(1, 2, f"127.0.0.1:{free_port()}", "job", rdzv_conf=RDZV)
    extra = ["train.steps=12", "checkpoint.every=6", "masker.coverage=1"]
    first = _node(agents, tmp_path, nodes, 0, *extra)
    run = tmp_path / "job"
    metrics = run / "metrics.jsonl"
    _wait_for("the 1-node world's first steps", lambda: metrics.is_file() and '"step"' in metrics.read_text())
    # Pause the running worker, so that the join lands mid-run however fast this machine trains; it
    # goes on once its agent has sent it the signal that a node joined.
    (worker,) = _children(first.proc.pid)
    os.kill(worker, signal.SIGSTOP)
    joined_at = time.time()
    second = _node(agents, tmp_path, nodes, 1, *extra)
    # The agent's own log records are in the run's logs/ (its console keeps subnetdp's lines).
    _wait_for("the agent's signal to its worker", lambda: "closing signal SIGTERM" in _agent_logs(run))
    os.kill(worker, signal.SIGCONT)
    assert first.wait() == 0, first.console[-5000:]
    assert second.wait() == 0, second.console[-5000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    # The running worker got SIGTERM from its agent, finished its step, saved it, and the 2-node
    # world resumed from that very step: no step trained twice, none lost.
    stopped = re.search(r"stopped by SIGTERM \(rank 0\) after step (\d+): checkpoint", first.console)
    assert stopped, first.console[-5000:]
    resumed = re.search(r"resumed from (\S+) \(step (\d+)\) on a new plan", first.console + second.console)
    assert resumed and resumed.group(2) == stopped.group(1), first.console[-5000:]
    seconds = _first_step_after(run, joined_at, int(resumed.group(2)))
    print(f"\nnode 1 started -> first step of the 2-node world done: {seconds:.1f} s")
    for a in agents:
        assert "Traceback" not in a.console, a.console[-5000:]
    _assert_nobody_left(str(tmp_path), agents)


def test_two_agents_run_one_job_restart_a_killed_worker_with_quiet_consoles_and_every_node_says_it_goes_on(
        tmp_path, agents):
    # A fixed 2-node job, each node started by `subnetdp launch` as on two machines (its torchrun agent,
    # one worker), with a restart: node 1's worker is SIGKILLed after step 3 and both agents restart
    # their workers. The job runs to the end in one run directory; the consoles carry subnetdp's lines
    # only (torch's C++ store and gloo warnings and the elastic agent's own log lines go to the run's
    # logs/), each line is timestamped, and both nodes say when the job goes on.
    port = free_port()
    env = {**ENV, ck.KILL_AT_STEP: "3"}
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "subnetdp", "launch", "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank),
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", RDZV, "--max-restarts", "1", *ARGS,
               f"run.dir={tmp_path}", "run.name=job", "train.steps=6", "checkpoint.every=2", "masker.coverage=0.5",
               "masker.min_owners=1"]
        agents.append(Agent(cmd, tmp_path / f"node{rank}", env))
    for a in agents:
        assert a.wait() == 0, a.console[-5000:]
    assert "# node 0, the host of 127.0.0.1:" in agents[0].console and "# node 1:" in agents[1].console
    run = tmp_path / "job"
    assert ck.fault_marker(run, ck.KILL_AT_STEP, 3, 1).exists()  # the SIGKILL happened
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert all(r["params_held"] < summary["full_model_params"] for r in summary["ranks"])  # SDP across nodes
    # One run directory, written as on a cluster: per-rank files of both nodes' ranks, one lock.
    final = ck.step_dir(run, 6)
    assert sorted(p.name for p in final.glob("rank_*.state.pt")) == ["rank_0.state.pt", "rank_1.state.pt"]
    assert {p.name for p in (run / "tensorboard").iterdir() if p.is_dir()} == {"rank_0", "rank_1"}
    assert [p.name for p in run.glob(".lock*")] == [".lock"]
    said = []  # the node (torchrun's GROUP_RANK) each console's line names
    for a in agents:
        console = a.console
        assert "Traceback" not in console, console[-5000:]
        # No C++ backtrace or glog-style line (TCPStore.cpp ... sendBytes failed, "frame #3: ...").
        assert not re.search(r"Exception raised from|frame #\d+:|\.cpp:\d+|^[EWI]\d{4} ", console, re.MULTILINE), console
        goes_on = [ln for ln in console.splitlines() if "the job goes on" in ln]
        assert len(goes_on) == 1, console[-5000:]
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d subnetdp: node \d: the job goes on after restart 1 of 1: "
                        r"2 ranks, from step \d", goes_on[0]), goes_on[0]
        said.append(goes_on[0].split("subnetdp: node ", 1)[1][0])
    # Both nodes say so. The restarted rendezvous numbers the nodes itself (c10d orders the agents by
    # their host name and process id, not by --node-rank), so which console names which node is torch's.
    assert sorted(said) == ["0", "1"], said
    _assert_nobody_left(str(tmp_path), agents)

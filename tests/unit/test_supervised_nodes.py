"""Going on in-process over several nodes: what is refused in one line, and how a lost node is found.

The refusals are checked where the command makes them, before any worker, store or process group
exists. The liveness watch runs on a real ``TCPStore`` served in this process (no process group).
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from subnetdp.core.config import Settings, compose
from subnetdp.core.errors import ConfigError
from subnetdp.core.plugins import PluginManager
from subnetdp.launchers.liveness import Liveness
from subnetdp.launchers.supervisor import DEAD_KEY, SUPERVISED_ENV, check_supervised
from subnetdp.train.command import _start_local_workers, launch_command

NODES = ["launch.nproc=2", "launch.nodes=2", "run.name=job"]


@pytest.mark.parametrize("extra, line", [
    ([], r"launch.nodes=2: with subnetdp train .* only serves launch.on_failure=continue .*add launch.on_failure=continue"),
    (["launch.on_failure=continue"], r"launch.rdzv_endpoint='': .*set launch.rdzv_endpoint=HOST:PORT"),
    (["launch.on_failure=continue", "launch.rdzv_endpoint=127.0.0.1:29500", "launch.node_rank=2"],
     r"launch.node_rank=2: is outside launch.nodes=2"),
    (["launch.on_failure=continue", "launch.rdzv_endpoint=127.0.0.1:29500", "launch.min_nodes=1", "resume=auto"],
     r"launch.min_nodes=1: makes an elastic job"),
    (["launch.on_failure=continue", "launch.rdzv_endpoint=127.0.0.1:29500", "launch.replace=1"],
     r"launch.replace=1: replaces dead workers on one node only"),
    (["launch.on_failure=continue", "launch.rdzv_endpoint=127.0.0.1:29500", "launch.max_restarts=1", "resume=auto"],
     r"launch.on_failure='continue': restarts nobody .*launch.max_restarts=1"),
    # NCCL's re-formation is not built (it needs 2 GPUs or more): refused as a config, on any machine.
    (["launch.on_failure=continue", "launch.rdzv_endpoint=127.0.0.1:29500", "comm.name=nccl"],
     r"launch.on_failure='continue': restarts nobody and re-forms gloo groups.*comm.name=nccl"),
])
def test_a_supervised_job_over_nodes_that_cannot_work_is_refused_in_one_line(extra, line, tmp_path):
    overrides = [*NODES, f"run.dir={tmp_path}", *extra]
    cfg = compose("resnet18_digits", overrides)
    with pytest.raises(ConfigError, match=line) as e:
        _start_local_workers(cfg, Settings.from_config(cfg), "resnet18_digits", overrides, PluginManager())
    assert "\n" not in str(e.value)
    assert not (tmp_path / "job").exists()  # nothing written, no lock taken


def test_going_on_in_process_under_torchrun_or_mpirun_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv(SUPERVISED_ENV, raising=False)
    for launcher in ("torchrun", "mpirun"):
        with pytest.raises(ConfigError, match=rf"launch.on_failure='continue': .*but {launcher} starts them "
                                              r".*launch.nodes=N launch.node_rank=R"):
            launch_command("resnet18_digits", [f"run.dir={tmp_path}", "launch.on_failure=continue"], launcher, 2,
                           dry_run=True)
    check_supervised("restart", "torchrun")  # the restart path is the launchers' own
    monkeypatch.setenv(SUPERVISED_ENV, "1")
    check_supervised("continue", "torchrun")  # the supervisor's own workers look like torchrun's


def test_a_silent_node_has_its_workers_marked_dead_and_one_that_ended_does_not():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    workers_of = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    here = Liveness(store, 0, workers_of, DEAD_KEY, silence_s=0.2)
    node1 = Liveness(store, 1, workers_of, DEAD_KEY, silence_s=0.2)
    node2 = Liveness(store, 2, workers_of, DEAD_KEY, silence_s=0.2)
    assert here.tick() == []  # nobody else has beaten yet: not arrived, never lost
    node1.tick(), node2.tick()
    here.tick()
    node2.done()  # node 2 ends normally; node 1 goes silent
    lost: list[int] = []
    for _ in range(40):
        lost += here.tick()
        if lost:
            break
        __import__("time").sleep(0.02)
    assert lost == [1] and here.lost == [1]
    assert all(store.check([f"{DEAD_KEY}/{w}"]) for w in (2, 3))
    assert not any(store.check([f"{DEAD_KEY}/{w}"]) for w in (0, 1, 4, 5))
    assert store.get(f"{DEAD_KEY}/2").decode().startswith("node 1 lost (no beat for")
    assert here.pending() == []  # node 0 waits for nobody: node 1 lost, node 2 ended

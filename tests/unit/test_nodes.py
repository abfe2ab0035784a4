"""A job over several nodes: the launch.* keys, their checks, and the command of each node."""

from __future__ import annotations

import argparse
import sys

import pytest

from subnetdp.core.errors import ConfigError
from subnetdp.launchers.command import launch_command, node_lines
from subnetdp.launchers.nodes import Nodes, add_node_arguments, node_overrides, nodes_of, parse_nnodes
from tests.helpers import small_config


def test_nnodes_reads_a_fixed_or_an_elastic_count():
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "3:2", "two", "1-4"):
        with pytest.raises(ConfigError, match="--nnodes"):
            parse_nnodes(bad)


def test_node_options_are_launch_keys():
    parser = argparse.ArgumentParser()
    add_node_arguments(parser)
    ns = parser.parse_args(["--nnodes", "1:3", "--rdzv-endpoint", "head:29500", "--max-restarts", "2"])
    assert node_overrides(ns) == ["launch.nodes=3", "launch.min_nodes=1", "launch.max_restarts=2",
                                  "launch.rdzv_endpoint=head:29500"]
    cfg = small_config(*node_overrides(ns), "run.name=job", "resume=auto", "checkpoint.enabled=true")
    nodes = nodes_of(cfg, "torchrun")
    assert (nodes.spec, nodes.run_id, nodes.max_restarts) == ("1:3", "subnetdp-job", 2)
    assert nodes.worlds(2) == [2, 4, 6]


@pytest.mark.parametrize("overrides, key", [
    (["launch.nodes=0"], "launch.nodes"),
    (["launch.nodes=2", "launch.min_nodes=3", "run.name=j"], "launch.min_nodes"),
    (["launch.nodes=2", "launch.min_nodes=1", "run.name=j"], "resume"),  # an elastic job must resume
    (["launch.max_restarts=1"], "resume"),
    (["launch.max_restarts=-1"], "launch.max_restarts"),
    (["launch.nodes=2"], "run.name"),  # every node must name the same run directory
    (["launch.rdzv_endpoint=head"], "launch.rdzv_endpoint"),
    (["launch.rdzv_endpoint=head:99999"], "launch.rdzv_endpoint"),
])
def test_a_job_shape_that_cannot_work_is_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        small_config(*overrides)
    assert str(e.value).startswith(f"{key}=")


def test_a_multi_node_job_needs_an_endpoint_under_torchrun_and_no_elasticity_under_srun():
    cfg = small_config("launch.nodes=2", "launch.min_nodes=1", "run.name=j", "resume=auto", "checkpoint.enabled=true")
    with pytest.raises(ConfigError, match="launch.rdzv_endpoint"):
        nodes_of(cfg, "torchrun")
    with pytest.raises(ConfigError, match="launch.min_nodes=1: an elastic job needs torchrun"):
        nodes_of(cfg, "srun")
    with pytest.raises(ConfigError, match="launch.nodes=2: is for torchrun and srun"):
        nodes_of(cfg, "mpirun")
    with pytest.raises(ConfigError, match="--node-rank"):
        nodes_of(small_config("launch.nodes=2", "run.name=j", "launch.rdzv_endpoint=h:1"), "torchrun", 2)


def test_each_node_gets_torchruns_rendezvous_options():
    nodes = Nodes(1, 2, "head:29500", "job", node_rank=0, max_restarts=3, rdzv_conf="last_call_timeout=5")
    cmd = launch_command("torchrun", 4, ["r", "a=b"], nodes=nodes)
    assert cmd[:3] == [sys.executable, "-m", "subnetdp.launchers.torchrun"]
    assert cmd[3:11] == ["--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29500",
                         "--rdzv-id=job", "--rdzv-conf=last_call_timeout=5,is_host=1", "--max-restarts=3", "-m"]
    lines = node_lines("torchrun", 4, ["r"], [], nodes)
    assert lines[0].startswith("# node 0, the host of head:29500") and "is_host=1" in lines[1]
    assert lines[2] == "# node 1:" and "is_host=0" in lines[3]
    anywhere = node_lines("torchrun", 4, ["r"], [], Nodes(2, 2, "head:29500", "job"))
    assert len(anywhere) == 2 and "is_host" not in anywhere[1]  # torchrun tells the host by its name
    srun = launch_command("srun", 4, ["r"], nodes=Nodes(2, 2))
    assert srun[1:4] == ["--nodes=2", "--ntasks=8", "--ntasks-per-node=4"]


def test_the_thread_warning_counts_the_nodes_own_ranks(monkeypatch):
    import os
    import warnings

    from subnetdp.core.config import warn_threads

    cores = os.cpu_count() or 1
    cfg = small_config(f"launch.threads_per_rank={cores}")
    cfg.launch.nproc = 2  # the recipe's count, or all ranks of a multi-node job
    with pytest.warns(UserWarning, match="launch.nproc=2"):
        warn_threads(cfg)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun: this node runs one rank
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_threads(cfg)

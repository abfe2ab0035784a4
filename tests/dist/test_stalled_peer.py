"""A stalled peer in an owner group: named by the ranks that time out, within comm.timeout_s."""

from __future__ import annotations

import time

import torch
from omegaconf import OmegaConf

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import SubnetdpError
from subnetdp.plugins.comm.gloo import GlooCommunicator
from tests.helpers import run_ranks


def _worker(rank: int, world: int, init_method: str) -> dict:
    cfg = OmegaConf.create({"name": "gloo", "init_method": init_method, "timeout_s": 2.0})
    comm = GlooCommunicator(cfg, LaunchEnv(rank, world, rank, world, "test"))
    comm.init()
    comm.new_group((0, 1))  # every rank, member or not
    out: dict = {}
    if rank == 0:
        t0 = time.monotonic()
        try:
            comm.all_reduce(torch.ones(4), (0, 1), async_op=True).wait()
        except SubnetdpError as e:
            out = {"error": str(e), "seconds": time.monotonic() - t0}
    elif rank == 1:
        time.sleep(7)  # stops answering: never enters the owner group's all-reduce
    comm.shutdown()
    return out


def test_stalled_peer_is_named_and_owner_groups_time_out_after_comm_timeout_s(tmp_path):
    result = run_ranks(_worker, 3, tmp_path, timeout=120)[0]
    assert "error" in result, "rank 0's all-reduce over (0, 1) did not time out"
    assert result["error"].startswith("rank 1 stopped answering: rank 0 timed out after comm.timeout_s=2 s "
                                      "waiting in all_reduce over ranks (0, 1)"), result["error"]
    # 2 s of timeout plus the grace for the other members to report: far below torch's 30-minute default.
    assert result["seconds"] < 10, result

"""Checks of the ``mpi`` communicator that need a real MPI world; run by tests/e2e/test_mpirun.py as

    mpirun -n 3 python -m mpi4py tests/e2e/mpi_groups_check.py RUN_DIR

(``python -m mpi4py`` aborts every rank when one raises, so a failed assertion ends the job with a
non-zero status instead of a hang). Prints ``rank R: ok`` per rank when everything holds.
"""

from __future__ import annotations

import hashlib
import sys

import torch
from omegaconf import OmegaConf

from subnetdp.train.loop import train
from subnetdp.train.meter import tensor_digest
from subnetdp.launchers import detect
from subnetdp.plugins.comm.mpi import MpiCommunicator
from tests.helpers import plugin_manager, small_config

PAIRS = [(0, 1), (0, 2), (1, 2)]


def check_collectives(comm: MpiCommunicator) -> None:
    rank, world = comm.rank, comm.world
    for g in PAIRS:
        comm.new_group(g)  # collective: every rank, same order, members or not
    # One "unit" per pair: each rank starts from its own values; all reduces are in flight at once,
    # on different sub-communicators, as the synchroniser issues them.
    units = {g: torch.arange(6, dtype=torch.float32) * 10 + rank + 1 for g in PAIRS}
    handles = [comm.all_reduce(units[g], g, async_op=True) for g in PAIRS if rank in g]
    for h in handles:
        h.wait()
    for g in PAIRS:
        start = {r: torch.arange(6, dtype=torch.float32) * 10 + r + 1 for r in world}
        if rank in g:
            expect = (start[g[0]] + start[g[1]]) / 2
            assert torch.equal(units[g] / 2, expect), (rank, g, units[g])
        else:  # a rank outside the owner set never changes that unit
            assert torch.equal(units[g], start[rank]), (rank, g, units[g])
    # bf16 and fp16 are reduced in fp32 (MPICH has no bf16 sum): 3 ranks of r + 0.5 sum to 4.5.
    for dtype in (torch.bfloat16, torch.float16):
        t = torch.full((1000,), rank + 0.5, dtype=dtype)
        comm.all_reduce(t, world).wait()
        assert t.dtype == dtype and torch.equal(t, torch.full((1000,), 4.5, dtype=dtype)), (dtype, t[:4])
    # A transposed bf16 tensor (dense, not contiguous) is widened into a contiguous fp32 copy and back.
    tb = torch.full((3, 5), rank + 0.25, dtype=torch.bfloat16).t()
    comm.all_reduce(tb, world)
    assert torch.equal(tb, torch.full((5, 3), 3.75, dtype=torch.bfloat16)), tb
    # A non-contiguous view is reduced through a copy and written back; its neighbours stay.
    m = torch.full((4, 6), float(rank))
    comm.all_reduce(m[:, ::2], world, async_op=True).wait()
    assert torch.equal(m[:, ::2], torch.full((4, 3), 3.0)) and torch.equal(m[:, 1::2], torch.full((4, 3), float(rank)))
    # The CPU path hands MPI a view of the tensor itself: the result lands in the same storage.
    ints = torch.tensor([rank, 1], dtype=torch.int64)
    ptr = ints.data_ptr()
    comm.all_reduce(ints, world)
    assert ints.tolist() == [3, 3] and ints.data_ptr() == ptr
    # Broadcast inside a sub-group from its higher rank, bf16 bit-exact; rank 0 is outside (1, 2).
    b = torch.full((7,), 1.0 + rank / 128, dtype=torch.bfloat16)
    if rank in (1, 2):
        comm.broadcast(b, src=2, group=(1, 2))
    expect = 1.0 + (2 if rank in (1, 2) else rank) / 128
    assert torch.equal(b, torch.full((7,), expect, dtype=torch.bfloat16)), (rank, b)
    assert comm.all_gather_object({"r": rank}) == [{"r": r} for r in world]
    # Bytes handed to each group's collectives are counted per group.
    assert comm.bytes.by_group[(0, 1) if rank < 2 else (1, 2)] >= 6 * 4
    comm.barrier()


def check_training(run_dir: str) -> None:
    """The whole loop over mpi at world size 3: owners of a unit end bit-identical, others never hold it."""
    env = detect()
    cfg = small_config("comm.name=mpi", "train.steps=3", "train.batch_size=8", "eval.batches=1",
                       "masker.coverage=0.5", f"run.dir={run_dir}", "run.name=w3", "model.variant=resnet18")
    run = train(cfg, env, plugin_manager())
    rank = env.rank
    local = dict(run.state.model.named_parameters())
    digests = {}
    for u in run.state.plan.owned[rank]:
        h = hashlib.sha256()
        for s in run.state.partition.units[u].slices:
            local_name = next(n for n, ps in run.state.pmap.pieces.items() if ps[0].global_name == s.name)
            h.update(local[local_name].detach().numpy().tobytes())
        digests[u] = h.hexdigest()
    # A fresh communicator: the run's was shut down (its sub-communicators freed) when training ended.
    comm = MpiCommunicator(OmegaConf.structured(MpiCommunicator.Config(name="mpi")), env)
    comm.init()
    everyone = comm.all_gather_object(digests)
    for u in range(run.state.plan.num_units):
        owners = run.state.plan.owners(u)
        assert {everyone[r][u] for r in owners} == {everyone[owners[0]][u]}, f"owners {owners} of unit {u} differ"
        assert all(u not in everyone[r] for r in range(env.world_size) if r not in owners)
    mine = run.result.summary["ranks"][rank]
    assert mine["params_sha256"] == tensor_digest(run.state.model)
    groups = mine["bytes_by_group"]
    assert "0-1-2" in groups and groups["0-1-2"]["payload_bytes_per_step"] > 0
    pairs = [g for g in groups if g.count("-") == 1]
    assert pairs == (["0-1"] if rank < 2 else []), (rank, groups)  # cyclic at C=0.5: blocks of (0, 1) and (2,)
    for stats in groups.values():
        k = stats["k"]
        assert stats["wire_bytes_per_step_ring"] == 2 * (k - 1) / k * stats["payload_bytes_per_step"]
    comm.shutdown()


def main() -> None:
    env = detect()
    assert env.launcher == "mpirun" and env.world_size == 3, env
    comm = MpiCommunicator(OmegaConf.structured(MpiCommunicator.Config(name="mpi")), env)
    comm.check_environment()
    comm.init()
    check_collectives(comm)
    comm.shutdown()
    check_training(sys.argv[1])
    print(f"rank {env.rank}: ok", flush=True)


if __name__ == "__main__":
    main()

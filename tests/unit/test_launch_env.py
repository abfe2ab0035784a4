"""Launch detection (torchrun, Open MPI, MPICH, srun), `subnetdp launch` commands, clear comm errors."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from subnetdp import cli
from subnetdp.train.configure import load_config
from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import ConfigError, SubnetdpError
from subnetdp.train.meter import bytes_by_group, tensor_digest
from subnetdp.launchers import detect, slurm_tasks_on_node
from subnetdp.launchers.command import launch_command
from subnetdp.plugins.comm._rendezvous import first_slurm_host, rendezvous
from subnetdp.plugins.comm.mpi import MpiCommunicator
from subnetdp.plugins.comm.nccl import NcclCommunicator

OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "9"}
SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "6", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),2", "SLURM_NODEID": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77"}


def test_detect_reads_every_launcher_family():
    assert detect({}) == LaunchEnv()
    assert detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == \
        LaunchEnv(1, 2, 1, 2, "torchrun")
    assert detect(OPENMPI) == LaunchEnv(3, 4, 1, 2, "mpirun")
    assert detect(MPICH) == LaunchEnv(1, 2, 1, 2, "mpirun")
    assert detect(SRUN) == LaunchEnv(5, 6, 1, 2, "srun")
    # A batch script is one process whatever SLURM_NTASKS says: only a job step (srun) is a world.
    batch = {k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")}
    assert detect(batch) == LaunchEnv()
    # torchrun inside an srun step: torchrun's ranks win.
    assert detect({**SRUN, "RANK": "0", "WORLD_SIZE": "1"}).launcher == "torchrun"


@pytest.mark.parametrize("env,words", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, ["RANK=2", "WORLD_SIZE=2", "torchrun"]),
    ({**OPENMPI, "OMPI_COMM_WORLD_RANK": "x"}, ["OMPI_COMM_WORLD_RANK='x'", "not an integer"]),
    ({**MPICH, "MPI_LOCALRANKID": "2"}, ["MPI_LOCALRANKID=2", "MPI_LOCALNRANKS=2", "mpirun"]),
    ({**SRUN, "SLURM_NODEID": "3"}, ["SLURM_NODEID=3", "2(x2),2"]),
])
def test_inconsistent_environments_name_the_variables(env, words):
    with pytest.raises(SubnetdpError) as e:
        detect(env)
    for w in words:
        assert w in str(e.value)


def test_slurm_lists():
    assert [slurm_tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    assert first_slurm_host("gpu[003-004,010],cpu1") == "gpu003"
    assert first_slurm_host("node7") == "node7"


def test_launch_commands_use_this_python_and_its_mpirun(tmp_path):
    py = sys.executable
    args = ["resnet18_digits", "train.steps=3"]
    assert launch_command("torchrun", 2, args) == [py, "-m", "subnetdp.launchers.torchrun", "--standalone",
                                                   "--nproc-per-node=2", "-m", "subnetdp", "train", *args]
    assert launch_command("mpirun", 3, args) == [str(Path(py).parent / "mpirun"), "-n", "3", py, "-m", "subnetdp",
                                                 "train", *args]
    assert launch_command("srun", 4, args, extra=["--gpus-per-task=1"])[1:3] == ["--ntasks=4", "--gpus-per-task=1"]
    with pytest.raises(ConfigError, match=r"--launcher='mpirun'.*does not exist.*subnetdp\[mpi\]"):
        launch_command("mpirun", 2, args, mpirun=str(tmp_path / "no-mpirun"))
    with pytest.raises(ConfigError, match="valid choices: torchrun, mpirun, srun"):
        launch_command("mpiexec", 2, args)


def test_launch_cli_prints_the_command_and_refuses_mpi_under_torchrun(capsys, tmp_path):
    common = ["resnet18_digits", f"run.dir={tmp_path}", "model.variant=resnet18"]
    assert cli.main(["launch", "--launcher", "mpirun", "--nproc", "2", "--dry-run", *common, "comm.name=mpi"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"{Path(sys.executable).parent / 'mpirun'} -n 2 {sys.executable} -m subnetdp train " + " ".join(
        common + ["comm.name=mpi"])
    assert cli.main(["launch", "--nproc", "2", "--dry-run", *common, "comm.name=mpi"]) == 2
    assert "comm.name='mpi': needs the MPI world of mpirun, not torchrun — use --launcher mpirun" in \
        capsys.readouterr().err


def _cfg(cls, **values):
    return OmegaConf.structured(cls.Config(**values))


def test_nccl_refuses_a_machine_without_gpus():
    comm = NcclCommunicator(_cfg(NcclCommunicator, name="nccl"), LaunchEnv())
    assert comm.device == torch.device("cuda", 0)
    if torch.cuda.is_available():  # a GPU machine: the check passes (benchmarks/gpu_check.py runs it)
        comm.check_environment()
        return
    with pytest.raises(ConfigError) as e:
        comm.check_environment()
    assert "comm.name='nccl': needs one CUDA GPU per process" in str(e.value) and "comm.name=gloo" in str(e.value)
    with pytest.raises(ConfigError, match="train.device='cpu': comm.name=nccl computes on cuda:LOCAL_RANK"):
        load_config(None, ["comm.name=nccl", "train.device=cpu"])
    with pytest.raises(ConfigError, match="train.device='cuda': comm.device=cpu holds the tensors — set comm.device=cuda"):
        load_config(None, ["comm.name=mpi", "train.device=cuda"])


def test_mpi_outside_mpirun_names_both_worlds():
    comm = MpiCommunicator(_cfg(MpiCommunicator, name="mpi"), LaunchEnv(0, 2, 0, 2, "torchrun"))
    with pytest.raises(ConfigError, match=r"MPI's world is rank 0 of 1, but the torchrun launch says rank 0 of 2"):
        comm.check_environment()
    with pytest.raises(ConfigError, match="comm.device='gpu': valid choices: cpu, cuda"):
        MpiCommunicator.validate_config(_cfg(MpiCommunicator, name="mpi", device="gpu"), None)


def test_bytes_by_group_and_parameter_digest():
    stats = bytes_by_group({(0, 1, 2, 3): 400, (1, 2): 100, (3,): 0}, steps=2)
    assert list(stats) == ["3", "1-2", "0-1-2-3"]
    assert stats["0-1-2-3"] == {"k": 4, "payload_bytes_per_step": 200.0, "wire_bytes_per_step_ring": 300.0}
    assert stats["1-2"]["wire_bytes_per_step_ring"] == 50.0 and stats["3"]["wire_bytes_per_step_ring"] == 0.0
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert tensor_digest(a) == tensor_digest(b)
    with torch.no_grad():
        b.bias[0] = torch.nextafter(b.bias[0], torch.tensor(1.0))  # one ulp
    assert tensor_digest(a) != tensor_digest(b)
    half = copy.deepcopy(a).to(torch.bfloat16)  # bf16 has no numpy dtype: hashed as bytes
    assert tensor_digest(half) == tensor_digest(copy.deepcopy(half)) != tensor_digest(a)


def test_rendezvous_under_srun_and_a_torchrun_without_master(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[003-004]")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    rendezvous(LaunchEnv(1, 4, 1, 2, "srun"))  # every rank derives the same address and port
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("gpu003", "15077")
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var)
    with pytest.raises(SubnetdpError, match="MASTER_ADDR and MASTER_PORT are not set for a 2-process torchrun"):
        rendezvous(LaunchEnv(0, 2, 0, 2, "torchrun"))


def test_a_launcher_is_one_object_chosen_by_name_and_an_unknown_one_is_one_line():
    from subnetdp.launchers.kinds import LAUNCHERS, launcher_named

    torchrun, srun = launcher_named("torchrun"), launcher_named("srun")
    assert launcher_named("torchrun") is torchrun and list(LAUNCHERS) == ["torchrun", "mpirun", "srun"]
    assert torchrun.workers_descend and torchrun.workers_here  # holds the lock for workers it starts here
    assert not srun.workers_descend and not srun.workers_here  # its workers run on SLURM's nodes
    assert not launcher_named("mpirun").workers_descend
    with pytest.raises(ConfigError) as e:
        launch_command("torchrn", 2, ["resnet18_digits"])
    line = str(e.value)
    assert line.splitlines() == [line] and line.startswith("--launcher='torchrn': unknown launcher; valid choices: "
                                                           "torchrun, mpirun, srun")
    assert "did you mean 'torchrun'" in line

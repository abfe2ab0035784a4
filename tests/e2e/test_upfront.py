"""Bad input is one line and exit code 2 before any worker starts; a finished run is left alone.

Through the real CLI (``subnetdp.cli.main``, in process: no worker is started, which is the point),
then one real process run killed after its final checkpoint and resumed with ``resume=auto``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from subnetdp import cli
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints.checkpointer import final_wanted
from tests.helpers import small_config

TRAIN = ["train", "resnet18_digits", "launch.nproc=2", "train.steps=2", "optim.warmup_steps=0", "train.progress=false"]


def _error(capsys, *args: str) -> str:
    assert cli.main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("subnetdp: error: "), err
    assert "starting" not in err
    return err


def test_bad_input_is_one_line_before_any_worker(capsys, tmp_path):
    assert "run.dir='/proc/x': cannot be written" in _error(capsys, *TRAIN, "run.dir=/proc/x")
    assert "run.dir='README.md': is a file, not a folder" in _error(capsys, *TRAIN, "run.dir=README.md")
    err = _error(capsys, *TRAIN, f"run.dir={tmp_path}", "train.batch_size=2000")
    assert "train.batch_size=2000: too large for 2 rank(s)" in err and "719 samples" in err
    if not torch.cuda.is_available():
        assert "comm.name='nccl': needs one CUDA GPU per process" in _error(capsys, *TRAIN, f"run.dir={tmp_path}",
                                                                            "comm.name=nccl")
    assert "data.root='': is empty" in _error(capsys, *TRAIN, "data.root=")
    assert "foo={'a': 1}: unknown top-level key" in _error(capsys, *TRAIN, "foo={a: 1}")
    assert "checkpoint.final='sometimes': valid choices: auto, always, never" in _error(
        capsys, *TRAIN, "checkpoint.final=sometimes")
    # What the chosen communicator computes on, and who can start it, is known before any worker exists.
    assert _error(capsys, *TRAIN, f"run.dir={tmp_path}", "train.device=cuda") == (
        "subnetdp: error: train.device='cuda': comm.name=gloo computes on cpu — use comm.name=nccl for GPUs "
        "(comm.device=cuda with comm.name=mpi), or train.device=auto")
    assert _error(capsys, *TRAIN, f"run.dir={tmp_path}", "comm.name=mpi") == (
        "subnetdp: error: comm.name='mpi': needs the MPI world of mpirun, not launch.nproc=2, whose workers torch's "
        "elastic launcher starts — start it with subnetdp launch --launcher mpirun --nproc 2 RECIPE [key=value ...], "
        "or use comm.name=gloo")
    if not torch.cuda.is_available():
        assert "comm.device='cuda': computes on a CUDA GPU, but this machine has none visible" in _error(
            capsys, "launch", "--launcher", "mpirun", "--nproc", "2", "--dry-run", "resnet18_digits",
            f"run.dir={tmp_path}", "comm.name=mpi", "comm.device=cuda")
    assert not list(tmp_path.iterdir())  # nothing was created for the refused runs
    # The coverage warning: one formatted line for all groups.
    assert cli.main(["plan", "resnet18_digits", "masker.coverage=0.01", "-n", "2", "--no-estimate"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("subnetdp: warning: masker.coverage=0.01 is not met exactly")
    assert "group layer4" in err[0] and "UserWarning" not in err[0]


def test_final_checkpoint_default_keeps_short_trials_small():
    assert not final_wanted(small_config("train.steps=200"))
    assert final_wanted(small_config("train.steps=1000"))
    assert final_wanted(small_config("train.steps=20", "checkpoint.every=10"))
    assert final_wanted(small_config("train.steps=20", "checkpoint.enabled=true", "checkpoint.final=always"))
    assert not final_wanted(small_config("train.steps=5000", "checkpoint.final=never"))


def test_crash_after_the_final_checkpoint_then_resume_auto(tmp_path):
    """A kill right after the last checkpoint; resume=auto evaluates it, keeps checkpoint.keep, then
    a further resume=auto says the run is finished and touches nothing."""
    args = [sys.executable, "-m", "subnetdp", "train", "resnet18_digits", "comm.name=local", "masker.coverage=1",
            "launch.nproc=1", "train.steps=6", "optim.warmup_steps=0", "train.batch_size=8", "checkpoint.every=2", "checkpoint.keep=2",
            "eval.bn_recalibrate_batches=2", "train.progress=false", "launch.threads_per_rank=1",
            f"run.dir={tmp_path}", "run.name=crash", "resume=auto"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(args, capture_output=True, text=True, timeout=180,
                            env={**env, ck.KILL_AT_STEP: "6", ck.KILL_RANK: "0"})
    run = tmp_path / "crash"
    assert killed.returncode == -9 and not (run / "summary.json").exists(), killed.stderr[-2000:]
    resumed = subprocess.run(args, capture_output=True, text=True, timeout=180, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval"]["accuracy"] > 0
    assert summary["ranks"][0]["peak_memory_bytes"] is None and "not by this one" in summary["note"]
    assert summary["checkpoint"]["path"] == str(ck.step_dir(run, 6)) and summary["checkpoint"]["bytes"] > 0
    assert [p.name for p in ck.complete_checkpoints(run)] == ["step_00000004", "step_00000006"]
    assert "final checkpoint: " in resumed.stdout and "MiB" in resumed.stdout
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    again = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert again.returncode == 0 and "already finished its 6 steps" in again.stdout, again.stderr
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before

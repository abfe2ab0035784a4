"""SLURM as far as this machine allows: the documented batch script, ``subnetdp launch --launcher srun``
and the requeue on the pre-emption notice, with real processes and a real SIGUSR1.

``srun`` and ``scontrol`` are stand-ins on PATH (``fake_slurm/``): srun starts the tasks with a job
step's variables and records its argv, scontrol records its arguments. The batch script
(``examples/slurm/train.sbatch``) runs under bash as sbatch would run it; SIGUSR1 goes to every task,
as ``#SBATCH --signal=USR1@120`` sends it; the ranks checkpoint at a step boundary, rank 0 requeues
the job once, and the script started again (the requeued job, the same SLURM_JOB_ID) resumes there.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from subnetdp.train.checkpoints import files as ck

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
FAKE = Path(__file__).resolve().parent / "fake_slurm"
ARGS = ["optim.warmup_steps=0", "train.batch_size=8", "train.log_every=1", "train.progress=false",
        "eval.bn_recalibrate_batches=2", "eval.every=0", "launch.threads_per_rank=1", "checkpoint.keep=2"]


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_sbatch_script_srun_launch_and_requeue_on_sigusr1(tmp_path):
    log = tmp_path / "slurm.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{FAKE}{os.pathsep}{os.environ['PATH']}",
           "FAKE_SLURM_LOG": str(log), "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2",
           "SUBNETDP": shlex.join([sys.executable, "-m", "subnetdp"]), "RECIPE": "resnet18_digits"}
    job = ["bash", str(SCRIPT), *ARGS, f"run.dir={tmp_path}"]
    proc = subprocess.Popen([*job, "train.steps=400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    run = tmp_path / "job-4242"  # run.name from SLURM_JOB_ID: the requeued job finds it again
    deadline = time.monotonic() + 180
    while not ((run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the job logged no steps: {proc.communicate()}")
        time.sleep(0.2)
    tasks = next(r["tasks"] for r in _records(log) if "tasks" in r)
    for pid in tasks:  # SLURM signals every task of the step, not the batch shell
        os.kill(pid, signal.SIGUSR1)
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 128 + signal.SIGUSR1, err[-3000:]
    assert "Traceback" not in out + err

    # subnetdp launch printed the srun command it ran, and srun got exactly that.
    printed = shlex.split(next(line for line in out.splitlines() if "--ntasks=2" in line))
    assert Path(printed[0]) == FAKE / "srun" and printed[1] == "--ntasks=2"
    assert printed[2:6] == [sys.executable, "-m", "subnetdp", "train"] and "resume=auto" in printed
    assert [r["srun"] for r in _records(log) if "srun" in r] == [printed[1:]]

    # One stop line: every rank stopped after the same step, with a checkpoint, and rank 0 requeued once.
    lines = [ln for ln in err.splitlines() if ln.startswith("subnetdp: stopped by SIGUSR1")]
    assert len(lines) == 1, err[-3000:]
    step = int(re.search(r"after step (\d+)", lines[0]).group(1))
    # The line names the ranks whose signal the step's world reduction carried: both, or the one whose
    # signal arrived before its contribution left (the two kills are not one instant).
    named = re.search(r"SIGUSR1 \(rank ([\d, ]+)\)", lines[0])
    assert named and {int(r) for r in named.group(1).split(", ")} <= {0, 1}, lines[0]
    assert "requeued SLURM job 4242 (scontrol requeue 4242)" in lines[0]
    assert json.loads((ck.step_dir(run, step) / ck.MANIFEST).read_text())["step"] == step
    assert [r["scontrol"] for r in _records(log) if "scontrol" in r] == [["requeue", "4242"]]

    # The requeued job: the same script and SLURM_JOB_ID continue from that checkpoint to the end.
    again = subprocess.run([*job, f"train.steps={step + 1}"], capture_output=True, text=True, env=env, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ck.step_dir(run, step)} (step {step})" in again.stdout
    assert json.loads((run / "summary.json").read_text())["steps"] == step + 1
    assert len([r for r in _records(log) if "scontrol" in r]) == 1  # a job that ends is not requeued

"""The Kubeflow Trainer example (``examples/k8s/trainjob.yaml``) runs: its command, with the PET_*
variables the torch-distributed runtime sets (one node of 2 processes here) and a few steps added,
is a real torchrun job that trains to the end with the example's run name and coverage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from subnetdp.plugins.comm._rendezvous import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "k8s" / "trainjob.yaml"


def test_trainjob_command_runs_under_the_runtimes_torchrun_variables(tmp_path):
    job = yaml.safe_load(EXAMPLE.read_text())
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    command = trainer["command"]
    assert command[:4] == ["torchrun", "-m", "subnetdp", "train"] and "resume=auto" in command
    # The runtime's variables for node 0 of one node (the example's numProcPerNode scaled to 2 cores).
    pet = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1",
           "PET_MASTER_PORT": str(free_port())}
    env = {**os.environ, **{e["name"]: e["value"] for e in trainer["env"]}, **pet}
    run_dir = [f"run.dir={tmp_path}" if a.startswith("run.dir=") else a for a in command[1:]]
    tiny = ["train.steps=2", "optim.warmup_steps=0", "train.batch_size=8", "train.log_every=1", "train.progress=false", "eval.every=0",
            "eval.bn_recalibrate_batches=2", "launch.threads_per_rank=1"]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    done = subprocess.run([torchrun, *run_dir, *tiny], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    name = next(a.split("=", 1)[1] for a in command if a.startswith("run.name="))
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    coverage = float(next(a.split("=", 1)[1] for a in command if a.startswith("masker.coverage=")))
    assert all(r["params_held"] < summary["full_model_params"] for r in summary["ranks"]) == (coverage < 1)

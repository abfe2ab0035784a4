"""End to end through the real mpirun (MPICH from its wheel, in the venv) and torchrun.

The same recipe and seed under three launch modes — ``mpi`` under mpirun, ``gloo`` under mpirun
(rank 0 broadcasts a free port over MPI) and ``gloo`` under torchrun — must end with bit-identical
parameters on every rank: the framework sets torch's thread count from the launcher's local world
size, and a 2-rank sum is the same on every backend.
"""

from __future__ import annotations

import re

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PY = sys.executable
MPIRUN = str(Path(PY).parent / "mpirun")
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ["resnet18_digits", "train.steps=6", "optim.warmup_steps=0", "train.batch_size=8", "train.log_every=3", "train.progress=false",
          "eval.bn_recalibrate_batches=0", "eval.batches=1", "masker.coverage=0.5"]


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train/loss"] for line in lines if "train/loss" in line]


def test_mpi_and_gloo_under_mpirun_and_torchrun_end_bit_identical(tmp_path):
    # mpi under mpirun, through `subnetdp launch` (which prints the exact command it runs).
    launched = _run([PY, "-m", "subnetdp", "launch", "--launcher", "mpirun", "--nproc", "2", *RECIPE,
                     "comm.name=mpi", f"run.dir={tmp_path}", "run.name=mpi"])
    assert launched.stdout.splitlines()[0].startswith(f"{MPIRUN} -n 2 {PY} -m subnetdp train resnet18_digits")
    # gloo under the same mpirun, started by hand as a user would.
    _run([MPIRUN, "-n", "2", PY, "-m", "subnetdp", "train", *RECIPE, "comm.name=gloo", f"run.dir={tmp_path}",
          "run.name=gloo-mpirun"])
    # gloo under torchrun, through `subnetdp launch`.
    launched = _run([PY, "-m", "subnetdp", "launch", "--launcher", "torchrun", "--nproc", "2", *RECIPE,
                     "comm.name=gloo", f"run.dir={tmp_path}", "run.name=gloo-torchrun"])
    assert "-m subnetdp.launchers.torchrun --standalone --nproc-per-node=2 -m subnetdp train" in launched.stdout

    runs = {name: json.loads((tmp_path / name / "summary.json").read_text())
            for name in ("mpi", "gloo-mpirun", "gloo-torchrun")}
    ref = runs["gloo-torchrun"]
    assert ref["world_size"] == 2 and ref["steps"] == 6 and ref["eval"]
    hashes = [r["params_sha256"] for r in ref["ranks"]]
    assert len(set(hashes)) == 2  # the two ranks hold different subnetworks at C = 0.5
    for name, s in runs.items():
        assert [r["params_sha256"] for r in s["ranks"]] == hashes, name
        assert s["eval"] == ref["eval"], name
        assert _losses(tmp_path / name) == _losses(tmp_path / "gloo-torchrun"), name
        # Bytes per owner group: with 2 ranks at C = 0.5 every block has one owner, so only the
        # shared tensors travel, over the world group; ring estimate = 2 (k-1)/k x payload = payload.
        for r in s["ranks"]:
            groups = r["bytes_by_group"]
            assert list(groups) == ["0-1"], (name, groups)
            world = groups["0-1"]
            assert world["payload_bytes_per_step"] == r["bytes_sent_per_step"] > 0
            assert world["wire_bytes_per_step_ring"] == world["payload_bytes_per_step"]
            assert world == ref["ranks"][r["rank"]]["bytes_by_group"]["0-1"]

    # TensorBoard: per rank, one curve per owner group.
    for r in range(2):
        acc = EventAccumulator(str(tmp_path / "mpi" / "tensorboard" / f"rank_{r}"), size_guidance={"scalars": 0})
        acc.Reload()
        series = acc.Scalars("rank/bytes_by_group/0-1")
        assert [e.step for e in series] == [3, 6]
        assert series[-1].value == runs["mpi"]["ranks"][r]["bytes_by_group"]["0-1"]["payload_bytes_per_step"]


def test_mpi_sub_communicators_average_only_inside_owner_sets(tmp_path):
    """3 ranks under mpirun: collectives per owner set, bf16 in fp32, and a whole 3-rank SDP run."""
    proc = _run([MPIRUN, "-n", "3", PY, "-m", "mpi4py", str(ROOT / "tests" / "e2e" / "mpi_groups_check.py"),
                 str(tmp_path)])
    # The ranks' lines can interleave in mpirun's output: find the marks, not whole lines.
    assert sorted(re.findall(r"rank \d+: ok", proc.stdout)) == ["rank 0: ok", "rank 1: ok", "rank 2: ok"]


def test_world_of_four_with_two_arrivals_times_out_naming_expected_and_arrived(tmp_path):
    """torchrun's variables promise 4 processes; only 2 start: both stop after comm.timeout_s, not a hang."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [PY, "-m", "subnetdp", "train", "comm.timeout_s=3", "train.steps=1", "train.progress=false",
             "model.variant=resnet18", f"run.dir={tmp_path}"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2, err[-3000:]
        errs.append(err.strip().splitlines()[-1])
    assert errs[0].startswith(f"subnetdp: error: comm.name=gloo: only 2 of 4 processes arrived at 127.0.0.1:{port} "
                              "within comm.timeout_s=3 s"), errs[0]
    assert errs[1].startswith("subnetdp: error: comm.name=gloo: rank 1 of 4 could not meet the others"), errs[1]
    assert all("raise comm.timeout_s" in e for e in errs)

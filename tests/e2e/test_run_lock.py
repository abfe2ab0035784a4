"""One job per run directory, and one run per run directory: real jobs on one run directory.

A launcher (``subnetdp train launch.nproc=2``, a real process with 2 gloo workers) takes the lock
before it starts any worker and hands it to its workers' rank 0, so a second job stops at once,
before it starts anything. The holder is then SIGKILLed, which takes its workers along. After that, a
new run under the same name is refused (it would mix its metrics with the old run's) unless
``run.overwrite=true`` deletes the old run first.
The refused jobs run in this process, through the command line's own entry point (a refused job
starts nothing, which is the point, and saves a Python start each); the run that overwrites is a
real process again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from subnetdp import cli
from subnetdp.train.runlock import LOCK_FILE
from tests.helpers import gone_within, training_workers

PY = [sys.executable, "-m", "subnetdp", "train", "resnet18_digits", "masker.coverage=1",
      "train.batch_size=8", "optim.warmup_steps=0", "launch.threads_per_rank=1", "train.progress=false",
      "eval.bn_recalibrate_batches=0", "checkpoint.enabled=false", "train.log_every=1", "run.name=busy"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _job(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PY, f"run.dir={tmp}", *extra], capture_output=True, text=True, env=ENV, timeout=300)


def _refused(capsys, tmp: Path, *extra: str) -> str:
    """The one error line of a job that stopped before it started anything."""
    assert cli.main([*PY[3:], f"run.dir={tmp}", *extra]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("subnetdp: error: "), lines
    assert "starting 2 local workers" not in out
    return lines[0]


def test_the_launcher_holds_the_lock_before_its_workers_a_second_job_stops_at_once_and_a_sigkill_takes_them_along(
        tmp_path, capsys):
    holder = subprocess.Popen([*PY, f"run.dir={tmp_path}", "train.steps=100000", "launch.nproc=2", "comm.name=gloo"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    run = tmp_path / "busy"
    lock, metrics = run / LOCK_FILE, run / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (lock.is_file() and lock.read_text()) and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        # The first holder of the lock is the launching process itself, not a worker it started.
        assert json.loads(lock.read_text())["pid"] == holder.pid
        # Its workers' rank 0 accepted the launcher's lock as the job's and trains.
        while not (metrics.is_file() and metrics.read_text()) and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert holder.poll() is None and metrics.read_text(), holder.stderr.read()[-3000:]
        # A second launcher and a single process both refuse before starting anything.
        for extra in (["launch.nproc=2", "comm.name=gloo"], ["launch.nproc=1", "comm.name=local"]):
            err = _refused(capsys, tmp_path, "train.steps=1", *extra)
            assert err.startswith("subnetdp: error: run directory") and f"pid {holder.pid}" in err, err
        assert json.loads(lock.read_text())["pid"] == holder.pid  # nobody took the lock from it
        workers = training_workers(holder.pid)
        assert len(workers) == 2, workers
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    # The SIGKILLed launcher takes its workers along (they die with their parent, prctl PDEATHSIG).
    assert not gone_within(workers, 5), "workers outlived their SIGKILLed launcher"

    # The kernel released the dead holder's lock, but its run is still there: a new run under its
    # name is refused, by a launcher before it starts workers and by a single process alike.
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    for extra in (["launch.nproc=2", "comm.name=gloo"], ["launch.nproc=1", "comm.name=local"]):
        err = _refused(capsys, tmp_path, "train.steps=1", *extra)
        assert err.startswith(f"subnetdp: error: run.name='busy': {run} already holds a run (config.yaml"), err
        assert "resume=auto" in err and "run.overwrite=true" in err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before

    # run.overwrite=true deletes the old run first: the directory holds the new run alone.
    third = _job(tmp_path, "train.steps=1", "launch.nproc=1", "comm.name=local", "run.overwrite=true")
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"run.overwrite=true: deleted the old run in {run}" in third.stdout
    assert {json.loads(line)["step"] for line in metrics.read_text().splitlines()} == {1}
    assert json.loads((run / "summary.json").read_text())["steps"] == 1
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1

"""One job per run directory: two real jobs on one run directory, then the holder killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from subnetdp.train.runlock import LOCK_FILE

PY = [sys.executable, "-m", "subnetdp", "train", "resnet18_digits", "comm.name=local", "masker.coverage=1",
      "train.batch_size=8", "optim.warmup_steps=0", "launch.threads_per_rank=1", "train.progress=false",
      "eval.bn_recalibrate_batches=0", "checkpoint.enabled=false", "run.name=busy"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _job(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PY, f"run.dir={tmp}", *extra], capture_output=True, text=True, env=ENV, timeout=300)


def test_second_job_on_a_live_run_directory_says_who_holds_it_and_exits(tmp_path):
    holder = subprocess.Popen([*PY, f"run.dir={tmp_path}", "train.steps=100000", "launch.nproc=1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    lock = tmp_path / "busy" / LOCK_FILE
    try:
        deadline = time.monotonic() + 240
        while not (lock.is_file() and lock.read_text()) and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert holder.poll() is None, holder.stderr.read()
        assert json.loads(lock.read_text())["pid"] == holder.pid
        # The plain launcher refuses before starting workers; a worker (rank 0) refuses by the lock itself.
        for extra in (["launch.nproc=2", "comm.name=gloo"], ["launch.nproc=1"]):
            second = _job(tmp_path, "train.steps=1", *extra)
            assert second.returncode == 2, second.stderr[-3000:]
            err = second.stderr.strip().splitlines()
            assert err[-1].startswith("subnetdp: error: run directory") and f"pid {holder.pid}" in err[-1], err
            assert "starting 2 local workers" not in second.stdout
        assert not (tmp_path / "busy" / "summary.json").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    # The kernel released the dead holder's lock: the next job runs.
    third = _job(tmp_path, "train.steps=1", "launch.nproc=1")
    assert third.returncode == 0, third.stderr[-3000:]
    assert (tmp_path / "busy" / "summary.json").exists()

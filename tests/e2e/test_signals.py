"""Signals and kills through the real launchers: nothing is lost, nobody is left behind.

Real processes, real signals sent to the launcher by PID: SIGTERM stops both ranks after a step
with a checkpoint that a resumed run continues from, then ``resume=auto`` on the finished run
leaves it untouched; a second signal aborts at once; Ctrl-C to ``subnetdp launch`` (torchrun) stops
at a step with a checkpoint and one line; SIGKILL of ``subnetdp launch`` takes every worker with it
(that of ``subnetdp train launch.nproc=2`` is checked on test_run_lock.py's job, which ends so anyway).
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
from subnetdp.train.stopping import STOP_HOLD
from tests.helpers import alive, descendants, gone_within, training_workers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and uses prctl")

SUBNETDP = [sys.executable, "-m", "subnetdp"]
ARGS = ["resnet18_digits", "train.steps=400", "optim.warmup_steps=0", "train.batch_size=8", "train.log_every=1", "train.progress=false",
        "eval.bn_recalibrate_batches=2", "eval.every=0", "launch.threads_per_rank=1", "checkpoint.keep=2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _start(cmd: list[str], run: Path, env: dict | None = None) -> tuple[subprocess.Popen, set[int]]:
    """Start ``cmd`` and wait until its run has logged two steps; returns it and its workers."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV,
                            start_new_session=True)  # a signal to the test's process group never reaches it
    deadline = time.monotonic() + 180
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        if proc.poll() is not None:
            pytest.fail(f"the run ended early: {proc.communicate()}")
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the run logged no step within 180 s")
    workers = training_workers(proc.pid)
    assert len(workers) >= 2, workers
    return proc, workers


def test_sigterm_checkpoints_then_resume_finishes_and_a_finished_run_is_left_alone(tmp_path):
    run = tmp_path / "term"
    common = [*SUBNETDP, "train", *ARGS, "launch.nproc=2", f"run.dir={tmp_path}", "run.name=term"]
    proc, workers = _start(common, run)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in out + err and not gone_within(workers, 5)
    lines = [ln for ln in err.splitlines() if ln.startswith("subnetdp: stopped")]
    assert len(lines) == 1, err[-3000:]
    step = int(re.search(r"after step (\d+)", lines[0]).group(1))
    saved = ck.step_dir(run, step)
    assert str(saved) in lines[0] and (saved / ck.MANIFEST).is_file()
    assert json.loads((saved / ck.MANIFEST).read_text())["step"] == step
    assert not (run / "summary.json").exists()

    # The stopped run continues from its checkpoint to the end, with the command the line prints ...
    printed = shlex.split(lines[0].split("; continue with ", 1)[1])
    # The program as this job was started (python -m subnetdp), not a bare `subnetdp` that PATH may not find.
    assert printed[1:4] == ["-m", "subnetdp", "train"] and "resume=auto" in printed and "launch.nproc=2" in printed
    done = subprocess.run([*printed, f"train.steps={step + 1}"],
                          capture_output=True, text=True, env=ENV, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {saved} (step {step})" in done.stdout
    summary = run / "summary.json"
    assert json.loads(summary.read_text())["steps"] == step + 1
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    # ... and resume=auto on the finished run says so, exits 0 and touches nothing.
    again = subprocess.run([*common[:-1], "run.name=term", "resume=auto", f"train.steps={step + 1}"],
                           capture_output=True, text=True, env=ENV, timeout=60)
    assert again.returncode == 0, again.stderr
    assert f"already finished its {step + 1} steps" in again.stdout and "starting" not in again.stdout
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_a_second_signal_aborts_at_once(tmp_path):
    # The stopping ranks hold 5 s before their checkpoint, so the second signal (0.3 s later) is sure
    # to arrive during the first stop however fast a step is on this machine.
    proc, workers = _start([*SUBNETDP, "train", *ARGS, "launch.nproc=2", f"run.dir={tmp_path}", "run.name=twice"],
                           tmp_path / "twice", {**ENV, STOP_HOLD: "5"})
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)  # two signals sent at once would reach the launcher as one
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in out + err, err[-3000:]
    assert "second signal (SIGINT): aborting now" in err, err[-3000:]  # the person's Ctrl-C, not the agent's SIGTERM
    assert not gone_within(workers, 5)


def test_ctrl_c_and_sigkill_of_subnetdp_launch_under_torchrun(tmp_path):
    # Ctrl-C (one SIGINT) to `subnetdp launch`: torchrun passes it to the workers, which stop at a step
    # boundary with a checkpoint; torchrun ends with one line, not a traceback.
    cmd = [*SUBNETDP, "launch", "--nproc", "2", *ARGS, f"run.dir={tmp_path}", "run.name=interrupted"]
    proc, workers = _start(cmd, tmp_path / "interrupted")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    assert "torchrun: stopped by SIGINT" in err and not gone_within(workers, 5)
    saved = ck.latest_checkpoint(tmp_path / "interrupted")
    assert saved is not None and json.loads((saved / ck.MANIFEST).read_text())["step"] >= 2

    # Ctrl-C twice: the workers abort at once and say so, and torchrun's line does not claim a checkpoint.
    cmd = [*SUBNETDP, "launch", "--nproc", "2", *ARGS, f"run.dir={tmp_path}", "run.name=twice"]
    proc, workers = _start(cmd, tmp_path / "twice", {**ENV, STOP_HOLD: "5"})
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in out + err, err[-3000:]
    assert "second signal (SIGINT): aborting now" in err, err[-3000:]
    assert "torchrun: stopped by a second SIGINT: the workers aborted at once, without a checkpoint" in err, err[-3000:]
    assert not gone_within(workers, 5)

    # SIGKILL of `subnetdp launch` takes torchrun and the workers with it.
    cmd = [*SUBNETDP, "launch", "--nproc", "2", *ARGS, f"run.dir={tmp_path}", "run.name=launched"]
    proc, workers = _start(cmd, tmp_path / "launched")
    below = descendants(proc.pid)  # torchrun and its workers
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not gone_within(below | workers, 5), "torchrun or workers outlived subnetdp launch"


def _rank_of(pid: int) -> int | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    rank = next((item[5:] for item in env if item.startswith(b"RANK=")), b"")
    return int(rank) if rank.isdigit() else None


def test_a_stalled_peer_under_sigterm_is_named_while_the_launcher_waits_and_when_it_gives_up(tmp_path):
    # Rank 1 is stopped (SIGSTOP), so it never reaches the step boundary and rank 0 waits for it in
    # the gradient all-reduce: SIGTERM to the launcher cannot end the run cleanly. The launcher says
    # what it waits for while it waits, and who it killed and why when launch.stop_timeout_s runs out.
    proc, workers = _start([*SUBNETDP, "train", *ARGS, "launch.nproc=2", f"run.dir={tmp_path}", "run.name=stalled",
                            "masker.coverage=1", "launch.stop_timeout_s=4"], tmp_path / "stalled")
    ranks = {_rank_of(p): p for p in workers}
    try:
        os.kill(ranks[1], signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        for p in alive(workers):
            os.kill(p, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert not gone_within(workers, 5)
    stalled = f"rank 1 (pid {ranks[1]}) is stopped (state T: SIGSTOP"
    waiting = [ln for ln in err.splitlines() if ln.startswith("subnetdp: SIGTERM ") and "waiting for 2 of 2 workers" in ln]
    assert waiting and stalled in waiting[0] and "killed in" in waiting[0], err[-3000:]
    assert f"rank 0 (pid {ranks[0]}) is " in waiting[0]
    verdict = [ln for ln in err.splitlines() if ln.startswith("subnetdp: gave up waiting 4 s (launch.stop_timeout_s) "
                                                             "after SIGTERM")]
    assert len(verdict) == 1 and stalled in verdict[0] and "killed them (SIGKILL)" in verdict[0], err[-3000:]
    assert "Traceback" not in err

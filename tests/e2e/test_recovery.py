"""Recovery from the surviving owners, with real kills under ``torchrun --max-restarts 1`` (4 gloo ranks).

ResNet-18 on digits at C = 0.5 with ``masker.min_owners=2``: ranks 0 and 1 own the same four units, ranks
2 and 3 the other four, so one dead rank takes nothing that a survivor does not hold. The reference run
saves every step; the killed runs save at step 4 only (``checkpoint.every=4``, and the final one). Rank 1
is SIGKILLed at four moments of step 4: inside its gradient averaging (the run must resume from step 3,
the last finished step), right after its optimizer update and inside step 4's checkpoint write (both
from step 4, assembled from the survivors' files), and right after the checkpoint (from the
checkpoint). A rank that stalls in step 4's averaging (SIGSTOP) is named after ``comm.timeout_s`` and
the survivors resume from step 3 as after a death. Nothing finished is trained again, the resumed
checkpoint holds exactly the reference's values and optimizer state of that step, and the run ends
with the reference's parameters and optimizer state. A plan whose units have one owner, and two
co-owners killed at once, fall back to the newest complete checkpoint and name what was lost. No
path leaves a process or prints a traceback. What the console reads under the plain launcher with
no restart left is checked on the killed run that test_recovery_files.py needs anyway.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints import survivors

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
END = 5  # one step after the kills' step 4: what "the run goes on to the reference's end" needs
COMMON = ["train", "resnet18_digits", f"train.steps={END}", "train.batch_size=4", "train.log_every=2",
          "eval.bn_recalibrate_batches=0", "eval.every=0", "optim.warmup_steps=0", "masker.coverage=0.5",
          "launch.threads_per_rank=1", "train.progress=false", "checkpoint.keep=0", "resume=auto"]


def _torchrun(tmp: Path, name: str, *extra: str, nproc: int = 4, env: dict | None = None,
              kill_stopped_after: str | None = None) -> subprocess.CompletedProcess:
    """Run a torchrun job to its end. ``kill_stopped_after``: once a stderr line holds this text,
    SIGKILL the job's stopped (SIGSTOPped) workers, as torchrun's agent does only after its fixed
    30 s grace for a worker that ignores SIGTERM (the grace is the agent's, not subnetdp's)."""
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1", "-m", "subnetdp",
           *COMMON, f"run.dir={tmp}", f"run.name={name}", *extra]
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    err: list[str] = []

    def read_stderr() -> None:
        for line in popen.stderr:
            err.append(line)
            if kill_stopped_after and kill_stopped_after in line:
                _kill_stopped(tmp)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        out = popen.stdout.read()
        popen.wait(timeout=900)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
    reader.join(60)
    proc = subprocess.CompletedProcess(cmd, popen.returncode, out, "".join(err))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    _assert_no_process_left(tmp / name)
    return proc


def _kill_stopped(tmp: Path) -> None:
    """SIGKILL the stopped (state T) processes of the job writing under ``tmp``."""
    # -ww: without a terminal to size it by, ps cuts each line at 80 columns, before a worker's run.dir:
    # nothing matched, and the agent's 30 s grace ran out instead (half of this test's time).
    ps = subprocess.run(["ps", "-ww", "-eo", "pid=,stat=,args="], capture_output=True, text=True).stdout
    for line in ps.splitlines():
        pid, stat, args = line.split(None, 2)
        if stat.startswith("T") and f"run.dir={tmp} " in args + " ":
            os.kill(int(pid), signal.SIGKILL)


def _assert_no_process_left(run_dir: Path) -> None:
    left = subprocess.run(["pgrep", "-f", f"run.dir={run_dir.parent} "], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left running: {left}"


def _pieces(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every parameter piece of a checkpoint with its optimizer state, by key (whoever wrote it)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("pieces_*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_pieces_equal(got: Path, want: Path) -> None:
    a, b = _pieces(got), _pieces(want)
    assert set(b) <= set(a), sorted(set(b) - set(a))[:5]
    for key in b:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ref")
    _torchrun(tmp, "ref", "masker.min_owners=2", "checkpoint.every=1")
    return tmp / "ref"


@pytest.mark.parametrize("where, recovered", [(ck.KILL_IN_SYNC, 3), (ck.KILL_IN_UPDATE, 4), (ck.KILL_IN_WRITE, 4),
                                              (ck.KILL_AT_STEP, None)])
def test_survivors_resume_the_last_finished_step_and_match(reference, tmp_path, where, recovered):
    proc = _torchrun(tmp_path, "killed", "masker.min_owners=2", "checkpoint.every=4", "checkpoint.final=always",
                     env={where: "4"})
    run = tmp_path / "killed"
    assert ck.fault_marker(run, where, 4, 1).exists()  # the kill really happened
    # Every survivor names the dead rank, and only it (a survivor that already left is not taken for dead).
    assert set(re.findall(r"(ranks? [\d, ]*\d) (?:died|is gone|are gone)", proc.stderr)) == {"rank 1"}, proc.stderr[-3000:]
    if recovered is None:  # killed after step 4's checkpoint: nothing newer to recover, the checkpoint serves
        assert "recovered step" not in proc.stdout
        recovered = 4
    else:
        assert f"recovered step {recovered} from the surviving owners (ranks [0, 2, 3]; lost: [1])" in proc.stdout
        manifest = ck.read_manifest(ck.step_dir(run, recovered))
        assert manifest["absent_ranks"] == [1] and manifest["recovered_from"] == [0, 2, 3]
    step = ck.step_dir(run, recovered)
    assert f"resumed from {step} (step {recovered})" in proc.stdout
    assert "the launcher restarts the workers (restart 1 of 1), which continue from there" in proc.stderr
    assert "SIGTERM received" not in proc.stderr  # the agent's SIGTERM after the death announces no stop
    # Every piece (value and optimizer state) as the surviving owners held it at that step.
    _assert_pieces_equal(step, ck.step_dir(reference, recovered))
    # ...and the run goes on to the reference's end: parameters and optimizer state bit for bit.
    _assert_pieces_equal(ck.step_dir(run, END), ck.step_dir(reference, END))
    for r in (0, 2, 3):  # the survivors' buffers too (the dead rank's are its co-owners' mean)
        name = ck.rank_files(r)[0]
        a, b = load_file(str(ck.step_dir(run, END) / name)), load_file(str(ck.step_dir(reference, END) / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(survivors.survivors_dir(run).iterdir())  # superseded fragments are gone
    assert not list(ck.checkpoints_dir(run).glob("*.tmp"))  # so is a torn save's leftover
    _assert_log_misses_no_step(run, reference, where)


def _train_rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "train/loss" in r]
    assert len({r["step"] for r in train}) == len(train), [r["step"] for r in train]  # no step logged twice
    return {r["step"]: r for r in train}


def _rank_losses(run: Path, ranks: list[int], steps: list[int]) -> list[float]:
    out = []
    for r in ranks:
        acc = EventAccumulator(str(run / "tensorboard" / f"rank_{r}"), size_guidance={"scalars": 0})
        acc.Reload()
        by_step = {e.step: e.value for e in acc.Scalars("rank/loss")}
        out += [by_step[s] for s in steps]
    return out


def _assert_log_misses_no_step(run: Path, reference: Path, where: str) -> None:
    """Every log step has one row. A kill after step 4's update and before its log's all-reduce leaves
    step 4 finished by the survivors and logged by nobody: its row is written on resume from the
    survivors' own losses of steps 3 and 4 (the reference's per-rank losses, the dead rank's left out);
    a kill inside step 4's averaging resumes at step 3, whose survivors' losses join row 4's mean."""
    got, want = _train_rows(run), _train_rows(reference)
    assert sorted(got) == [2, 4, END], sorted(got)
    for step in (2, END):  # trained by the whole world, bit for bit as the reference: the same mean
        assert got[step]["train/loss"] == want[step]["train/loss"] and "recovered" not in got[step]
    row = got[4]
    if where == ck.KILL_IN_UPDATE:
        assert row["recovered"] == {"ranks": [0, 2, 3], "world_size": 4, "steps": [3, 4]}, row
        expected = _rank_losses(reference, [0, 2, 3], [3, 4])
    elif where == ck.KILL_IN_SYNC:
        assert row["recovered"] == {"ranks": [0, 2, 3], "world_size": 4, "steps": [3]}, row
        expected = _rank_losses(reference, [0, 2, 3], [3]) + _rank_losses(reference, [0, 1, 2, 3], [4])
    else:  # killed after step 4's log: its row is the world's
        assert row == want[4] | {k: row[k] for k in row if k.endswith(("_s", "per_s"))}, (row, want[4])
        return
    # float32 losses summed in float64 in another order: equal to within float64 rounding.
    assert math.isclose(row["train/loss"], sum(expected) / len(expected), rel_tol=1e-12), (row, expected)


def test_a_stalled_rank_is_named_and_the_survivors_resume_without_it(reference, tmp_path):
    # SIGSTOP inside step 4's gradient averaging: the survivors time out (comm.timeout_s), name the
    # silent rank, keep their units as of step 3; the stopped rank is SIGKILLed once named (torchrun's
    # agent would do it after 30 s more) and the agent restarts the group.
    proc = _torchrun(tmp_path, "stalled", "masker.min_owners=2", "checkpoint.every=0", "checkpoint.final=always",
                     "comm.timeout_s=4", env={ck.KILL_IN_SYNC: "4", ck.KILL_SIGNAL: "STOP"},
                     kill_stopped_after="rank 1 stopped answering")
    run = tmp_path / "stalled"
    assert ck.fault_marker(run, ck.KILL_IN_SYNC, 4, 1).exists()
    assert "rank 1 stopped answering" in proc.stderr, proc.stderr[-3000:]
    assert "recovered step 3 from the surviving owners (ranks [0, 2, 3]; lost: [1])" in proc.stdout
    _assert_pieces_equal(ck.step_dir(run, 3), ck.step_dir(reference, 3))
    _assert_pieces_equal(ck.step_dir(run, END), ck.step_dir(reference, END))


def test_two_co_owners_killed_at_once_fall_back_and_name_the_lost_units(tmp_path):
    # Ranks 0 and 1 are the only owners of units 0, 2, 4 and 6: killed together, those units are gone.
    proc = _torchrun(tmp_path, "both", "masker.min_owners=2", "checkpoint.every=2",
                     env={ck.KILL_IN_SYNC: "4", ck.KILL_RANK: "0,1"})
    run = tmp_path / "both"
    assert ck.fault_marker(run, ck.KILL_IN_SYNC, 4, 0).exists() and ck.fault_marker(run, ck.KILL_IN_SYNC, 4, 1).exists()
    assert "the survivors' files cannot make a whole step: step 3 (from ranks [2, 3]) lacks layer" in proc.stdout
    assert "(no surviving owner); resuming from the newest complete checkpoint" in proc.stdout
    assert f"resumed from {ck.step_dir(run, 2)} (step 2)" in proc.stdout


def test_a_unit_with_no_surviving_owner_and_no_checkpoint_restarts_and_names_the_fragments(tmp_path):
    # Two ranks at C = 0.5: every unit has one owner, so rank 1's death loses its units; no checkpoint
    # before the end, so the run starts over (a new run id) and sets the old step-3 fragments aside,
    # saying they are this run's, of step 3, lacking the lost units (not "of another run").
    proc = _torchrun(tmp_path, "single", nproc=2, env={ck.KILL_IN_SYNC: "4"})
    run = tmp_path / "single"
    assert "the survivors' files cannot make a whole step: step 3 (from ranks [0]) lacks layer" in proc.stdout
    assert "(no surviving owner); resuming from the start (no checkpoint)" in proc.stdout
    assert "of another run or of a branch" not in proc.stdout, proc.stdout[-3000:]
    aside = survivors.set_aside_dir(run)
    assert re.search(r"subnetdp: set aside this run's 1 survivors' fragment\(s\) of step 3 \(ranks \[0\]\), which "
                     rf"lack layer\S* .*\(no surviving owner\) in {re.escape(str(aside))}", proc.stdout), proc.stdout[-3000:]
    assert sorted(p.name for p in aside.glob("*/step_*")) == ["step_00000003.rank_0"]
    assert proc.returncode == 0 and (ck.step_dir(run, END) / ck.MANIFEST).is_file()

"""``launch.on_failure=continue``: a worker dies, the survivors go on in-process, nobody restarts.

Real processes and real SIGKILLs, under the real ``subnetdp train launch.nproc=4`` (subnetdp's
supervisor hosts the job's store and restarts nobody). The reference that makes "went on correctly"
checkable: the same job, the same kill, taking today's path (the survivors write their files and
leave) and restarted on exactly the survivors (``launch.nproc=3 resume=auto``). Going on in-process
from step S must train the same values, bit for bit, as that restart (docs/inprocess.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from subnetdp.train import faults

COMMON = ["train", "resnet18_digits", "train.steps=6", "train.batch_size=4", "train.log_every=2",
          "eval.bn_recalibrate_batches=0", "eval.every=0", "optim.warmup_steps=0", "masker.coverage=0.5",
          "launch.threads_per_rank=1", "train.progress=false", "checkpoint.final=always", "comm.timeout_s=60"]


def _run(tmp_path: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "subnetdp", *COMMON, f"run.dir={tmp_path}", f"run.name={name}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    return out


def _steps(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "train/loss" in r]


def test_survivors_go_on_in_process_and_train_what_a_restart_on_them_trains(tmp_path):
    # Rank 1 is SIGKILLed inside step 4's gradient averaging: the survivors finished step 3.
    kill = {faults.KILL_IN_SYNC: "4"}
    went_on = _run(tmp_path, "inprocess", "optim.name=adamw", "launch.nproc=4", "launch.on_failure=continue", env=kill)
    console = went_on.stdout + went_on.stderr
    assert went_on.returncode == 0, console[-3000:]
    assert "a dead worker is not restarted" in went_on.stdout
    assert "the 3 survivors (old ranks [0, 2, 3]) go on in-process from step 3" in console, console[-3000:]
    assert "restarted" not in console.replace("is not restarted", "") and "continue with:" not in console
    run = tmp_path / "inprocess"
    assert faults.fault_marker(run, faults.KILL_IN_SYNC, 4, 1).exists()  # the SIGKILL happened
    steps = _steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == 6, steps  # no step logged twice, the run ended
    assert json.loads((run / "summary.json").read_text())["world_size"] == 3

    # The reference: today's path (the survivors keep their units and leave), restarted on the survivors.
    died = _run(tmp_path, "restart", "optim.name=adamw", "launch.nproc=4", env=kill)
    assert died.returncode != 0 and "kept its units as of step 3" in died.stderr + died.stdout
    again = _run(tmp_path, "restart", "optim.name=adamw", "launch.nproc=3", "resume=auto")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "recovered step 3 from the surviving owners" in again.stdout

    a = _tensors(run / "checkpoints" / "step_00000006")
    b = _tensors(tmp_path / "restart" / "checkpoints" / "step_00000006")
    assert a.keys() == b.keys() and len(a) > 100
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]  # values, optimizer state (AdamW's moments and step) and buffers


def test_a_stalled_worker_is_left_out_and_its_units_gain_an_owner_over_the_network(tmp_path):
    # Rank 1 is SIGSTOPped right after its update of step 3: the survivors finish step 3 (its last world
    # collective is behind them), time out in step 4 (comm.timeout_s), agree without it, and the
    # supervisor kills it (else the job would wait for it forever). masker.min_owners=2: the units rank 1
    # held with one other rank gain a new owner, which receives their values and optimizer state from the
    # surviving owner; the owners compare digests after every step (a wrong heal stops the run).
    proc = _run(tmp_path, "heal", "masker.min_owners=2", "recovery.verify_every=1", "launch.nproc=4",
                "launch.on_failure=continue", "comm.timeout_s=4",
                env={faults.KILL_IN_UPDATE: "3", faults.KILL_SIGNAL: "STOP"})
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    # The timeout names who did not check in within its grace (rank 1, and perhaps a slow survivor); the
    # agreement decides who goes on.
    assert "stopped answering" in console and "old ranks [0, 2, 3]" in console, console[-3000:]
    went = re.search(r"go on in-process from step 3: (\d+) piece\(s\) gained an owner over the network \(([\d.]+) MiB", console)
    assert went and int(went.group(1)) > 0 and float(went.group(2)) > 0, console[-3000:]
    assert "owners disagree" not in console, console[-3000:]  # every step's digests agreed, after the heal too
    assert _steps(tmp_path / "heal")[-1] == 6


def test_continue_refuses_restarts_in_one_line(tmp_path):
    proc = _run(tmp_path, "bad", "launch.nproc=2", "launch.on_failure=continue", "launch.max_restarts=1", "resume=auto")
    assert proc.returncode != 0
    assert "launch.on_failure='continue': restarts nobody" in proc.stderr and "launch.max_restarts=1" in proc.stderr
    assert "Traceback" not in proc.stderr and "starting 2 local workers" not in proc.stdout


def test_a_second_death_amid_the_re_formation_leaves_the_survivors_to_agree_again(tmp_path):
    # Rank 1 is SIGKILLed inside step 3's optimizer update (half of its tensors updated): the survivors
    # finished step 3 (its last world collective is behind them) and re-form without it. Rank 3 is then
    # SIGKILLed amid that re-formation, its owner groups formed and the heal's broadcasts not begun. The
    # state of the survivors has not changed yet: they agree again, a second generation without rank 3,
    # and go on at W-2 = 2 (ranks 0 and 2 own every unit between them at C = 0.5: owner pairs {0, 1} and
    # {2, 3}). The owners compare digests after every step, so a heal from a half-updated or mixed state
    # would stop the run.
    kill = {faults.KILL_IN_OPTIMIZER: "3", faults.KILL_RANK: "1", faults.KILL_IN_REFORM: "3:3:heal"}
    proc = _run(tmp_path, "twice", "masker.min_owners=2", "recovery.verify_every=1", "launch.nproc=4",
                "launch.on_failure=continue", "train.log_every=1", "comm.timeout_s=20", env=kill)
    console = proc.stdout + proc.stderr
    run = tmp_path / "twice"
    assert proc.returncode == 0, console[-4000:]
    assert faults.fault_marker(run, faults.KILL_IN_OPTIMIZER, 3, 1).exists()  # both SIGKILLs happened
    assert faults.fault_marker(run, faults.KILL_IN_REFORM, 3, 3).exists()
    # Each survivor names the second death in one line; rank 0 says who went on, from which step.
    for rank in (0, 2):
        again = [ln for ln in console.splitlines()
                 if ln.startswith(f"subnetdp: rank {rank}: another worker was lost while the survivors re-formed "
                                  "the world to go on from step 3")]
        assert len(again) == 1 and "rank 3 died" in again[0], console[-4000:]
    went = re.search(r"the 2 survivors \(old ranks \[0, 2\]\) go on in-process from step 3: (\d+) piece\(s\) gained",
                     console)
    assert went and int(went.group(1)) > 0, console[-4000:]
    assert "not going on in-process" not in console and "owners disagree" not in console, console[-4000:]
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r}
    # Every step's row, none twice, and the run ended: the death came between step 3's update and its row,
    # so the survivors wrote it after going on, from their losses of it (docs/inprocess.md "Logging").
    assert _steps(run) == [1, 2, 3, 4, 5, 6], _steps(run)
    assert rows[3]["recovered"] == {"ranks": [0, 2], "world_size": 4, "steps": [3]}, rows[3]
    # The samples trained: 3 steps of 4 workers, then 3 of 2 (batch 4), not the last world's rate throughout.
    assert [rows[s]["train/samples_seen"] for s in (2, 3, 6)] == [32, 48, 72], rows
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2
    # Bytes by owner group in worker ids, each over the steps of its world: the pairs {0, 1} and {2, 3} and the
    # world of 4 for steps 1-3, the world of workers 0 and 2 (ranks 0 and 1 now) for steps 4-6.
    for r, worker, pair in ((0, 0, "0-1"), (1, 2, "2-3")):
        mine = summary["ranks"][r]
        assert mine["worker"] == worker and set(mine["bytes_by_group"]) == {pair, "0-2", "0-1-2-3"}, mine
        assert {g["steps"] for g in mine["bytes_by_group"].values()} == {3}, mine

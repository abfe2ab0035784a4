"""``requeue_job``: what rank 0 says after SLURM's pre-emption notice, with a stand-in ``scontrol``
that succeeds, fails, or is not there (the signal path itself: ``tests/e2e/test_slurm.py``)."""

from __future__ import annotations

import os
import stat

from subnetdp.train.stopping import requeue_job


def _scontrol(folder, body: str):
    path = folder / "scontrol"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "77"}


def test_requeue_runs_scontrol_and_reports_a_failure_in_one_clause(tmp_path):
    args = tmp_path / "args"
    env = _scontrol(tmp_path, f'echo "$@" > {args}')
    assert requeue_job(env).startswith("requeued SLURM job 77 (scontrol requeue 77)")
    assert args.read_text().split() == ["requeue", "77"]
    env = _scontrol(tmp_path, 'echo "scontrol: error: Job is not requeueable" >&2; exit 1')
    said = requeue_job(env)
    assert said == ("requeue failed (scontrol requeue 77 exited 1: scontrol: error: Job is not requeueable); "
                    "requeue it by hand")
    assert requeue_job({"PATH": str(tmp_path / "nothing")}).startswith("not requeued: SLURM_JOB_ID is not set")
    assert requeue_job({"PATH": str(tmp_path / "nothing"), "SLURM_JOB_ID": "5"}).startswith("requeue failed (scontrol requeue 5:")

"""Faults: a kill in the middle of pruning, and the host RNG states a checkpoint saves."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from subnetdp.train.checkpoints import files as ck
from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.loop import train
from tests.helpers import plugin_manager, small_config

ONE = LaunchEnv(0, 1, 0, 1, "test")
CLI = [sys.executable, "-m", "subnetdp", "train", "resnet18_digits", "comm.name=local", "masker.coverage=1",
       "train.batch_size=8", "optim.warmup_steps=0", "launch.nproc=1", "launch.threads_per_rank=1",
       "train.progress=false", "eval.bn_recalibrate_batches=0", "checkpoint.every=1", "checkpoint.keep=1",
       "resume=auto", "run.name=pruned", "train.steps=3"]


def test_kill_while_pruning_leaves_no_half_checkpoint_and_the_leftover_is_cleaned(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", ck.KILL_IN_PRUNE: "1", ck.KILL_RANK: "0"}
    killed = subprocess.run([*CLI, f"run.dir={tmp_path}"], capture_output=True, text=True, env=env, timeout=300)
    run = tmp_path / "pruned"
    assert killed.returncode == -9 and ck.fault_marker(run, ck.KILL_IN_PRUNE, 1, 0).exists(), killed.stderr[-2000:]
    names = sorted(p.name for p in ck.checkpoints_dir(run).iterdir())
    # The victim was renamed before any file went: no step_* directory lacks its manifest.
    assert names == ["LINEAGE.json", "step_00000001.deleting", "step_00000002"], names
    assert all((ck.checkpoints_dir(run) / n / ck.MANIFEST).is_file() for n in names if ck.STEP_DIR.match(n))
    resumed = subprocess.run([*CLI, f"run.dir={tmp_path}"], capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {ck.step_dir(run, 2)} (step 2)" in resumed.stdout
    assert sorted(p.name for p in ck.checkpoints_dir(run).iterdir()) == ["LINEAGE.json", "step_00000003"]


def _host_rng(tmp_path: Path, name: str, seed: int) -> dict:
    random.seed(name)  # a different state before each run: it must not matter
    np.random.seed(ord(name))
    cfg = small_config("comm.name=local", "masker.coverage=1", "train.batch_size=8", "train.steps=1",
                       "checkpoint.enabled=true", "checkpoint.final=always", f"seed={seed}", f"run.name={name}", run_dir=tmp_path)
    run = train(cfg, ONE, plugin_manager())
    state = ck.read_state(ck.step_dir(run.context.run_dir, 1) / ck.rank_files(0)[1])["rng"]
    return {k: state[k] for k in ("python", "python_gauss", "numpy", "numpy_pos")}


def test_python_and_numpy_states_in_checkpoints_derive_from_seed(tmp_path):
    a, b, c = _host_rng(tmp_path, "a", 7), _host_rng(tmp_path, "b", 7), _host_rng(tmp_path, "c", 8)
    for key in ("python", "numpy"):
        assert a[key].equal(b[key]), key
        assert not a[key].equal(c[key]), key
    assert a["numpy_pos"] == b["numpy_pos"] and a["python_gauss"] == b["python_gauss"]


def test_an_error_that_ends_a_worker_is_one_line_and_its_traceback_is_kept_in_the_run_directory(
        tmp_path, capsys, monkeypatch):
    import torch

    from subnetdp import cli

    real, calls = torch.optim.SGD.step, []

    def failing(self, *args, **kwargs):  # a library error in the middle of step 2
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the kernel failed\nits second line")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", failing)
    assert cli.main([*CLI[3:], f"run.dir={tmp_path}", "run.name=broken"]) == 2
    out, err = capsys.readouterr()
    log = tmp_path / "broken" / "logs" / "rank_0.log"
    assert err == f"subnetdp: error: rank 0 stopped in step 2: RuntimeError: the kernel failed; the full error: {log}\n"
    assert "Traceback" not in out + err
    text = log.read_text()
    assert "rank 0 stopped in step 2: RuntimeError: the kernel failed\n" in text
    assert "Traceback (most recent call last)" in text and "in failing" in text and "its second line" in text


def test_every_kill_point_lives_in_one_module_and_fires_only_where_asked(tmp_path, monkeypatch):
    """One module names every test-only fault; checkpoints and the run state only use it."""
    import ast
    import errno

    import pytest

    import subnetdp.train.state as state_mod
    from subnetdp.train import faults

    names = [n for n in dir(faults) if n.startswith(("KILL_", "NO_SPACE"))]
    assert len(names) == 11 and all(getattr(faults, n).startswith("SUBNETDP_TEST_") for n in names)
    # the old spelling ck.* keeps working (a join's and a re-formation's points came after the move)
    assert all(getattr(ck, n) == getattr(faults, n) for n in names
               if n not in ("KILL_IN_JOIN", "KILL_IN_OPTIMIZER", "KILL_IN_REFORM"))
    # The run state takes its fault hooks from the faults module, not from the checkpoint files.
    tree = ast.parse(Path(state_mod.__file__).read_text())
    froms = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("subnetdp.train.faults", "step_faults") in froms and ("subnetdp.train.checkpoints.files", "step_faults") not in froms
    for n in names:
        monkeypatch.delenv(getattr(faults, n), raising=False)
    assert faults.step_faults(1, tmp_path) is None  # nothing set: the training step pays nothing
    faults.no_space(5, tmp_path / "f")  # not set: no error
    monkeypatch.setenv(faults.NO_SPACE_IN_ASSEMBLY, "5")
    faults.no_space(4, tmp_path / "f")  # another step: no error
    with pytest.raises(OSError) as e:
        faults.no_space(5, tmp_path / "f")
    assert e.value.errno == errno.ENOSPC and str(tmp_path / "f") in str(e.value)
    monkeypatch.setenv(faults.KILL_IN_UPDATE, "3")
    monkeypatch.setenv(faults.KILL_RANK, "0")
    hook = faults.step_faults(1, tmp_path)
    assert hook is not None
    hook("update", 3)  # rank 1 is not listed: this process survives and leaves no marker
    assert not faults.fault_marker(tmp_path, faults.KILL_IN_UPDATE, 3, 1).exists()


def test_a_kill_amid_the_update_leaves_half_the_tensors_updated_and_a_reform_kill_fires_only_where_asked(tmp_path,
                                                                                                       monkeypatch):
    """The signal is recorded instead of sent: the optimizer's own step updates the first half of the
    parameters, then the kill comes from inside ``optimizer.step()``; the second half is untouched."""
    import signal

    from subnetdp.train import faults

    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    opt = torch.optim.SGD(params, lr=0.5)
    monkeypatch.setenv(faults.KILL_IN_OPTIMIZER, "3")
    monkeypatch.setenv(faults.KILL_RANK, "1")
    hook = faults.step_faults(1, tmp_path)
    for where, step in (("optimizer", 2), ("update", 3), ("sync", 3)):
        hook(where, step, opt)  # another step, or another point: nothing armed, nothing sent
    faults.step_faults(0, tmp_path)("optimizer", 3, opt)  # rank 0 is not listed
    for p in params:
        p.grad = torch.ones(3)
    opt.step()
    assert not sent and all(torch.equal(p, torch.full((3,), 0.5)) for p in params)
    hook("optimizer", 3, opt)
    for p in params:
        p.grad = torch.ones(3)
    opt.step()
    assert sent == [signal.SIGKILL] and faults.fault_marker(tmp_path, faults.KILL_IN_OPTIMIZER, 3, 1).exists()
    assert [p.detach()[0].item() for p in params] == [0.0, 0.0, 0.5, 0.5]  # half updated when the kill came

    monkeypatch.setenv(faults.KILL_IN_REFORM, "3:2:groups")
    for step, worker, where in ((2, 2, "groups"), (3, 1, "groups"), (3, 2, "heal"), (3, 2, "agree")):
        faults.reform_fault(step, worker, where, tmp_path)
    assert sent == [signal.SIGKILL]
    faults.reform_fault(3, 2, "groups", tmp_path)
    faults.reform_fault(3, 2, "groups", tmp_path)  # once per run directory
    assert sent == [signal.SIGKILL] * 2 and faults.fault_marker(tmp_path, faults.KILL_IN_REFORM, 3, 2).exists()

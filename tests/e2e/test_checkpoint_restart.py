"""Crashes, restarts and export through the real launchers (2 gloo ranks).

One uninterrupted 6-step run under ``torchrun`` is the reference. A run whose rank 1 is SIGKILLed after
step 4 under ``subnetdp train launch.nproc=2 launch.max_restarts=1`` (restarted group: 3 steps from a
checkpoint + resume to 6), and a torchrun run killed inside a checkpoint write then resumed (2 steps +
resume to 6), must both end with exactly the reference's tensors: parameters, BatchNorm buffers, on
both ranks. The reference's export must load into a plain torchvision ResNet-18 and score the accuracy
the run reported for its union model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import load_file
from torch import nn

from subnetdp.train.checkpoints import files as ck
from subnetdp.evaluate.export import export, load_reference, load_union
from tests.helpers import plugin_manager

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
COMMON = ["train", "resnet18_digits", "train.steps=6", "train.batch_size=8", "train.log_every=2",
          "checkpoint.every=2", "checkpoint.keep=0", "eval.bn_recalibrate_batches=2", "eval.every=0",
          "optim.warmup_steps=0", "masker.coverage=0.5", "launch.threads_per_rank=1", "train.progress=false"]


def _torchrun(tmp: Path, name: str, *extra: str, env: dict | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "-m", "subnetdp",
           *COMMON, f"run.dir={tmp}", f"run.name={name}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _final_tensors(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    """Every tensor file of the final checkpoint: the pieces (values and optimizer state, each once)
    and both ranks' own buffers."""
    final = ck.step_dir(run_dir, 6)
    return [load_file(str(f)) for f in sorted(final.glob("*.safetensors"))]


def _assert_same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert torch.equal(ra[k], rb[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ref")
    _torchrun(tmp, "ref", "resume=auto")  # resume=auto on a fresh run directory starts from scratch
    return tmp / "ref"


def test_the_local_launcher_restarts_a_sigkilled_rank_from_the_last_checkpoint_and_matches(reference, tmp_path):
    # launch.max_restarts with launch.nproc=N (torchrun's --max-restarts is test_recovery.py's): rank 1 is
    # SIGKILLed after step 4, the launcher restarts the group once and the run ends at its last step
    # (it used to end with exit 2 and a resume command), with the uninterrupted torchrun run's tensors.
    cmd = [sys.executable, "-m", "subnetdp", *COMMON, "launch.nproc=2", "launch.max_restarts=1", "resume=auto",
           "checkpoint.every=3", f"run.dir={tmp_path}", "run.name=killed"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", ck.KILL_AT_STEP: "4"})
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-5000:]
    run = tmp_path / "killed"
    assert ck.fault_marker(run, ck.KILL_AT_STEP, 4, 1).exists()  # the kill really happened
    assert "restarted up to 1 time(s) after a failure" in proc.stdout
    assert "the launcher restarts the workers (restart 1 of 1)" in proc.stderr, proc.stderr
    assert f"resumed from {ck.step_dir(run, 3)} (step 3)" in proc.stdout
    assert "Traceback" not in console, console[-5000:]
    left = subprocess.run(["pgrep", "-f", f"run.dir={tmp_path} "], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left running: {left}"
    _assert_same(_final_tensors(run), _final_tensors(reference))
    ref_summary = json.loads((reference / "summary.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"] == ref_summary["eval"] and summary["steps"] == 6
    assert [p.name for p in ck.complete_checkpoints(run)] == ["step_00000003", "step_00000006"]


def test_kill_inside_a_checkpoint_write_keeps_the_previous_one(reference, tmp_path):
    _torchrun(tmp_path, "torn", env={ck.KILL_IN_WRITE: "4"}, ok=False)
    run = tmp_path / "torn"
    torn = ck.checkpoints_dir(run) / "step_00000004.tmp"
    assert torn.is_dir() and not (torn / ck.MANIFEST).exists()
    assert (torn / ".rank_1.state.pt.partial").exists() and not (torn / "rank_1.state.pt").exists()
    assert ck.latest_checkpoint(run) == ck.step_dir(run, 2)
    assert load_union(run, plugin_manager()).manifest["step"] == 2  # the previous checkpoint loads
    proc = _torchrun(tmp_path, "torn", "resume=auto")
    assert f"resumed from {ck.step_dir(run, 2)} (step 2)" in proc.stdout
    _assert_same(_final_tensors(run), _final_tensors(reference))
    assert not torn.exists()  # the leftover of the interrupted save is gone


def _accuracy(model: nn.Module) -> tuple[float, float]:
    from subnetdp.plugins.data.digits import DigitsData

    data = DigitsData(DigitsData.Config(name="digits"), seed=0)
    model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the run's rank 0 evaluated, so the float sums match bit for bit
    try:
        with torch.no_grad():
            batches = data.eval_loader(256)
            logits = torch.cat([model(x) for x, _ in batches])
            labels = torch.cat([y for _, y in batches])
    finally:
        torch.set_num_threads(threads)
    return float((logits.argmax(1) == labels).float().mean()), float(nn.functional.cross_entropy(logits, labels))


def test_export_loads_into_plain_torchvision_and_scores_the_run_metric(reference, tmp_path):
    run_eval = json.loads((reference / "summary.json").read_text())["eval"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "subnetdp", "eval", str(reference), "--json"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    evaluated = json.loads(out.stdout)
    assert evaluated["step"] == 6 and evaluated["eval"]["accuracy"] == run_eval["accuracy"]
    assert evaluated["eval"]["loss"] == pytest.approx(run_eval["loss"], rel=1e-5)

    export(ck.step_dir(reference, 6), tmp_path / "export", pm=plugin_manager())
    info = json.loads((tmp_path / "export" / "reference.json").read_text())
    assert info["options"] == {"variant": "resnet18", "num_classes": 10, "in_channels": 1, "cifar_stem": True,
                               "zero_init_residual": False}
    # One call rebuilds it ...
    model = load_reference(tmp_path / "export")
    assert type(model) is torchvision.models.ResNet
    acc, loss = _accuracy(model)
    assert acc == run_eval["accuracy"] and loss == pytest.approx(run_eval["loss"], rel=1e-5)
    # ... and so does plain torchvision with the CIFAR-stem options, without subnetdp.
    plain = torchvision.models.resnet18(num_classes=10)
    plain.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    plain.maxpool = nn.Identity()
    plain.load_state_dict(load_file(str(tmp_path / "export" / "model.safetensors")))
    assert _accuracy(plain) == (acc, loss)

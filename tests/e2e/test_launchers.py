"""End to end through the real launchers: `subnetdp train launch.nproc=2` and `torchrun`.

Both start 2 workers of the same recipe and seed; they must agree exactly, and the run directory
must hold what a user reads: summary, metrics, config, plan and TensorBoard events.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

COMMON = ["train", "resnet18_digits", "train.steps=12", "train.batch_size=16", "train.log_every=4",
          "eval.bn_recalibrate_batches=2", "eval.every=6", "masker.coverage=0.5"]


def _run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _events(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "images": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_local_launcher_and_torchrun_agree_and_write_the_run_directory(tmp_path):
    local = _run([sys.executable, "-m", "subnetdp", *COMMON, "launch.nproc=2", f"run.dir={tmp_path}",
                  "run.name=local"], tmp_path)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    _run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "subnetdp", *COMMON,
          f"run.dir={tmp_path}", "run.name=torchrun"], tmp_path)

    a = json.loads((tmp_path / "local" / "summary.json").read_text())
    b = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert a["eval"] == b["eval"] and a["plan_digest"] == b["plan_digest"]
    assert a["world_size"] == 2 and a["steps"] == 12
    for ra, rb in zip(a["ranks"], b["ranks"]):
        assert ra["params_held"] == rb["params_held"] and ra["peak_memory_bytes"] == rb["peak_memory_bytes"]
        assert ra["peak_memory_bytes"] > 4 * ra["params_held"]  # at least the parameters themselves
        assert ra["bytes_sent_per_step"] > 0
    # Each rank holds a strict part of the model (coverage 0.5).
    assert all(r["params_held"] < a["full_model_params"] for r in a["ranks"])

    def losses(run: str) -> list[float]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(l)["train/loss"] for l in lines if "train/loss" in l]

    assert losses("local") == losses("torchrun") and len(losses("local")) == 3

    # The console shows the progress lines and the final summary table.
    assert "union model: accuracy" in local.stdout and "bytes sent/step" in local.stdout

    # TensorBoard: global series on rank 0, one sub-directory per rank, the plan as an image.
    tb = tmp_path / "local" / "tensorboard"
    acc = _events(tb)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [4, 8, 12]
    assert [round(e.value, 5) for e in loss] == [round(v, 5) for v in losses("local")]
    for tag in ("train/lr", "train/samples_per_s", "train/step_time_s", "eval/accuracy"):
        assert tag in acc.Tags()["scalars"], tag
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [6, 12]
    assert {"plan/ownership", "plan/ownership_matrix"} <= set(acc.Tags()["images"])
    # Axes on which runs of any coverage overlay: samples seen (2 ranks x 16 a step) and training
    # FLOPs (the plan's, counted on meta by the planner: 2 ranks x the mean rank's share of the full step).
    from subnetdp.plan.report import plan_report
    from tests.helpers import plugin_manager, small_config

    flops = plan_report(small_config(*COMMON[2:]), 2, plugin_manager(), estimate=True, only_rank=0)["flops"]
    per_step = 2 * flops["train_step"] * flops["full_train_step"]
    assert [(e.step, e.value) for e in acc.Scalars("train/samples_seen")] == [(s, s * 32) for s in (4, 8, 12)]
    assert [e.value for e in acc.Scalars("train/flops")] == pytest.approx([s * per_step for s in (4, 8, 12)], rel=1e-6)
    by_samples, by_flops = acc.Scalars("by_samples/train_loss"), acc.Scalars("by_mflops/train_loss")
    assert [e.step for e in by_samples] == [128, 256, 384] and [e.step for e in by_flops] == [round(s * per_step / 1e6) for s in (4, 8, 12)]
    assert [e.value for e in by_samples] == [e.value for e in by_flops] == [e.value for e in loss]
    assert [e.step for e in acc.Scalars("by_samples/eval_accuracy")] == [192, 384]
    # Owner counts as a histogram over the 8 units (each held by exactly one of the 2 ranks at C = 0.5),
    # and a table; no scalar whose step axis is the unit index.
    hist = acc.Histograms("plan/owner_counts")[0].histogram_value
    assert (hist.num, hist.min, hist.max, hist.sum) == (8, 1, 1, 8)
    assert "plan/owner_count_by_unit" not in acc.Tags()["scalars"]
    assert "plan/owners_by_unit/text_summary" in acc.Tags()["tensors"]
    for r in range(2):
        per_rank = _events(tb / f"rank_{r}")
        mem = per_rank.Scalars("rank/peak_memory_bytes")
        # Once, at the step that measured it (train.memory_step=2), not at every log step.
        assert [(e.step, e.value) for e in mem] == [(2, a["ranks"][r]["peak_memory_bytes"])]
        assert [(e.step, e.value) for e in per_rank.Scalars("rank/coverage")] == [(0, 0.5)]
        assert per_rank.Scalars("rank/bytes_sent_per_step")[-1].value > 0
    assert (tmp_path / "local" / "config.yaml").read_text().count("coverage: 0.5") == 1
    plan = json.loads((tmp_path / "local" / "plan.json").read_text())
    assert plan["digest"] == a["plan_digest"] and len(plan["units"]) == 8

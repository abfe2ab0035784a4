"""Every registered plugin of every kind builds from its defaults and runs two steps."""

from __future__ import annotations

import math

import pytest
import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.loop import train
from tests.helpers import plugin_manager, small_config

PM = plugin_manager()
CASES = [(kind, name) for kind, reg in PM.registries.items() for name in reg.names()]


def test_every_kind_has_builtin_plugins():
    kinds = {k for k, _ in CASES}
    assert kinds == {"masker", "comm", "model", "data"}
    assert {"cyclic", "local", "gloo", "resnet", "digits", "synthetic"} <= {n for _, n in CASES}


@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_plugin_runs_two_steps(kind, name, tmp_path):
    overrides = [f"{kind}.name={name}", "train.steps=2", "train.batch_size=8", "masker.coverage=1",
                 "eval.batches=1", "eval.batch_size=32", f"run.name={kind}-{name}"]
    if kind != "comm":
        overrides.append("comm.name=local")
    if kind != "model":
        overrides.append("model.variant=resnet18")
    overrides += PM.registries[kind].get(name).conformance_overrides(tmp_path)
    cfg = small_config(*overrides, recipe=None, run_dir=tmp_path)
    run = train(cfg, LaunchEnv(), PM)
    assert run.step == 2
    assert run.summary["ranks"][0]["params_held"] == run.summary["full_model_params"]
    assert run.eval_metrics and all(math.isfinite(v) for v in run.eval_metrics.values())
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert (tmp_path / f"{kind}-{name}" / "summary.json").exists()

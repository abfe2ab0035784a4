"""Every registered plugin of every kind builds from its defaults and runs two steps.

Models and datasets are paired by the kind of data they deal in, the class attribute ``data_kind``
(``"image"`` when absent; ``"tokens"`` for language models and token shards): a model plugin runs on
a dataset of its kind, a dataset plugin under a model of its kind, everything else on resnet + digits.
"""

from __future__ import annotations

import math

import pytest
import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import ConfigError
from subnetdp.train.loop import train
from tests.helpers import plugin_manager, small_config

PM = plugin_manager()
CASES = [(kind, name) for kind, reg in PM.registries.items() for name in reg.names()]
DEFAULT = {"model": "resnet", "data": "digits"}


def data_kind(kind: str, name: str) -> str:
    return getattr(PM.get(kind, name), "data_kind", "image")


def first_of(kind: str, want: str) -> str:
    names = [DEFAULT[kind]] + PM.registries[kind].names()
    found = [n for n in names if data_kind(kind, n) == want]
    assert found, f"no {kind} plugin deals in '{want}' data to pair with"
    return found[0]


def pair_for(kind: str, name: str) -> tuple[str, str]:
    """The (model, data) a plugin of ``kind`` runs with."""
    if kind == "model":
        return name, first_of("data", data_kind("model", name))
    if kind == "data":
        return first_of("model", data_kind("data", name)), name
    return DEFAULT["model"], DEFAULT["data"]


def test_every_kind_has_builtin_plugins():
    kinds = {k for k, _ in CASES}
    assert kinds == {"masker", "comm", "model", "data"}
    assert {"cyclic", "local", "gloo", "resnet", "digits", "synthetic", "llama", "tokens", "swin", "cifar10",
            "cifar100", "imagenet"} <= {n for _, n in CASES}


@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_plugin_runs_two_steps(kind, name, tmp_path):
    overrides = [f"{kind}.name={name}", "train.steps=2", "train.batch_size=8", "masker.coverage=1",
                 "eval.batches=1", "eval.batch_size=32", f"run.name={kind}-{name}"]
    if kind != "comm":
        overrides.append("comm.name=local")
    model, data = pair_for(kind, name)
    overrides += [f"model.name={model}", f"data.name={data}"]
    if model == "resnet":
        overrides.append("model.variant=resnet18")
    overrides += PM.get("model", model).conformance_overrides(tmp_path)
    overrides += PM.get("data", data).conformance_overrides(tmp_path)
    cfg = small_config(*overrides, recipe=None, run_dir=tmp_path)
    if (kind, name) == ("comm", "nccl") and not torch.cuda.is_available():
        # Without a GPU, nccl must refuse clearly, before any process group (run on a GPU otherwise).
        with pytest.raises(ConfigError, match=r"comm.name='nccl': needs one CUDA GPU per process.*comm.name=gloo"):
            train(cfg, LaunchEnv(), PM)
        return
    run = train(cfg, LaunchEnv(), PM)
    assert run.step == 2
    assert run.summary["ranks"][0]["params_held"] == run.summary["full_model_params"]
    assert run.eval_metrics and all(math.isfinite(v) for v in run.eval_metrics.values())
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert (tmp_path / f"{kind}-{name}" / "summary.json").exists()

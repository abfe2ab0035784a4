"""Every registered plugin of every kind builds from its defaults and runs two steps.

Every registered masker is also planned below full coverage (C < 1) for W in {2, 4, 8}, where a
masker has real choices to make, and checked valid, pure (same inputs, same plan) and stable (the
same digest in another process). A communicator that cannot run on this machine is skipped with
its reason, never reported as passed.

Models and datasets are paired by the kind of data they deal in, the class attribute ``data_kind``
(declared on the base classes: ``"image"`` by default; ``"tokens"`` for language models and token shards): a model plugin runs on
a dataset of its kind, a dataset plugin under a model of its kind, everything else on resnet + digits.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import ConfigError
from subnetdp.core.plan import MaskPlan, make_plan
from subnetdp.train.loop import train
from subnetdp.train.setup import build_plan
from tests.helpers import plugin_manager, small_config

PM = plugin_manager()
CASES = [(kind, name) for kind, reg in PM.registries.items() for name in reg.names()]
DEFAULT = {"model": "resnet", "data": "digits"}


def data_kind(kind: str, name: str) -> str:
    return PM.get(kind, name).data_kind


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
    if (kind, name) == ("comm", "nccl") and not torch.cuda.is_available():
        pytest.skip("comm.name=nccl needs one CUDA GPU per process; this machine has none "
                    "(its refusal is tested by test_nccl_refuses_clearly_without_a_gpu)")
    cfg = small_config(*overrides, recipe=None, run_dir=tmp_path)
    run = train(cfg, LaunchEnv(), PM)
    assert run.state.step == 2
    assert run.result.summary["ranks"][0]["params_held"] == run.result.summary["full_model_params"]
    assert run.result.eval_metrics and all(math.isfinite(v) for v in run.result.eval_metrics.values())
    assert all(torch.isfinite(p).all() for p in run.state.model.parameters())
    assert (tmp_path / f"{kind}-{name}" / "summary.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: nccl runs in test_plugin_runs_two_steps")
def test_nccl_refuses_clearly_without_a_gpu(tmp_path):
    # Without a GPU, nccl must refuse clearly, before any process group.
    cfg = small_config("comm.name=nccl", "train.steps=2", "masker.coverage=1", recipe=None, run_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"comm.name='nccl': needs one CUDA GPU per process.*comm.name=gloo"):
        train(cfg, LaunchEnv(), PM)


MASKERS = PM.registries["masker"].names()
WORLDS = (2, 4, 8)
COVERAGES = (0.5, 0.25)


def masker_partitions() -> dict[str, object]:
    """ResNet-18's partitions: 8 blocks in 4 stages, and 8 hidden ranges per layer at neuron level."""
    out = {}
    for granularity in ("block", "neuron"):
        cfg = small_config(f"masker.granularity={granularity}", "masker.coverage=1", recipe=None)
        out[granularity] = build_plan(cfg, 1, PM)[4]
    return out


def sub_unity_plans() -> dict[str, MaskPlan]:
    """Every masker's plan at each granularity, W in WORLDS and C < 1 (C W >= 1: every unit can be owned)."""
    plans = {}
    for granularity, partition in masker_partitions().items():
        for name in MASKERS:
            for world in WORLDS:
                for coverage in (c for c in COVERAGES if c * world >= 1):
                    cfg = small_config(f"masker.name={name}", f"masker.coverage={coverage}",
                                       f"masker.granularity={granularity}", recipe=None).masker
                    plans[f"{name}/{granularity}/W={world}/C={coverage}"] = (
                        make_plan(PM.registries["masker"].create(name, cfg), partition, world, seed=3), partition)
    return plans


def test_every_masker_plans_validly_purely_and_stably_below_full_coverage():
    first, again = sub_unity_plans(), sub_unity_plans()  # fresh maskers, fresh partitions
    assert {k.split("/")[0] for k in first} == set(MASKERS)
    for key, (plan, partition) in first.items():
        n = len(partition.units)
        plan.validate(min_owners=1)
        assert plan.num_units == n and plan.world_size == int(key.split("W=")[1].split("/")[0]), key
        for owned in plan.owned:
            assert owned == sorted(set(owned)) and all(0 <= u < n for u in owned), key
        assert all(len(owned) < n for owned in plan.owned), f"{key}: a rank holds the whole model below C = 1"
        assert all(plan.owners(u) for u in range(n)), key
        assert again[key][0].owned == plan.owned, f"{key}: the same inputs gave another plan"
        assert MaskPlan.from_dict(json.loads(plan.to_json())).digest() == plan.digest(), key
    # Stable: another interpreter (another hash seed) draws the same plans.
    code = ("import json; from tests.plugins.test_conformance import sub_unity_plans; "
            "print(json.dumps({k: p.digest() for k, (p, _) in sub_unity_plans().items()}))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert theirs == {k: p.digest() for k, (p, _) in first.items()}

"""Activation checkpointing, bf16 and compile change memory or speed, not what is learned; bad
combinations fail with the key, the value and a fix before any process group exists."""

from __future__ import annotations

import pytest
import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import ConfigError
from subnetdp.train.loop import train_loop
from subnetdp.train.setup import preflight, set_threads, setup
from subnetdp.plan.report import plan_report
from subnetdp.parallel.checkpointing import checkpointed_positions
from subnetdp.parallel.compile import compile_problem
from tests.helpers import plugin_manager, small_config

LLAMA = ("comm.name=local", "masker.coverage=1", "train.steps=3", "train.batch_size=4", "data.seq_len=32",
         "data.stdlib_max_mb=0.5", "eval.batches=1", "optim.name=adamw", "optim.lr=1e-3", "train.memory_step=2")


def _run(tmp_path, *overrides: str, recipe: str = "llama_tiny_stdlib") -> tuple[dict, dict, dict]:
    """Train on one process; return parameters, buffers and rank 0's summary."""
    cache = [f"data.cache_dir={tmp_path / 'data'}"] if recipe.startswith("llama") else []
    cfg = small_config(*cache, *overrides, recipe=recipe, run_dir=tmp_path / "runs")
    env = LaunchEnv(0, 1, 0, 1, "test")
    set_threads(cfg, env)
    ctx, state = setup(cfg, env, plugin_manager())
    try:
        result = train_loop(ctx, state)
    finally:
        ctx.comm.shutdown()
    params = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in state.model.named_buffers()}
    return params, buffers, result.summary["ranks"][0]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_activation_checkpointing_changes_memory_not_results(tmp_path):
    plain, _, mem = _run(tmp_path, *LLAMA, "run.name=plain")
    ac, _, mem_ac = _run(tmp_path, *LLAMA, "run.name=ac", "train.activation_checkpointing=1")
    _same(plain, ac)
    assert mem_ac["activation_checkpointing"] == 4 and mem["activation_checkpointing"] == 0  # the tiny LLaMA's 4 blocks
    assert mem_ac["peak_memory_bytes"] < 0.9 * mem["peak_memory_bytes"], (mem_ac["peak_memory_bytes"], mem["peak_memory_bytes"])
    # `subnetdp plan` dry-runs the checkpointed step too: its estimate is what the loop measured.
    cfg = small_config(f"data.cache_dir={tmp_path / 'data'}", *LLAMA, "train.activation_checkpointing=1",
                       recipe="llama_tiny_stdlib", run_dir=tmp_path / "runs")
    est = plan_report(cfg, 1, plugin_manager())["ranks"][0]["peak_memory_bytes"]
    assert abs(est / mem_ac["peak_memory_bytes"] - 1) < 0.05, (est, mem_ac["peak_memory_bytes"])
    # ResNet: BatchNorm's running statistics are updated once per step, not again by the recomputation.
    resnet = ("comm.name=local", "masker.coverage=1", "train.steps=2", "train.batch_size=8", "eval.batches=1")
    p0, b0, _ = _run(tmp_path, *resnet, "run.name=r0", recipe="resnet18_digits")
    p2, b2, summary = _run(tmp_path, *resnet, "run.name=r2", "train.activation_checkpointing=2", recipe="resnet18_digits")
    assert summary["activation_checkpointing"] == 4  # 2nd, 4th, 6th and 8th of ResNet-18's 8 blocks
    _same(p0, p2)
    _same(b0, b2)


def test_checkpointed_positions():
    assert checkpointed_positions(5, 0) == []
    assert checkpointed_positions(5, 1) == [0, 1, 2, 3, 4]
    assert checkpointed_positions(5, 2) == [1, 3]
    assert checkpointed_positions(2, 3) == []


def test_bf16_autocast_trains_fp32_parameters_close_to_fp32(tmp_path):
    fp32, _, _ = _run(tmp_path, *LLAMA, "run.name=fp32")
    bf16, _, summary = _run(tmp_path, *LLAMA, "run.name=bf16", "train.precision=bf16")
    assert summary["precision"] == "bf16"
    assert all(p.dtype == torch.float32 for p in bf16.values())  # master weights stay fp32
    moved = max(float((fp32[n] - bf16[n]).abs().max()) for n in fp32)
    assert 0 < moved < 2e-2, moved  # bf16 matmuls round differently, by far less than a step of training


def test_compile_of_blocks_matches_eager(tmp_path):
    eager, _, _ = _run(tmp_path, *LLAMA, "run.name=eager", "train.steps=2")
    compiled, _, summary = _run(tmp_path, *LLAMA, "run.name=compiled", "train.steps=2", "train.compile=true",
                                "train.compile_backend=aot_eager")
    assert summary["compiled_blocks"] == 4
    for name, value in eager.items():
        torch.testing.assert_close(compiled[name], value, rtol=1e-5, atol=1e-6)


def test_compile_says_why_it_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no C++ compiler on PATH
    problem = compile_problem(torch.device("cpu"), "inductor")
    assert problem and "C++ compiler" in problem
    assert compile_problem(torch.device("cpu"), "aot_eager") is None
    # Two ranks expected, one started: the error comes before the process group would wait for the other.
    cfg = small_config(*LLAMA[1:], "comm.name=gloo", "train.compile=true", f"data.cache_dir={tmp_path / 'data'}",
                       recipe="llama_tiny_stdlib", run_dir=tmp_path / "runs")
    with pytest.raises(ConfigError, match=r"train\.compile.*C\+\+ compiler.*aot_eager"):
        setup(cfg, LaunchEnv(0, 2, 0, 2, "test"), plugin_manager())


@pytest.mark.parametrize("overrides, key", [
    (("fsdp.shard_size=2", "masker.granularity=neuron"), "masker.granularity"),
    (("fsdp.shard_size=2", "masker.regime=backward"), "masker.regime"),
    (("fsdp.shard_size=2", "comm.name=mpi"), "comm.name"),
    (("fsdp.shard_size=0",), "fsdp.shard_size"),
    (("train.precision=fp16",), "train.precision"),
    (("train.activation_checkpointing=-1",), "train.activation_checkpointing"),
    (("train.compile_backend=tvm",), "train.compile_backend"),
])
def test_bad_parallel_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        small_config(*overrides)
    assert key in str(e.value)


def test_shard_size_must_divide_the_world():
    cfg = small_config("fsdp.shard_size=3")
    with pytest.raises(ConfigError, match=r"fsdp\.shard_size.*divide the world size 4.*\[1, 2, 4\]"):
        preflight(cfg, 4, plugin_manager())
    # With 2 replicas x 2 shards the plan is made over the replicas: pairs of ranks own the same units.
    plan = preflight(small_config("fsdp.shard_size=2"), 4, plugin_manager())
    assert plan.world_size == 4 and plan.owned[0] == plan.owned[1] and plan.owned[2] == plan.owned[3]
    assert plan.owned[0] != plan.owned[2]

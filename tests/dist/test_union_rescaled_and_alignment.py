"""The rescaled block-level union is the full model with its branches scaled, selected by
eval.block_union; the gradient-alignment probe's cosine is 1 at C = 1 (2 gloo ranks, LLaMA tiny)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.evaluation import evaluate_run
from subnetdp.train.loop import train_loop
from subnetdp.train.setup import setup
from subnetdp.sdp.union import assemble_union, evaluate
from subnetdp.plugins.data.tokens import TokensConfig, TokensData
from tests.helpers import plugin_manager, run_ranks, small_config

STEPS = 4


def _config(init_method: str, cache: str, *overrides: str):
    return small_config(f"train.steps={STEPS}", "train.batch_size=4", "data.seq_len=32", "data.stdlib_max_mb=0.5",
                        f"data.cache_dir={cache}", "eval.batches=2", "eval.every=0", "optim.lr=3e-3",
                        "train.memory_step=1", f"comm.init_method={init_method}", *overrides,
                        recipe="llama_tiny_stdlib", run_dir=init_method.removeprefix("file://") + "-runs")


def _scaled_by_hooks(union, adapter, scale: float):
    """The union with every residual branch's output multiplied by ``scale`` (independently of the fold)."""
    for modules in adapter.residual_branches(union).values():
        for m in modules:
            m.register_forward_hook(lambda mod, args, out: out * scale)
    return union


def _worker(rank: int, world: int, init_method: str, cache: str) -> dict:
    pm = plugin_manager()
    env = LaunchEnv(rank, world, rank, world, "test")
    cfg = _config(init_method, cache, "masker.coverage=0.5", "eval.breakdown=true", "train.grad_alignment_every=2",
                  "run.name=sdp")
    ctx, st = setup(cfg, env, pm)
    out: dict = {}
    try:
        result = train_loop(ctx, st)
        out["eval"], out["eval_union"], out["alignment"] = result.eval_metrics, result.eval_union, result.alignment
        # collective: the union model once more, evaluated here with hook-scaled branches.
        union = assemble_union(ctx.adapter, ctx.spec, int(cfg.seed), st.partition, st.plan, st.model, st.pmap, ctx.comm)
        if union is not None:
            out["x1"] = evaluate(union, ctx.adapter, ctx.data, cfg)
            out["hooked"] = evaluate(_scaled_by_hooks(union, ctx.adapter, 0.5), ctx.adapter, ctx.data, cfg)
        key = copy.deepcopy(ctx.cfg)  # the run's context is frozen: evaluate under a copy with another key
        OmegaConf.set_readonly(key, False)
        OmegaConf.update(key, "eval.block_union", "x1")
        out["key_x1"] = evaluate_run(dataclasses.replace(ctx, cfg=key), st, STEPS + 1).metrics  # collective
        out["run_dir"] = str(ctx.run_dir)
    finally:
        ctx.comm.shutdown()
    cfg1 = _config(init_method + "-c1", cache, "masker.coverage=1", "train.grad_alignment_every=1", "run.name=c1")
    ctx1, st1 = setup(cfg1, env, pm)
    try:
        out["alignment_c1"] = train_loop(ctx1, st1).alignment
    finally:
        ctx1.comm.shutdown()
    return out


def test_rescaled_union_and_probe(tmp_path):
    cache = tmp_path / "data"
    TokensData(TokensConfig(root="stdlib", cache_dir=str(cache), stdlib_max_mb=0.5), seed=0).check()
    r0 = run_ranks(_worker, 2, tmp_path, str(cache), timeout=300)[0]

    ev = r0["eval_union"]
    assert ev["block_union"] == "rescaled" and ev["rescaled"]
    assert ev["branch_keep_rates"] == {f"layers.{i}": 0.5 for i in range(4)}  # each block on 1 of 2 ranks
    # The rescaled union (folded into the weights) is the full model with its branches scaled ...
    assert ev["union_rescaled"]["loss"] == pytest.approx(r0["hooked"]["loss"], rel=1e-5)
    assert ev["union_x1"]["loss"] == pytest.approx(r0["x1"]["loss"], rel=1e-6)
    assert abs(ev["union_x1"]["loss"] - ev["union_rescaled"]["loss"]) > 1e-4  # and the two differ
    # ... it is what the default key reports, and eval.block_union=x1 selects the plain union.
    assert r0["eval"] == ev["union_rescaled"]
    assert r0["key_x1"]["loss"] == pytest.approx(r0["x1"]["loss"], rel=1e-6)
    own = ev["own_subnetworks"]
    assert [o["owned"] for o in own] == [[0, 1], [2, 3]] and all(o["metrics"]["loss"] > 0 for o in own)
    summary = json.loads((Path(r0["run_dir"]) / "summary.json").read_text())
    assert summary["eval_union"]["block_union"] == "rescaled" and summary["grad_alignment"] == r0["alignment"]

    # The probe: steps 2 and 4 at C = 0.5 (a real angle), every step at C = 1 (cosine 1).
    assert [a["step"] for a in r0["alignment"]] == [2, 4]
    assert all(-1.0 <= a["cosine"] < 0.999 for a in r0["alignment"])
    c1 = r0["alignment_c1"]
    assert [a["step"] for a in c1] == [2, 3, 4]  # step 1 is the memory-measured one
    for a in c1:
        assert a["cosine"] == pytest.approx(1.0, abs=1e-5) and a["norm_ratio"] == pytest.approx(1.0, abs=1e-4)

"""``train.flop_matched``: a plan's training FLOPs, counted on ``meta``, set the step count (real gloo ranks).

Two ranks at C = 0.5 train the tiny LLaMA for ``train.steps=6`` FLOP-matched: they must train
``round(6 / r)`` steps, ``r`` the plan's training-FLOP ratio, and say so at the start; the stretched cosine schedule must end
at the learning rate the unstretched one ends at; the summary records both counts; and a run resumed
from the FLOP-matched run's step-4 checkpoint must continue the same schedule to the same tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf

from subnetdp.core.contracts import LaunchEnv
from subnetdp.sdp.flops import plan_flops
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.loop import train
from subnetdp.train.optim import build_schedule
from subnetdp.train.setup import build_plan
from tests.helpers import digest, plugin_manager, run_ranks, small_config

BASE = ("train.batch_size=2", "data.seq_len=32", "masker.coverage=0.5", "train.steps=6", "train.flop_matched=true",
        "train.log_every=1", "optim.schedule=cosine", "eval.every=0", "eval.batches=1", "checkpoint.enabled=true",
        "checkpoint.every=4", "checkpoint.keep=0", "run.name=fm")


def _config(run_dir: Path, *extra: str, init_method: str = "file:///unused"):
    return small_config(*BASE, f"comm.init_method={init_method}", *extra, recipe="llama_tiny_stdlib", run_dir=run_dir)


def _train(rank: int, world: int, init_method: str, run_dir: str, extra: tuple[str, ...]) -> dict:
    cfg = _config(Path(run_dir), *extra, init_method=init_method)
    ctx, state, result = train(cfg, LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
    return {"steps": ctx.steps, "asked": ctx.cfg.train.steps, "summary": result.summary, "lr": state.optimizer.param_groups[0]["lr"],
            "params": {n: digest(p) for n, p in state.model.named_parameters()}}


def test_flop_matched_steps_schedule_summary_and_resume(tmp_path, capfd):
    first = run_ranks(_train, 2, tmp_path, str(tmp_path / "a"), ())
    started = capfd.readouterr().out  # the spawned ranks write to the same file descriptors
    cfg = _config(tmp_path / "x")
    data, spec, adapter, full, partition, plan = build_plan(cfg, 2, plugin_manager())
    ratio = plan_flops(adapter, full, partition, plan, cfg.masker, data.example_batch(spec, 2)).train_step
    matched = round(6 / ratio)
    assert 0 < ratio < 1 and matched > 6
    # The run says at its start how many steps it will train, once (rank 0).
    assert started.count(f"train.flop_matched: 6 -> {matched} steps") == 1, started[-2000:]
    for r in first:
        assert r["steps"] == r["summary"]["steps"] == matched
        assert r["asked"] == 6  # the matched count is the context's: the config says what was asked for
        assert r["summary"]["flop_matched"] == {"steps_requested": 6, "steps": matched, "train_flop_ratio": ratio}
    stored = OmegaConf.load(tmp_path / "a" / "fm" / "config.yaml")
    assert stored.train.steps == 6 and stored.train.flop_matched and stored.run.name == "fm"
    # The stretched schedule ends where the unstretched one does (cosine to zero at its last step).
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=float(cfg.optim.lr))
    plain = build_schedule(cfg.optim, opt, 6, start=6)
    assert first[0]["lr"] == plain.get_last_lr()[0]
    # Resumed from step 4 of the FLOP-matched run: the same schedule, the same tensors.
    resumed_dir = tmp_path / "b" / "fm"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(ck.step_dir(tmp_path / "a" / "fm", 4), ck.step_dir(resumed_dir, 4))
    second = run_ranks(_train, 2, tmp_path, str(tmp_path / "b"), ("resume=auto",))
    lrs = [{(m["step"], m["train/lr"]) for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
            if "train/lr" in m and m["step"] > 4} for d in (tmp_path / "a" / "fm", resumed_dir)]
    assert lrs[0] == lrs[1] and len(lrs[0]) == matched - 4
    assert [r["params"] for r in second] == [r["params"] for r in first]

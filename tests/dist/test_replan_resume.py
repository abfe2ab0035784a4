"""Resuming a unit-keyed checkpoint on another world size, coverage and masker (real gloo ranks).

One checkpoint is written by 4 ranks at C = 0.5 (ResNet-18 on digits, neuron-level, AdamW, so the
local layouts merge neighbouring units and every piece carries exp_avg, exp_avg_sq and a step). It
is resumed by 4 ranks at C = 0.75, by 2 ranks with the random masker and by 8 ranks. Each resumed
rank hands back digests of every parameter piece it holds and of that piece's optimizer state
right after loading; they must equal the checkpoint's, bit for bit, for exactly the pieces of the
rank's new units. Each resumed run then trains on. The checkpoint itself holds every piece once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import PlanError
from subnetdp.sdp.pieces import LocalIndex, global_items
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints.checkpointer import Checkpointer
from subnetdp.train.checkpoints.source import optimizer_params
from subnetdp.train.checkpoints.units import OPTIM, SCALAR, PieceReader, item_key, writers
from subnetdp.train.loop import train_loop
from subnetdp.train.setup import build_plan, set_threads, setup
from tests.helpers import digest, plugin_manager, run_ranks, small_config

STEPS = 2
BASE = ("masker.granularity=neuron", "optim.name=adamw", "optim.lr=1e-3", "optim.schedule=constant",
        "train.batch_size=4", "eval.every=0", "eval.batches=1", "checkpoint.enabled=true")


def _config(init_method: str, *overrides: str):
    return small_config(*BASE, f"comm.init_method={init_method}", *overrides,
                        run_dir=init_method.removeprefix("file://") + "-runs")


def _resumed_digests(cfg, rank: int, world: int) -> dict:
    """Resume ``cfg`` as the loop does, digest what this rank loaded, then train on with the loop."""
    env = LaunchEnv(rank, world, rank, world, "test")
    pm = plugin_manager()
    set_threads(cfg, env)
    ctx, st = setup(cfg, env, pm)
    try:
        loader = ctx.data.train_loader(rank, world, int(cfg.train.batch_size))
        ckpt = Checkpointer(ctx, st, loader)
        step = ckpt.start()  # collective
        index = LocalIndex(st.model, st.pmap)
        state = dict(zip(ckpt._local_names(), (st.optimizer.state[p] for p in optimizer_params(st.optimizer))))
        pieces = {}
        for it in global_items(st.partition, st.plan):
            if rank not in it.owners:
                continue
            local, dim, start, stop = index.find(it)
            cut = (lambda t: t) if dim is None else (lambda t: t.narrow(dim, start, stop - start))
            key = item_key(it)
            pieces[key] = digest(cut(index.tensors[local]))
            for k, v in state[local].items():
                whole = v.dim() == 0
                pieces[f"{SCALAR if whole else OPTIM}{k}/{key}"] = digest(v if whole else cut(v))
        loaded = {"step": step, "pieces": pieces, "loader": loader.state_dict(), "owned": st.plan.owned[rank],
                  "lr": st.optimizer.param_groups[0]["lr"]}
        result = train_loop(ctx, st)  # resumes again from the same checkpoint and trains on
        loaded.update(final_step=st.step, loss=float(result.summary["loss"]) if "loss" in result.summary else None)
        return loaded
    finally:
        ctx.comm.shutdown()


def _write_then_resume(rank: int, world: int, init_method: str) -> dict:
    from subnetdp.train.loop import train

    cfg = _config(init_method, "run.name=w4", f"train.steps={STEPS}", "checkpoint.final=always")
    run = train(cfg, LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
    saved = {"dir": str(ck.step_dir(run.context.run_dir, STEPS))}
    resumed = _resumed_digests(_config(init_method + "-c75", "run.name=c75", "masker.coverage=0.75",
                                       f"train.steps={STEPS + 1}", f"resume={saved['dir']}"), rank, world)
    return {"saved": saved, "resumed": resumed}


def _resume(rank: int, world: int, init_method: str, ckpt_dir: str, *extra: str) -> dict:
    return _resumed_digests(_config(init_method, "run.name=re", f"train.steps={STEPS + 1}", f"resume={ckpt_dir}",
                                    *extra), rank, world)


def _checkpoint_digests(ckpt: Path) -> dict[str, str]:
    out = {}
    for f in sorted(ckpt.glob("pieces_*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = digest(st.get_tensor(k))
    return out


def _assert_loaded_exactly(results: list[dict], saved: dict[str, str], world: int) -> None:
    for rank, res in enumerate(results):
        assert res["step"] == STEPS and res["final_step"] == STEPS + 1, rank
        assert res["pieces"], rank
        for key, d in res["pieces"].items():
            assert saved[key] == d, (rank, key)
        # exactly its units' pieces: every parameter piece it holds, each with AdamW's three states
        n_params = sum(1 for k in res["pieces"] if "/" not in k)
        assert len(res["pieces"]) == 4 * n_params, rank
    owned = [set(r["owned"]) for r in results]
    assert set().union(*owned) == set(range(max(max(o) for o in owned) + 1))  # every unit has an owner
    assert len(results) == world


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("replan")
    results = run_ranks(_write_then_resume, 4, tmp, timeout=600)
    return Path(results[0]["saved"]["dir"]), results


def test_checkpoint_holds_every_piece_once_and_resumes_at_higher_coverage(written):
    ckpt, results = written
    manifest = ck.read_manifest(ckpt)
    cfg = small_config(*BASE)
    *_, partition, plan = build_plan(cfg, 4, plugin_manager())
    keys = [item_key(it) for it in global_items(partition, plan)]
    assert sorted(manifest["pieces"]) == sorted(keys) and len(set(keys)) == len(keys)  # each piece indexed once
    stored = _checkpoint_digests(ckpt)
    params = [k for k in stored if "/" not in k]
    assert sorted(params) == sorted(keys)  # ... and stored once, in exactly one file
    # Bytes: the parameter pieces add up to the model exactly, and no rank writes much more than 1/W.
    per_file = {f.name: 0 for f in ckpt.glob("pieces_*.safetensors")}
    total = 0
    for f in ckpt.glob("pieces_*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                per_file[f.name] += t.numel() * t.element_size()
                if "/" not in k:
                    total += t.numel() * t.element_size()
    param_names = set(partition.shared) | {s.name for u in partition.units for s in u.slices}
    assert total == sum(4 * _numel(partition.shapes[n]) for n in param_names)  # fp32
    largest = max(it.numel * 4 for it in global_items(partition, plan)) * 3
    assert len(per_file) == 4 and max(per_file.values()) <= sum(per_file.values()) / 4 + largest
    on_disk = sum(e["bytes"] for e in manifest["files"].values())
    print(f"\nW=4 C=0.5 checkpoint: {on_disk:,} bytes on disk; pieces per writer {sorted(per_file.values())}; "
          f"parameters {total:,} bytes (each once)")
    assert set(writers(partition, plan).values()) == {0, 1, 2, 3}
    # Resumed by 4 ranks at C = 0.75: each rank holds more units than it wrote, loaded bit for bit.
    resumed = [r["resumed"] for r in results]
    assert all(len(r["owned"]) > len(plan.owned[i]) for i, r in enumerate(resumed))
    _assert_loaded_exactly(resumed, stored, 4)
    assert all(r["loader"] == {"epoch": 0, "batch": STEPS} for r in resumed)  # same world: its own position


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_resume_on_two_ranks_with_another_masker_and_on_eight(written, tmp_path):
    ckpt, _ = written
    stored = _checkpoint_digests(ckpt)
    two = run_ranks(_resume, 2, tmp_path, str(ckpt), "masker.name=random", timeout=600)
    _assert_loaded_exactly(two, stored, 2)
    # 4 ranks drew 2 batches of 4 each: 32 samples, 4 batches of the 2 ranks' 8 per step.
    assert all(r["loader"]["batch"] == 4 for r in two)
    eight = run_ranks(_resume, 8, tmp_path, str(ckpt), timeout=600)
    _assert_loaded_exactly(eight, stored, 8)
    assert all(r["loader"]["batch"] == 1 for r in eight)


def test_a_resume_that_leaves_a_unit_unowned_is_refused_with_the_smallest_fix():
    # The plan is made before any process group, resuming or not: 1 rank at C = 0.5 owns half.
    cfg = small_config(*BASE, "resume=auto", "run.name=x")
    with pytest.raises(PlanError) as e:
        build_plan(cfg, 1, plugin_manager())
    msg = str(e.value)
    assert "the smallest masker.coverage that works with 1 ranks is 1" in msg, msg
    assert "masker.coverage=0.5 works from 2 ranks on" in msg, msg


# ---------------------------------------------------------------- block level: keep rates that rise
BLOCK = ("masker.granularity=block", "masker.coverage=0.5", "train.batch_size=8", "eval.every=0", "eval.batches=1",
         "checkpoint.enabled=true", "optim.schedule=constant")
WATCHED = "layer1.0.bn2"  # a residual branch's output layer (its BatchNorm's affine weight and bias)


def _block_resume(rank: int, world: int, init_method: str, ckpt_dir: str, block_union: str) -> dict:
    """Resume the C = 0.5 checkpoint at C = 1; the first forward's loss on this rank's next batch, and
    the union model of the same checkpoint (as ``subnetdp eval`` loads it) on that batch."""
    import contextlib
    import io

    from subnetdp.evaluate.export import load_union

    cfg = small_config(*BLOCK, f"comm.init_method={init_method}", "masker.coverage=1", f"eval.block_union={block_union}",
                       f"train.steps={STEPS + 1}", f"resume={ckpt_dir}", "run.name=c1",
                       run_dir=init_method.removeprefix("file://") + "-runs")
    env = LaunchEnv(rank, world, rank, world, "test")
    pm = plugin_manager()
    set_threads(cfg, env)
    ctx, st = setup(cfg, env, pm)
    try:
        loader = ctx.data.train_loader(rank, world, int(cfg.train.batch_size))
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            Checkpointer(ctx, st, loader).start()  # collective
        batch = next(iter(loader))
        st.model.train()
        with torch.no_grad():
            loss = float(ctx.adapter.training_loss(st.model, batch))
            union = load_union(ckpt_dir, pm)  # eval.block_union=rescaled, as the checkpoint's run evaluated it
            union.model.train()
            union_loss = float(ctx.adapter.training_loss(union.model, batch))
        bn = st.model.get_submodule(WATCHED)
        return {"loss": loss, "union_loss": union_loss, "scales": union.branch_scales, "said": said.getvalue(),
                "weight": bn.weight.detach().clone(), "bias": bn.bias.detach().clone(),
                "momentum": st.optimizer.state[bn.weight]["momentum_buffer"].clone()}
    finally:
        ctx.comm.shutdown()


def _write_block_then_resume(rank: int, world: int, init_method: str) -> dict:
    from subnetdp.train.loop import train

    cfg = small_config(*BLOCK, f"comm.init_method={init_method}", "run.name=c05", f"train.steps={STEPS}",
                       "checkpoint.final=always", run_dir=init_method.removeprefix("file://") + "-runs")
    run = train(cfg, LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
    ckpt = str(ck.step_dir(run.context.run_dir, STEPS))
    return {mode: _block_resume(rank, world, f"{init_method}-{mode}", ckpt, mode) for mode in ("rescaled", "x1")}


def test_a_resume_that_raises_keep_rates_starts_from_the_rescaled_union(tmp_path):
    # 2 ranks at C = 0.5: every block ran in half of the training forwards; at C = 1 in all of them.
    results = run_ranks(_write_block_then_resume, 2, tmp_path, timeout=600)
    for rank, res in enumerate(results):
        rescaled, x1 = res["rescaled"], res["x1"]
        assert rescaled["scales"] and set(rescaled["scales"].values()) == {0.5}, rescaled["scales"]
        # The first forward computes what the rescaled union evaluation of the checkpoint computes.
        torch.testing.assert_close(rescaled["loss"], rescaled["union_loss"], rtol=1e-5, atol=1e-6)
        # Without the rule the full network runs every branch at x1: another function.
        print(f"\nrank {rank}: first loss at C = 1 {rescaled['loss']:.4f} (rescaled union {rescaled['union_loss']:.4f}), "
              f"{x1['loss']:.4f} with eval.block_union=x1")
        assert x1["loss"] > rescaled["loss"] + 0.1, (x1["loss"], rescaled["loss"])
        # Folded into the branch's output layer, with its momentum: x 1/2 exactly, nothing else.
        for key in ("weight", "bias", "momentum"):
            assert torch.equal(rescaled[key], x1[key] * 0.5), key
    said = results[0]["rescaled"]["said"]
    assert ("the new plan runs 8 residual branch(es) in more of the training forwards than they were trained at: "
            "layer1.0, layer1.1, layer2.0, layer2.1, layer3.0, layer3.1, layer4.0, layer4.1 (0.5 -> 1); each scaled "
            "by old/new rate") in said, said
    assert "not rescaled (eval.block_union=x1)" in results[0]["x1"]["said"]
    assert results[1]["rescaled"]["said"].count("subnetdp:") == 0  # rank 0 says it

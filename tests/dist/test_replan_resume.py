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
from safetensors import safe_open

from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import PlanError
from subnetdp.sdp.pieces import LocalIndex, global_items
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints.resume import Checkpointer
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

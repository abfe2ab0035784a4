"""Owners prove they agree: a bit flipped in one owner's tensor is caught at the next verification,
repaired by the majority with three owners, and stops the run with two (which then resumes from the
newest checkpoint, a verified one). Real gloo processes; the fault is SUBNETDP_TEST_FLIP_BIT."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path


from subnetdp.core.contracts import LaunchEnv
from subnetdp.sdp.pieces import LocalIndex, global_items
from subnetdp.sdp.verify import OwnersDisagree
from subnetdp.train.failures import log_path
from subnetdp.train.loop import train_loop
from subnetdp.train.setup import setup
from subnetdp.train.faults import FLIP_BIT
from tests.helpers import digest, plugin_manager, run_ranks, small_config


def _config(init_method: str, *overrides: str, store: str = ""):
    return small_config( "train.steps=6", "train.batch_size=8", "eval.batches=1",
                        "run.name=verify", f"comm.init_method={init_method}{store}", *overrides,
                        run_dir=init_method.removeprefix("file://") + "-runs")


def _state_digests(st, rank: int) -> dict[str, str]:
    """The bytes of every global piece this rank owns and of its optimizer state, keyed by the piece
    (neuron level: owners hold a unit at different places of differently shaped local tensors)."""
    index, out = LocalIndex(st.model, st.pmap), {}
    for it in global_items(st.partition, st.plan):
        found = index.find(it) if rank in it.owners else None
        if found is None:
            continue
        local, dim, start, stop = found
        param = index.tensors[local]
        cut = (lambda t: t) if dim is None else (lambda t: t.narrow(dim, start, stop - start))
        key = f"{it.name}[{it.dim}:{it.start}:{it.stop}]"
        out[key] = digest(cut(param))
        for k, v in st.optimizer.state[param].items():
            out[f"{key}/{k}"] = digest(v if v.dim() == 0 else cut(v))
    return out


def _run(rank: int, world: int, cfg) -> tuple[dict, str, BaseException | None]:
    """Set up and train ``cfg``; return this rank's digests, what it said on stderr and the error that ended it."""
    ctx, st = setup(cfg, LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
    said, error = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(said):
            train_loop(ctx, st)
    except OwnersDisagree as e:
        error = e
    finally:
        ctx.comm.shutdown()
        if ctx.lock is not None:
            ctx.lock.release()
    return {"digests": _state_digests(st, rank), "step": st.step, "owners": [st.plan.owners(u) for u in range(st.plan.num_units)]}, \
        said.getvalue(), error


def _log(cfg, rank: int) -> str:
    path = log_path(Path(cfg.run.dir) / str(cfg.run.name), rank)
    return path.read_text() if path.exists() else ""


def _three_owners(rank: int, world: int, init_method: str, verify_every: int) -> dict:
    # Neuron level, C = 0.75 on 4 ranks: 3 owners a unit, each holding it at its own place of a narrower
    # tensor. Rank 1 corrupts unit 2 (owners 0, 1, 3) and rank 2 the shared tensors after step 2;
    # 2 steps, verifications at steps 1 (the owners agree: nothing said) and 2 (the flips are caught).
    # Bit 16 of a float32: a low mantissa bit could be rounded away by an update before a verification.
    os.environ[FLIP_BIT] = "2:1:2:16,2:2:shared:16"
    cfg = _config(init_method, "train.steps=2", "masker.granularity=neuron", "masker.coverage=0.75", "optim.name=adamw",
                  "optim.lr=1e-3", f"recovery.verify_every={verify_every}")
    out, said, error = _run(rank, world, cfg)
    return {**out, "said": said, "error": str(error) if error else None, "log": _log(cfg, rank)}


def _two_owners(rank: int, world: int, init_method: str) -> dict:
    # verify_every larger than the run: only the checkpoints' verifications (steps 2, 4, 6) run.
    os.environ[FLIP_BIT] = "3:1:1:16"
    cfg = _config(init_method, "masker.coverage=1.0", "recovery.verify_every=100", "checkpoint.enabled=true",
                  "checkpoint.every=2", "checkpoint.keep=0", "resume=auto")
    first, said, error = _run(rank, world, cfg)
    kept = sorted(p.name for p in (Path(cfg.run.dir) / "verify" / "checkpoints").glob("step_*"))
    manifest = Path(cfg.run.dir) / "verify" / "checkpoints" / "step_00000002" / "MANIFEST.json"
    written = manifest.stat().st_mtime_ns
    del os.environ[FLIP_BIT]
    resumed, _, again = _run(rank, world, _config(init_method, "masker.coverage=1.0", "recovery.verify_every=100",
                                                  "checkpoint.enabled=true",
                                                  "checkpoint.every=2", "checkpoint.keep=0", "resume=auto",
                                                  store="-resumed"))
    after = sorted(p.name for p in (Path(cfg.run.dir) / "verify" / "checkpoints").glob("step_*"))
    return {"error": str(error) if error else None, "said": said, "log": _log(cfg, rank), "kept": kept,
            "resumed": resumed, "again": str(again) if again else None, "after": after,
            "step2_rewritten": manifest.stat().st_mtime_ns != written}


def test_a_flipped_bit_is_repaired_by_three_owners_and_the_run_goes_on(tmp_path):
    results = run_ranks(_three_owners, 4, tmp_path, 1, timeout=400)
    assert [r["error"] for r in results] == [None] * 4 and all(r["step"] == 2 for r in results)
    assert results[0]["owners"][2] == (0, 1, 3) and all(len(o) == 3 for o in results[0]["owners"])
    # Owners are bit-identical at the end, piece by piece: the odd copies were given the majority's bytes.
    pieces = {key for r in results for key in r["digests"]}
    for key in pieces:
        held = {r["digests"][key] for r in results if key in r["digests"]}
        assert len(held) == 1, key
    said = results[0]["said"]
    assert "owners disagreed after step 2, repaired by their majority" in said
    assert "unit 2: ranks [1] received it from rank 0" in said
    assert "the shared tensors: ranks [2] received it from rank 0" in said
    assert "the run goes on" in said
    for r in results:  # the detail, on every rank's log: the unit, its owners and the step, nothing else
        lines = r["log"].splitlines()
        assert len(lines) == 2, lines
        assert "owners of unit 2 (ranks [0, 1, 3]) disagree after step 2: ranks [0, 3] hold" in r["log"]
        assert "owners of the shared tensors (ranks [0, 1, 2, 3]) disagree after step 2: ranks [0, 1, 3] hold" in r["log"]


def test_a_flipped_bit_stops_two_owners_and_resume_starts_from_a_verified_checkpoint(tmp_path):
    results = run_ranks(_two_owners, 2, tmp_path, timeout=400)
    for r in results:
        # Both ranks stop with one line naming the unit, its ranks and the step; step 4 is not checkpointed.
        assert r["error"] is not None and "\n" not in r["error"]
        assert r["error"].startswith("owners disagree after step 4 with no majority to repair them "
                                     "(unit 1 on ranks [0, 1])"), r["error"]
        assert "resume=auto" in r["error"]
        assert r["kept"] == ["step_00000002"]
        assert "owners of unit 1 (ranks [0, 1]) disagree after step 4" in r["log"]
        # Resumed from step 2, the run trains to the end and its owners agree at every verification.
        assert r["again"] is None and r["resumed"]["step"] == 6
        assert r["after"] == ["step_00000002", "step_00000004", "step_00000006"]
        assert not r["step2_rewritten"]  # it went on from step 2, not from the start
    assert results[0]["resumed"]["digests"] == results[1]["resumed"]["digests"]

"""The survivors' files are checked before they are used: their run and lineage, every file, the plan.

One real run (4 gloo ranks under the plain launcher, ResNet-18 on digits at C = 0.5 with
``masker.min_owners=2``, ``seed=1``, a checkpoint at step 3) loses rank 1 in step 6: ranks 0, 2
and 3 keep step 5 in ``checkpoints/survivors``, each unit written by its lowest surviving owner.
Its console reads one line per survivor (the dead rank, the step, what it kept, the command that
continues, its log) and one from the launcher naming the logs, each of which holds the survivor's
traceback. Copies of that directory are then damaged one way each and assembled (the table), branched
from step 3 by an explicit resume, copied into another run, and evaluated after assembly.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from subnetdp.core.contracts import DataSpec
from subnetdp.evaluate.export import export, load_reference, load_union
from subnetdp.sdp.construct import meta_model
from subnetdp.sdp.variants import partition_model
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints import lineage, survivors
from tests.helpers import plugin_manager

COMMON = ["train", "resnet18_digits", "train.batch_size=4", "train.log_every=2", "eval.bn_recalibrate_batches=0",
          "eval.every=0", "optim.warmup_steps=0", "masker.coverage=0.5", "masker.min_owners=2", "seed=1",
          "launch.threads_per_rank=1", "train.progress=false", "checkpoint.keep=0", "checkpoint.every=3"]


def _run(run_dir: Path, *extra: str, nproc: int = 4, env: dict | None = None, rc: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "subnetdp", *COMMON, f"launch.nproc={nproc}", f"run.dir={run_dir.parent}",
           f"run.name={run_dir.name}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc


def _train(run_dir: Path, *extra: str, nproc: int = 4, env: dict | None = None, rc: int = 0) -> str:
    proc = _run(run_dir, *extra, nproc=nproc, env=env, rc=rc)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The source run and what its console said."""
    run = tmp_path_factory.mktemp("src") / "src"
    proc = _run(run, "train.steps=6", "resume=auto", env={ck.KILL_IN_SYNC: "6"}, rc=2)
    found = sorted(p.name for p in survivors.survivors_dir(run).iterdir())
    assert found == [f"step_00000005.rank_{r}" for r in (0, 2, 3)], found
    return run, proc


@pytest.fixture(scope="module")
def source(killed) -> Path:
    return killed[0]


def test_a_killed_worker_reads_as_one_line_per_rank_with_the_traceback_in_the_run_directory(killed):
    # The source run, under the plain launcher with no restart: everything on the console is subnetdp's own.
    run, proc = killed
    left = subprocess.run(["pgrep", "-f", f"run.dir={run.parent} "], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left running: {left}"
    console = proc.stdout + proc.stderr
    assert "Traceback" not in console and "GLHF" not in console and "printed above" not in console, console
    lines = proc.stderr.splitlines()
    for r in (0, 2, 3):  # each survivor: one line naming the dead rank, the step, what to do and its log
        mine = [line for line in lines if f"rank {r} " in line]
        assert len(mine) == 1, lines
        assert mine[0].startswith(f"subnetdp: error: rank {r} stopped in step 6: rank 1 died (the connection closed "
                                  "during all_reduce over ranks"), mine[0]
        assert f"it kept its units as of step 5 in {survivors.fragment_dir(run, 5, r)}" in mine[0]
        assert re.search(r"continue with: \S+ -m subnetdp train resnet18_digits ", mine[0]) and "resume=auto" in mine[0]
        log = run / "logs" / f"rank_{r}.log"
        assert mine[0].endswith(f"; the full error: {log}"), mine[0]
        text = log.read_text()  # the traceback, with gloo's own words for the lost connection
        said = mine[0][len("subnetdp: error: "):].rsplit("; the full error: ", 1)[0]
        assert f"\n{said}\n" in text and "Traceback (most recent call last)" in text, text
        assert "GLHF" in text and "PeerLost: rank 1 died" in text, text
    assert not (run / "logs" / "rank_1.log").exists()  # a SIGKILL leaves no word of its own
    # The launcher: who failed and how, and where their errors are; nothing else (no SIGTERM notice).
    assert lines[-1] == (f"subnetdp: error: a worker failed (rank 0: exit code 2; rank 1: killed by SIGKILL; rank 2: "
                         f"exit code 2; rank 3: exit code 2); the full errors are in {run / 'logs'} (rank_0.log, "
                         "rank_2.log, rank_3.log)"), lines
    assert len([line for line in lines if not line.startswith("subnetdp: warning: ")]) == 4, lines


def _copy(source: Path, dst: Path) -> Path:
    shutil.copytree(source, dst, ignore=shutil.ignore_patterns("logs", "tensorboard"))
    return dst


def _expected(run: Path) -> survivors.Expected:
    frag = survivors.fragment_dir(run, 5, 0)
    header = json.loads((frag / survivors.FRAGMENT).read_text())["header"]
    cfg = OmegaConf.load(frag / "config.yaml")
    adapter = plugin_manager().registries["model"].get(cfg.model.name)(cfg.model)
    spec = DataSpec(**header["data_spec"])
    partition = partition_model(adapter, meta_model(adapter, spec), cfg.masker, spec)
    return survivors.Expected(lineage.read(run), header["model"], partition)


def _record(run: Path, rank: int) -> tuple[Path, dict]:
    path = survivors.fragment_dir(run, 5, rank) / survivors.FRAGMENT
    return path, json.loads(path.read_text())


def _rewrite(run: Path, rank: int, name: str, data: bytes | None = None) -> None:
    """Give file ``name`` of rank ``rank``'s fragment new bytes (its own when None) with a record that
    matches them: only the deeper checks can tell."""
    f = survivors.fragment_dir(run, 5, rank) / name
    if data is not None:
        f.write_bytes(data)
    path, record = _record(run, rank)
    record["files"][name] = {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    path.write_text(json.dumps(record))


def _later_step(run: Path) -> None:
    old = survivors.fragment_dir(run, 5, 2)
    new = old.with_name("step_00000006.rank_2")
    old.rename(new)
    record = json.loads((new / survivors.FRAGMENT).read_text())
    record["header"]["step"] = 6
    (new / survivors.FRAGMENT).write_text(json.dumps(record))


def _other_model(run: Path) -> None:
    path, record = _record(run, 2)
    record["header"]["partition_digest"] = "0" * 16
    path.write_text(json.dumps(record))


def _wrong_shape(run: Path) -> None:
    f = survivors.fragment_dir(run, 5, 2) / "pieces_2.safetensors"
    tensors = load_file(str(f))
    from safetensors import safe_open
    with safe_open(str(f), "pt") as h:
        meta = h.metadata()
    key = max((k for k in tensors if "/" not in k), key=lambda k: tensors[k].numel())
    tensors[key] = tensors[key][:1].clone()
    save_file(tensors, str(f), metadata=meta)
    _rewrite(run, 2, "pieces_2.safetensors")


def _flip_bit(run: Path) -> None:
    f = survivors.fragment_dir(run, 5, 2) / "pieces_2.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01
    f.write_bytes(bytes(data))


def _zero_bytes(run: Path) -> None:
    _rewrite(run, 2, "pieces_2.safetensors", b"")


def _duplicated_rank(run: Path) -> None:
    # rank 2's folder copied as rank 1's (the dead rank), its record adjusted to match the folder
    dup = survivors.fragment_dir(run, 5, 1)
    shutil.copytree(survivors.fragment_dir(run, 5, 2), dup)
    record = json.loads((dup / survivors.FRAGMENT).read_text())
    record["rank"] = 1
    (dup / survivors.FRAGMENT).write_text(json.dumps(record))


def _empty_index(run: Path) -> None:
    path, record = _record(run, 2)
    record["index"] = {}
    path.write_text(json.dumps(record))


def _truncated(run: Path) -> None:
    f = survivors.fragment_dir(run, 5, 2) / "pieces_2.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _linked_record(run: Path) -> None:
    path, record = _record(run, 2)
    outside = run.parent / "elsewhere.json"
    outside.write_text(json.dumps(record))
    path.unlink()
    path.symlink_to(outside)


def _foreign_run(run: Path) -> None:  # another run's survivors' files copied in (defect 2, at this level)
    for r in (0, 2, 3):
        path, record = _record(run, r)
        record["header"]["run_id"] = "f" * 32
        path.write_text(json.dumps(record))


DAMAGE = [  # how a fragment is damaged, and what the line naming it says
    (_later_step, "step_00000006.rank_2/pieces_2.safetensors: metadata step='5', expected '6'"),
    (_other_model, "step_00000005.rank_2/FRAGMENT.json: written for another partition"),
    (_wrong_shape, "step_00000005.rank_2/pieces_2.safetensors: tensor"),
    (_flip_bit, "step_00000005.rank_2/pieces_2.safetensors: corrupted: its sha256 differs"),
    (_zero_bytes, "step_00000005.rank_2/pieces_2.safetensors: not a readable safetensors file"),
    (_duplicated_rank, "step_00000005.rank_1/rank_1.safetensors: missing from the survivor's record"),
    (_empty_index, "step_00000005.rank_2/FRAGMENT.json: its piece index does not match the plan's units"),
    (_truncated, "step_00000005.rank_2/pieces_2.safetensors: truncated"),
    (_linked_record, "step_00000005.rank_2/FRAGMENT.json: is a symbolic link"),
    (_foreign_run, "step_00000005.rank_0/FRAGMENT.json: written by run ffffffff"),
]


@pytest.mark.parametrize("damage, line", DAMAGE, ids=[d.__name__.strip("_") for d, _ in DAMAGE])
def test_a_damaged_fragment_is_named_and_the_step_skipped_down_to_the_checkpoint(source, tmp_path, damage, line):
    run = _copy(source, tmp_path / "src")
    damage(run)
    newest = ck.step_dir(run, 3)
    before = sorted(p.name for p in survivors.survivors_dir(run).iterdir())
    done = survivors.assemble(run, _expected(run), newest)
    assert done is not None and done.checkpoint is None, done
    assert any(line in s for s in done.skipped), done.skipped
    assert done.message.endswith(f"resuming from the newest complete checkpoint, {newest}"), done.message
    assert not ck.step_dir(run, 5).exists() and not list(ck.checkpoints_dir(run).glob("step_*.tmp"))
    assert sorted(p.name for p in survivors.survivors_dir(run).iterdir()) == before  # nothing removed


def test_a_full_disk_while_assembling_falls_back_and_leaves_no_leftover(source, tmp_path, monkeypatch):
    # ENOSPC is injected (SUBNETDP_TEST_NO_SPACE_IN_ASSEMBLY) after the first file is linked.
    run = _copy(source, tmp_path / "src")
    monkeypatch.setenv(ck.NO_SPACE_IN_ASSEMBLY, "5")
    done = survivors.assemble(run, _expected(run), ck.step_dir(run, 3))
    assert done is not None and done.checkpoint is None
    assert any("[Errno 28] No space left on device" in s for s in done.skipped), done.skipped
    assert "resuming from the newest complete checkpoint" in done.message
    assert not ck.step_dir(run, 5).exists()
    assert not list(ck.checkpoints_dir(run).glob("step_*.tmp"))
    assert len(list(survivors.survivors_dir(run).iterdir())) == 3


def test_an_assembled_checkpoint_is_evaluated_and_exported(source, tmp_path):
    run = _copy(source, tmp_path / "src")
    done = survivors.assemble(run, _expected(run), ck.step_dir(run, 3))
    assert done is not None and done.checkpoint == ck.step_dir(run, 5), done
    assert done.message.startswith("recovered step 5 from the surviving owners (ranks [0, 2, 3]; lost: [1])")
    manifest = ck.read_manifest(done.checkpoint)
    assert manifest["absent_ranks"] == [1] and len(manifest["lineage"]) == 1
    assert len(list(survivors.survivors_dir(run).iterdir())) == 3  # the originals stay until it has loaded
    # Each unit was written once, by its lowest surviving owner: the assembled step is no bigger
    # than a regular checkpoint's pieces.
    size = lambda d: sum(p.stat().st_size for p in d.glob("pieces_*.safetensors"))  # noqa: E731
    assert size(done.checkpoint) <= size(ck.step_dir(run, 3)) * 1.01
    loaded = load_union(done.checkpoint, plugin_manager())  # the dead rank's buffers are not asked for
    pieces = load_file(str(survivors.fragment_dir(run, 5, 0) / "pieces_0.safetensors"))
    params = dict(loaded.model.named_parameters())
    whole = [k for k in pieces if k.startswith(("conv1.", "fc.")) and k in params]  # not scaled by the union
    assert whole and all(torch.equal(params[k], pieces[k]) for k in whole)
    out = tmp_path / "export"
    export(done.checkpoint, out, recalibrate=False, pm=plugin_manager())
    ref = load_reference(out, plugin_manager())
    assert all(torch.equal(dict(ref.named_parameters())[k], pieces[k]) for k in whole)


def test_an_explicit_resume_sets_newer_survivors_files_aside_and_auto_keeps_its_branch(source, tmp_path):
    # The defect 1: survivors kept step 5; the user branches from step 3 with another learning
    # rate (writes step 4); resume=auto must continue step 4, not the abandoned branch's step 5.
    run = _copy(source, tmp_path / "src")
    out = _train(run, "train.steps=4", f"resume={ck.step_dir(run, 3)}", "optim.lr=0.005")
    aside = survivors.set_aside_dir(run)
    moved = sorted(p.name for p in aside.glob("*/step_*"))
    assert moved == [f"step_00000005.rank_{r}" for r in (0, 2, 3)], moved
    assert f"subnetdp: set aside 3 survivors' file(s) of another run or of a branch this run does not continue " \
           f"(resume={ck.step_dir(run, 3)}) in {aside}" in out, out
    branch = ck.read_manifest(ck.step_dir(run, 4))
    chain = branch["lineage"]
    start = ck.read_manifest(ck.step_dir(run, 3))["lineage"]
    assert len(chain) == 2 and chain[1]["from_step"] == 3 and chain[0] == start[0]
    assert lineage.read(run) == {"run_id": branch["run_id"], "lineage": chain}
    # The abandoned fragments put back by hand are still not this lineage's: named, skipped, not used.
    for d in aside.glob("*/step_*"):
        d.rename(survivors.survivors_dir(run) / d.name)
    out = _train(run, "train.steps=6", "resume=auto")
    assert "recovered step" not in out and f"resumed from {ck.step_dir(run, 4)} (step 4)" in out, out
    assert "is on a branch this run left when it resumed from step 3" in out, out


def test_survivors_files_of_another_run_and_damaged_ones_are_not_used(source, tmp_path):
    # Defect 2: another run's (seed=1) survivors' files copied into run X are set aside, X resumes its own.
    x, one = tmp_path / "x", ("seed=0", "resume=auto", "masker.coverage=1", "masker.min_owners=1")
    _train(x, "train.steps=3", *one, nproc=1)
    shutil.copytree(survivors.survivors_dir(source), survivors.survivors_dir(x))
    out = _train(x, "train.steps=4", *one, nproc=1)
    assert "recovered step" not in out and f"resumed from {ck.step_dir(x, 3)} (step 3)" in out, out
    assert "set aside 3 survivors' file(s)" in out and not any(survivors.survivors_dir(x).iterdir())
    shutil.rmtree(x)
    # Defect 3: a flipped bit in the run's own survivors' files: named, the checkpoint used, the run goes on.
    run = _copy(source, tmp_path / "src")
    _flip_bit(run)
    out = _train(run, "train.steps=4", "resume=auto")
    bad = survivors.fragment_dir(run, 5, 2) / "pieces_2.safetensors"
    assert f"subnetdp: step 5 skipped: {bad}: corrupted: its sha256 differs" in out, out
    assert f"resumed from {ck.step_dir(run, 3)} (step 3)" in out and ck.step_dir(run, 4).is_dir(), out


def test_a_linked_survivors_folder_is_refused_before_anything_is_written(source, tmp_path):
    # Defect 8: checkpoints/survivors a link to a folder outside the run: one line, before any process group.
    run = _copy(source, tmp_path / "src")
    outside = tmp_path / "outside"
    survivors.survivors_dir(run).rename(outside)
    (ck.checkpoints_dir(run) / survivors.SURVIVORS).symlink_to(outside)
    before = sorted(p.name for p in outside.iterdir())
    out = _train(run, "train.steps=6", "resume=auto", rc=2)
    lines = [line for line in out.splitlines() if line.startswith("subnetdp: error:")]
    link = ck.checkpoints_dir(run) / "survivors"
    assert len(lines) == 1 and f"{link}: is a symbolic link (to {outside})" in lines[0], out
    assert sorted(p.name for p in outside.iterdir()) == before and not ck.step_dir(run, 5).exists()


def test_an_assembled_step_that_does_not_load_is_set_aside_and_the_checkpoint_used(source, tmp_path):
    # What the checks before assembling cannot see (a state file of another optimizer, its record
    # made to match) fails the load on rank 2: the step and its fragments go aside, the run goes on;
    # leftovers of interrupted writes are cleaned when it starts.
    run = _copy(source, tmp_path / "src")
    name = ck.rank_files(2)[1]
    state = torch.load(survivors.fragment_dir(run, 5, 2) / name, weights_only=True)
    state["optimizer"]["class"] = "Adam"
    torch.save(state, survivors.fragment_dir(run, 5, 2) / name)
    _rewrite(run, 2, name)
    # Leftovers of writes a kill interrupted (newer than any checkpoint, so no save would prune them).
    leftovers = [ck.checkpoints_dir(run) / "step_00000099.tmp",
                 survivors.survivors_dir(run) / "step_00000007.rank_2.tmp"]
    for d in leftovers:
        d.mkdir()
        (d / "pieces_2.safetensors").write_bytes(b"partial")
    out = _train(run, "train.steps=4", "resume=auto")
    assert not any(d.exists() for d in leftovers)  # cleaned when the run started
    assert "recovered step 5 from the surviving owners" in out, out
    assert "subnetdp: the step recovered from the survivors did not load (rank 2: " in out, out
    assert f"resumed from {ck.step_dir(run, 3)} (step 3)" in out and ck.step_dir(run, 4).is_dir(), out
    aside = sorted(p.name for p in survivors.set_aside_dir(run).glob("*/*"))
    assert aside == ["step_00000005", *(f"step_00000005.rank_{r}" for r in (0, 2, 3))], aside

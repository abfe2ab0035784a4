"""Recovery from the surviving owners: each survivor's files, and the checkpoint assembled from them.

SDP keeps every unit on ``k(u)`` ranks, bit-identical after every step. When a rank dies, every
survivor writes, before it exits and without any collective, a *fragment*: the pieces it owns that
no lower-ranked surviving owner writes (not those it writes in a regular checkpoint: their writer may
be the dead rank), its buffers and its state, as of the last step it finished, in the checkpoint
format::

    RUN_DIR/checkpoints/survivors/step_{S:08d}.rank_{r}/
        pieces_{r}.safetensors  rank_{r}.safetensors  rank_{r}.state.pt  plan.json  config.yaml
        FRAGMENT.json           # written last: the checkpoint header, the rank, its files and pieces

The restarted world (``resume=auto``) assembles, before it loads anything, the newest step ``S``
newer than the newest complete checkpoint for which the fragments at ``S`` hold every piece of the
plan: a regular ``checkpoints/step_{S:08d}/`` whose files are the fragments' (hard links, or copies
across file systems) and whose index names, for every piece, its lowest surviving owner. The dead
ranks have no files there (``absent_ranks``): their data position is any survivor's (the same at
one world size), their RNG re-seeded from the step, their buffers the mean of the surviving
owners' copies, as in a re-planned resume. When no step is complete (a unit lost every owner, or
survivors stopped one step apart and neither step is whole) the run falls back to the newest
complete checkpoint, and :func:`assemble` says why in one line, naming the units. Fragments are
data: each is checked before a step is built (:func:`check_fragment`: run id and lineage, model,
partition and plan, every file's checksum, tensor metadata and shapes); a bad one is named and its
step skipped. They stay until the assembled checkpoint has loaded, and are removed once a complete
checkpoint supersedes them; those of another run or lineage are moved aside (:func:`set_aside`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from subnetdp.core import records
from subnetdp.core.contracts import Partition
from subnetdp.core.errors import CheckpointError, PlanError
from subnetdp.core.records import Int, ListOf, MapOf, Record, Str
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.pieces import global_items
from subnetdp.train import faults
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints import lineage, schema, units
from subnetdp.train.checkpoints.source import read_plan, trained_masker
from subnetdp.train.checkpoints.unlogged import manifest_entries

FRAGMENT = "FRAGMENT.json"
SURVIVORS = "survivors"
SET_ASIDE = "set-aside"
FRAGMENT_DIR = re.compile(r"^step_(\d{8})\.rank_(\d+)$")

#: A fragment's record: the header a manifest would carry (without ``files`` and ``pieces``), the
#: writing rank, the files it wrote (size and sha256) and the keys of the pieces in its pieces file.
FRAGMENT_RECORD = Record(
    {"header": MapOf(Str(), records.Anything()), "rank": Int(0), "files": MapOf(records.FileName(), schema.FILE_ENTRY),
     "held": ListOf(Str()), "index": MapOf(Str(), schema.PIECE)},
    # the writer's losses of the steps up to its step that no log row held (checkpoints.unlogged)
    optional={"losses": MapOf(Str(r"[0-9]+", "a step"), records.Number())})


def survivors_dir(run_dir: Path) -> Path:
    """``RUN_DIR/checkpoints/survivors``; a symbolic link there is refused (it would write into another tree)."""
    path = ck.checkpoints_dir(run_dir) / SURVIVORS
    if path.is_symlink():
        raise CheckpointError(f"{path}: is a symbolic link (to {os.readlink(path)}): a run's survivors' files are "
                              "written and read inside its own directory only — replace the link with a folder, "
                              "or use another run.name")
    return path


def set_aside_dir(run_dir: Path) -> Path:
    """Where files this run will not continue from are moved (never deleted: they may be someone's work)."""
    return ck.checkpoints_dir(run_dir) / SET_ASIDE


def set_aside(run_dir: Path, paths: list[Path], why: str) -> Path | None:
    """Move ``paths`` (fragments, an assembled step) into a fresh folder of :func:`set_aside_dir`."""
    paths = [p for p in paths if p.exists() or p.is_symlink()]
    if not paths:
        return None
    dest = set_aside_dir(run_dir) / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}-{why}"
    dest.mkdir(parents=True)
    for p in paths:
        os.replace(p, dest / p.name)
    return dest


def fragment_dir(run_dir: Path, step: int, rank: int) -> Path:
    return survivors_dir(run_dir) / f"step_{step:08d}.rank_{rank}"


def write_fragment(run_dir: Path, header: dict[str, Any], rank: int, files: dict[str, Any],
                   held: list[str], index: dict[str, dict[str, Any]], losses: dict[int, float] | None = None) -> Path:
    """Finish the fragment whose files were written (atomically) into its ``.tmp`` directory: the
    record last, then the rename. ``files``: name -> size and sha256; ``held``: the piece keys in
    this rank's pieces file; ``index``: the plan's full piece index (what a complete step needs);
    ``losses``: this rank's losses of the steps no log row holds (step -> loss)."""
    final = fragment_dir(run_dir, int(header["step"]), rank)
    tmp = final.with_name(final.name + ".tmp")
    record = {"header": header, "rank": rank, "files": dict(sorted(files.items())), "held": sorted(held),
              "index": index, "losses": {str(s): float(v) for s, v in sorted((losses or {}).items())}}
    ck.write_text_atomic(tmp / FRAGMENT, json.dumps(record, indent=1))
    if final.exists() or final.is_symlink():
        ck.remove_checkpoint(final)
    os.replace(tmp, final)
    return final


def fragment_tmp(run_dir: Path, step: int, rank: int) -> Path:
    """A fresh temporary directory for rank ``rank``'s fragment at ``step`` (nothing else writes there)."""
    tmp = fragment_dir(run_dir, step, rank).with_name(f"step_{step:08d}.rank_{rank}.tmp")
    if tmp.exists() or tmp.is_symlink():
        ck.remove_checkpoint(tmp)
    tmp.mkdir(parents=True)
    return tmp


@dataclass(frozen=True)
class Fragment:
    path: Path
    rank: int
    step: int
    record: dict[str, Any]

    @property
    def header(self) -> dict[str, Any]:
        return self.record["header"]


def read_fragments(run_dir: Path, skipped: list[str] | None = None) -> list[Fragment]:
    """Every finished fragment of the run (a record, a real directory). A damaged one is left out and
    named, one line each, in ``skipped`` (raised when ``skipped`` is None)."""
    root = survivors_dir(run_dir)
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        m = FRAGMENT_DIR.match(d.name)
        if not m or d.is_symlink() or not d.is_dir() or not (d / FRAGMENT).exists():
            continue
        try:
            out.append(_read_fragment(d, int(m.group(1)), int(m.group(2))))
        except CheckpointError as e:
            if skipped is None:
                raise
            skipped.append(str(e))
    return out


def _read_fragment(d: Path, step: int, rank: int) -> Fragment:
    path = d / FRAGMENT
    if path.is_symlink():
        raise CheckpointError(f"{path}: is a symbolic link (to {os.readlink(path)}): a survivor's record is read "
                              f"from its own folder only; {d} is skipped")
    try:
        record = records.read_json(path)
    except records.BadJSON as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}): a survivor's record is corrupted; "
                              f"{d} is skipped") from None
    records.check(FRAGMENT_RECORD, record, path, f"a survivor's record is damaged; {d} is skipped")
    header = record["header"]
    if header.get("step") != step or record["rank"] != rank:
        raise CheckpointError(f"{path}: records step {header.get('step')} rank {record['rank']}, its folder "
                              f"says step {step} rank {rank}: {d} is skipped")
    return Fragment(d, rank, step, record)


@dataclass(frozen=True)
class Assembly:
    """What :func:`assemble` did: the checkpoint it made (or None), one line saying why, and one line
    per fragment or step it skipped."""

    checkpoint: Path | None
    message: str
    skipped: tuple[str, ...] = ()
    lacking: dict[int, str] = field(default_factory=dict)  # step -> the units no survivor kept


@dataclass(frozen=True)
class Expected:
    """What this run's fragments must be: its run id and lineage (None: any), model and partition."""

    current: dict[str, Any] | None
    model: dict[str, Any]
    partition: Partition
    names: dict[int, str] = field(default_factory=dict)


def _units_missing(index: dict[str, dict[str, Any]], held: set[str]) -> list[int | None]:
    """The units (None: shared tensors, last) of which some piece has no holder, in order."""
    lost = {e.get("unit") for k, e in index.items() if k not in held}
    return sorted(lost, key=lambda u: (u is None, u or 0))


def assemble(run_dir: Path, expected: Expected, newest: Path | None) -> Assembly | None:
    """Make the newest complete, valid step of the survivors' fragments a regular checkpoint.

    Returns None when there are no fragments newer than ``newest`` (the newest complete checkpoint
    of the run's lineage); otherwise
    what was done, in one line, and a line per skipped fragment or step. Every fragment is checked
    before anything is built (:func:`check_fragment`); a step with a bad fragment, or one whose
    files cannot be built (a full disk), is skipped and the next older one tried, down to the
    newest complete checkpoint. The fragments stay: the caller removes them once the assembled
    checkpoint has loaded (:func:`prune_superseded`). Runs on one rank (rank 0 of the restarted
    world) before any rank chooses its checkpoint.
    """
    newest_step = int(ck.STEP_DIR.match(newest.name).group(1)) if newest is not None else -1
    skipped: list[str] = []
    frags = [f for f in read_fragments(run_dir, skipped) if f.step > newest_step]
    if not frags and not skipped:
        return None
    fallback = f"the newest complete checkpoint, {newest}" if newest is not None else "the start (no checkpoint)"
    by_step: dict[int, list[Fragment]] = {}
    for f in frags:
        by_step.setdefault(f.step, []).append(f)
    reasons: list[str] = []
    lacking: dict[int, str] = {}
    for step in sorted(by_step, reverse=True):
        group = by_step[step]
        bad = [p for p in (check_fragment(f, expected) for f in group) if p]
        if bad:
            skipped.extend(f"step {step} skipped: {p}" for p in bad)
            reasons.append(f"step {step}: a damaged or foreign fragment")
            continue
        if len({json.dumps(f.header, sort_keys=True) for f in group}) > 1:
            skipped.append(f"step {step} skipped: its fragments' headers differ ({[str(f.path) for f in group]})")
            reasons.append(f"step {step}: fragments of different runs or plans")
            continue
        index = group[0].record["index"]
        held = set().union(*(set(f.record["held"]) for f in group))
        missing = _units_missing(index, held)
        if missing:
            shown = ["shared tensors" if u is None else expected.names.get(u, f"unit {u}") for u in missing]
            ranks = sorted(f.rank for f in group)
            lacking[step] = ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")
            reasons.append(f"step {step} (from ranks {ranks}) lacks {lacking[step]} (no surviving owner)")
            continue
        try:
            path = _build(run_dir, step, group, index)
        except OSError as e:  # a full disk: the newest complete checkpoint needs no writes
            skipped.append(f"step {step} skipped: building {ck.step_dir(run_dir, step)} failed ({e})")
            reasons.append(f"step {step}: no room to build it")
            continue
        dead = sorted(set(range(int(group[0].header["world_size"]))) - {f.rank for f in group})
        return Assembly(path, f"recovered step {step} from the surviving owners (ranks "
                        f"{sorted(f.rank for f in group)}; lost: {dead}) into {path}", tuple(skipped))
    why = "; ".join(reasons) if reasons else "no fragment is usable"
    return Assembly(None, f"the survivors' files cannot make a whole step: {why}; resuming from {fallback}",
                    tuple(skipped), lacking)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:  # a full disk, a read-only one: no copy would do better
            raise
        shutil.copy2(src, dst)  # another file system: a copy


def _build(run_dir: Path, step: int, group: list[Fragment], index: dict[str, dict[str, Any]]) -> Path:
    """``checkpoints/step_{step}``: the fragments' files, one index naming each piece's lowest
    surviving holder, the first fragment's plan and config, ``absent_ranks`` for the dead. On an
    error the temporary directory is removed, so a full disk is left as it was found."""
    final = ck.step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists() or tmp.is_symlink():
        ck.remove_checkpoint(tmp)
    try:
        tmp.mkdir(parents=True)
        files: dict[str, Any] = {}
        holders: dict[str, list[int]] = {}
        for f in sorted(group, key=lambda f: f.rank):
            for name, entry in f.record["files"].items():
                if name in ("plan.json", "config.yaml") and name in files:
                    continue
                _link(f.path / name, tmp / name)
                files[name] = entry
                faults.no_space(step, tmp / name)  # test-only: a full disk
            for key in f.record["held"]:
                holders.setdefault(key, []).append(f.rank)
        pieces = {}
        for key, entry in index.items():
            w = min(holders[key])
            pieces[key] = {**{k: v for k, v in entry.items() if k != "copies"}, "file": ck.pieces_file(w), "writer": w}
            if "copies" in entry:  # owners' copies differ (local steps): every survivor's own
                pieces[key]["copies"] = {str(r): ck.pieces_file(r) for r in holders[key]}
        present = sorted(f.rank for f in group)
        absent = sorted(set(range(int(group[0].header["world_size"]))) - set(present))
        manifest = {**group[0].header, "files": dict(sorted(files.items())), "pieces": pieces,
                    "absent_ranks": absent, "recovered_from": present,
                    "unlogged_losses": manifest_entries([(f.rank, f.record.get("losses", {})) for f in group])}
        ck.finish_directory(tmp, final, manifest)
    except OSError:
        ck.remove_checkpoint(tmp)
        raise
    return final


def prune_superseded(run_dir: Path) -> None:
    """Remove fragments at or before the newest complete checkpoint (and unfinished ones there)."""
    newest = ck.latest_checkpoint(run_dir)
    root = survivors_dir(run_dir)
    if newest is None or not root.is_dir() or root.is_symlink():
        return
    newest_step = int(ck.STEP_DIR.match(newest.name).group(1))
    for d in root.iterdir():
        m = re.match(r"^step_(\d{8})\.rank_\d+(\.tmp)?$", d.name)
        if m and int(m.group(1)) <= newest_step and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)


def clean_leftovers(run_dir: Path) -> None:
    """Remove what interrupted writes left (``step_*.tmp`` of checkpoints and of fragments): nothing
    writes there while a new world starts, and a full disk must not stay full of them."""
    root = ck.checkpoints_dir(run_dir)
    if not root.is_dir():
        return
    found = [d for d in root.glob("step_*.tmp")]
    frags = survivors_dir(run_dir)
    if frags.is_dir():
        found += [d for d in frags.iterdir() if d.name.endswith(".tmp")]
    for d in found:
        ck.remove_checkpoint(d)


def set_aside_fragments(run_dir: Path, expected: Expected) -> tuple[Path | None, list[Fragment]]:
    """Move every fragment that is not of ``expected``'s run and lineage aside (an explicit resume
    starts a new lineage: the states they hold are not its past). Returns the folder and the fragments
    moved (the caller says what they were)."""
    root = survivors_dir(run_dir)
    if not root.is_dir():
        return None, []
    skipped: list[str] = []
    foreign = [f for f in read_fragments(run_dir, skipped) if lineage.descends(expected.current, f.header)]
    return set_aside(run_dir, [f.path for f in foreign], "survivors-of-another-lineage"), foreign


def check_fragment(f: Fragment, expected: Expected) -> str | None:
    """Why fragment ``f`` cannot be assembled for this run, in one line naming the file, or None.

    Its run id and lineage, model and partition, its plan against the plan's units (every piece's
    shape and unit, every held piece one the rank owns), every file's size and checksum, and each
    tensor file's metadata, keys and shapes. Reading headers and checksums only: nothing is loaded.
    """
    header, where = f.header, f.path / FRAGMENT
    problem = lineage.descends(expected.current, header)
    if problem:
        return f"{where}: {problem}"
    if header.get("model") != expected.model:
        return f"{where}: written for model {header.get('model')}, this run trains {expected.model}"
    if header.get("partition_digest") != units.partition_digest(expected.partition):
        return f"{where}: written for another partition of the model into units"
    manifest = {**header, "files": f.record["files"]}
    try:
        for name in f.record["files"]:
            ck.verify_file(f.path, name, manifest)
        for name in (ck.pieces_file(f.rank), *ck.rank_files(f.rank), "plan.json", "config.yaml"):
            if name not in f.record["files"] and name != ck.pieces_file(f.rank):
                return f"{f.path / name}: missing from the survivor's record"
        plan = read_plan(f.path, manifest)
        problem = _check_index(f, plan, expected.partition)
        if problem:
            return problem
        _check_tensors(f, manifest, plan, expected.partition)
        state = ck.read_state(f.path / ck.rank_files(f.rank)[1])
    except CheckpointError as e:
        return str(e)
    if state.get("step") != f.step or state.get("rank") != f.rank or state.get("run_id") != header.get("run_id"):
        return (f"{f.path / ck.rank_files(f.rank)[1]}: holds step {state.get('step')} rank {state.get('rank')}, "
                f"its record says step {f.step} rank {f.rank}")
    return None


def _check_index(f: Fragment, plan: MaskPlan, partition: Partition) -> str | None:
    """The fragment's index against the plan's units: the same pieces, shapes and units; held pieces owned."""
    where = f.path / FRAGMENT
    items = {units.item_key(it): it for it in global_items(partition, plan)}
    index = f.record["index"]
    if set(index) != set(items):
        extra, lacking = sorted(set(index) - set(items)), sorted(set(items) - set(index))
        return (f"{where}: its piece index does not match the plan's units ({len(index)} pieces, the plan has "
                f"{len(items)}; e.g. {(extra or lacking)[:2]})")
    for key, it in items.items():
        if list(index[key]["shape"]) != list(it.shape) or index[key].get("unit") != it.unit:
            return (f"{where}: piece {key} is indexed with shape {index[key]['shape']}, the plan's unit has "
                    f"{list(it.shape)}")
    for key in f.record["held"]:
        if key not in items or f.rank not in items[key].owners:
            return f"{where}: holds piece {key}, which rank {f.rank} does not own under its plan"
    return None


def _check_tensors(f: Fragment, manifest: dict[str, Any], plan: MaskPlan, partition: Partition) -> None:
    """Every tensor file's metadata (run, step, rank), keys and shapes, from its header alone."""
    index, held = f.record["index"], set(f.record["held"])
    if held or ck.pieces_file(f.rank) in f.record["files"]:
        pieces = ck.TensorFile(f.path / ck.pieces_file(f.rank), manifest, {"writer": str(f.rank)})
        for key in pieces.keys():
            piece = key.split("/", 1)[1] if "/" in key else key
            if piece not in held:
                raise CheckpointError(f"{pieces.path}: holds {key}, not a piece its record lists")
            shape = pieces.shape(key)
            if not key.startswith(units.SCALAR) and shape != list(index[piece]["shape"]):
                raise CheckpointError(f"{pieces.path}: tensor {key} has shape {shape}, the plan's unit has "
                                      f"{index[piece]['shape']}")
        lacking = sorted(held - pieces.keys())
        if lacking:
            raise CheckpointError(f"{pieces.path}: lacks the pieces {lacking[:3]} its record lists")
    buffers = ck.TensorFile(f.path / ck.rank_files(f.rank)[0], manifest, {"rank": str(f.rank)})
    for it in global_items(partition, plan, buffers=True):
        key = units.item_key(it)
        if f.rank in it.owners and (key not in buffers or buffers.shape(key) != list(it.shape)):
            raise CheckpointError(f"{buffers.path}: buffer {key} is missing or not of shape {list(it.shape)}")


def resume_plan(path: Path, state: Any, cfg: Any, world_size: int) -> MaskPlan:
    """The plan a resume from checkpoint ``path`` continues under: the run's own (``state.plan``), except
    when exactly the survivors of a checkpoint assembled from their files resume it with the masker it
    was trained with. Then the survivors' plan (``plan.without``: every unit keeps its surviving owners,
    one below ``masker.min_owners`` gains one), the plan they would have gone on with in-process
    (docs/inprocess.md): fewer units move than under a fresh plan, and both paths train the same values."""
    from omegaconf import OmegaConf

    manifest = ck.read_manifest(path)
    absent = {int(r) for r in manifest.get("absent_ranks", ())}
    old_world = int(manifest["world_size"])
    if not absent or world_size != old_world - len(absent) or state.parallel.sharded:
        return state.plan
    stored = OmegaConf.to_container(trained_masker(path, manifest, cfg.masker), resolve=True)
    if stored != OmegaConf.to_container(cfg.masker, resolve=True):
        return state.plan  # another masker, coverage or seed asked for: a new plan
    try:
        return read_plan(path, manifest).without([r for r in range(old_world) if r not in absent],
                                                 cfg.masker.min_owners)
    except (PlanError, ValueError):
        return state.plan

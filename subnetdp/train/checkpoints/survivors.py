"""Recovery from the surviving owners: each survivor's files, and the checkpoint assembled from them.

SDP keeps every unit on ``k(u)`` ranks, bit-identical after every step. When a rank dies, every
survivor writes, before it exits and without any collective, a *fragment*: every piece it owns (not
only those it writes in a regular checkpoint), its buffers and its state, as of the last step it
finished, in the checkpoint format::

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
data: their names and fields are checked like a manifest's, and they are removed once a complete
checkpoint supersedes them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from subnetdp.core import records
from subnetdp.core.errors import CheckpointError
from subnetdp.core.records import Int, ListOf, MapOf, Record, Str
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints import schema

FRAGMENT = "FRAGMENT.json"
SURVIVORS = "survivors"
FRAGMENT_DIR = re.compile(r"^step_(\d{8})\.rank_(\d+)$")

#: A fragment's record: the header a manifest would carry (without ``files`` and ``pieces``), the
#: writing rank, the files it wrote (size and sha256) and the keys of the pieces in its pieces file.
FRAGMENT_RECORD = Record(
    {"header": MapOf(Str(), records.Anything()), "rank": Int(0), "files": MapOf(records.FileName(), schema.FILE_ENTRY),
     "held": ListOf(Str()), "index": MapOf(Str(), schema.PIECE)})


def survivors_dir(run_dir: Path) -> Path:
    return ck.checkpoints_dir(run_dir) / SURVIVORS


def fragment_dir(run_dir: Path, step: int, rank: int) -> Path:
    return survivors_dir(run_dir) / f"step_{step:08d}.rank_{rank}"


def write_fragment(run_dir: Path, header: dict[str, Any], rank: int, files: dict[str, Any],
                   held: list[str], index: dict[str, dict[str, Any]]) -> Path:
    """Finish the fragment whose files were written (atomically) into its ``.tmp`` directory: the
    record last, then the rename. ``files``: name -> size and sha256; ``held``: the piece keys in
    this rank's pieces file; ``index``: the plan's full piece index (what a complete step needs)."""
    final = fragment_dir(run_dir, int(header["step"]), rank)
    tmp = final.with_name(final.name + ".tmp")
    record = {"header": header, "rank": rank, "files": dict(sorted(files.items())), "held": sorted(held),
              "index": index}
    ck.write_text_atomic(tmp / FRAGMENT, json.dumps(record, indent=1))
    if final.exists():
        shutil.rmtree(final, ignore_errors=True)
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


def read_fragments(run_dir: Path) -> list[Fragment]:
    """Every finished fragment of the run (a record, a real directory); damaged ones are named."""
    root = survivors_dir(run_dir)
    if not root.is_dir() or root.is_symlink():
        return []
    out = []
    for d in sorted(root.iterdir()):
        m = FRAGMENT_DIR.match(d.name)
        if not m or d.is_symlink() or not d.is_dir() or not (d / FRAGMENT).is_file():
            continue
        path = d / FRAGMENT
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e}): a survivor's record is corrupted; remove "
                                  f"{d} to resume from the newest complete checkpoint") from None
        records.check(FRAGMENT_RECORD, record, path, "a survivor's record is damaged")
        header = record["header"]
        if int(header.get("step", -1)) != int(m.group(1)) or record["rank"] != int(m.group(2)):
            raise CheckpointError(f"{path}: records step {header.get('step')} rank {record['rank']}, its folder "
                                  f"says step {int(m.group(1))} rank {int(m.group(2))}: remove {d}")
        out.append(Fragment(d, record["rank"], int(m.group(1)), record))
    return out


@dataclass(frozen=True)
class Assembly:
    """What :func:`assemble` did: the checkpoint it made (or None) and one line saying why."""

    checkpoint: Path | None
    message: str


def _units_missing(index: dict[str, dict[str, Any]], held: set[str]) -> list[int | None]:
    """The units (None: shared tensors) of which some piece has no holder, in order."""
    lost = {e.get("unit") for k, e in index.items() if k not in held}
    return sorted(lost, key=lambda u: (u is not None, u or 0))


def assemble(run_dir: Path, names: dict[int, str] | None = None) -> Assembly | None:
    """Make the newest complete step of the survivors' fragments a regular checkpoint.

    Returns None when there are no fragments newer than the newest complete checkpoint; otherwise
    what was done, in one line (``names``: unit id -> name, for the message). Runs on one rank
    (rank 0 of the restarted world) before any rank chooses its checkpoint.
    """
    newest = ck.latest_checkpoint(run_dir)
    newest_step = int(ck.STEP_DIR.match(newest.name).group(1)) if newest is not None else -1
    frags = [f for f in read_fragments(run_dir) if f.step > newest_step]
    if not frags:
        return None
    fallback = f"the newest complete checkpoint, {newest}" if newest is not None else "the start (no checkpoint)"
    by_step: dict[int, list[Fragment]] = {}
    for f in frags:
        by_step.setdefault(f.step, []).append(f)
    reasons = []
    for step in sorted(by_step, reverse=True):
        group = by_step[step]
        run_ids = {f.header.get("run_id") for f in group}
        digests = {f.header.get("plan_digest") for f in group}
        if len(run_ids) > 1 or len(digests) > 1:
            reasons.append(f"step {step}: fragments of different runs or plans")
            continue
        index = group[0].record["index"]
        held = set().union(*(set(f.record["held"]) for f in group))
        missing = _units_missing(index, held)
        if missing:
            shown = ["shared tensors" if u is None else (names or {}).get(u, f"unit {u}") for u in missing]
            ranks = sorted(f.rank for f in group)
            reasons.append(f"step {step} (from ranks {ranks}) lacks {', '.join(shown[:8])}"
                           + (f" and {len(shown) - 8} more" if len(shown) > 8 else "") + " (no surviving owner)")
            continue
        path = _build(run_dir, step, group, index)
        for f in frags:  # superseded: the assembled step holds everything they could give
            shutil.rmtree(f.path, ignore_errors=True)
        dead = sorted(set(range(int(group[0].header["world_size"]))) - {f.rank for f in group})
        return Assembly(path, f"recovered step {step} from the surviving owners (ranks "
                        f"{sorted(f.rank for f in group)}; lost: {dead}) into {path}")
    return Assembly(None, f"the survivors' files cannot make a whole step: {'; '.join(reasons)}; resuming "
                    f"from {fallback}")


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system: a copy
        shutil.copy2(src, dst)


def _build(run_dir: Path, step: int, group: list[Fragment], index: dict[str, dict[str, Any]]) -> Path:
    """``checkpoints/step_{step}``: the fragments' files, one index naming each piece's lowest
    surviving holder, the first fragment's plan and config, ``absent_ranks`` for the dead."""
    final = ck.step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists() or tmp.is_symlink():
        ck.remove_checkpoint(tmp)
    tmp.mkdir(parents=True)
    files: dict[str, Any] = {}
    holders: dict[str, list[int]] = {}
    for f in sorted(group, key=lambda f: f.rank):
        for name, entry in f.record["files"].items():
            if name in ("plan.json", "config.yaml") and name in files:
                continue
            ck.check_size(f.path, name, {"files": f.record["files"], "world_size": f.header["world_size"]})
            _link(f.path / name, tmp / name)
            files[name] = entry
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
                "absent_ranks": absent, "recovered_from": present}
    ck.finish_directory(tmp, final, manifest)
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

"""Which files a run may continue from: its run id and its *lineage*.

A lineage is the history of the state a run trains: a list of ``{"id", "from_step"}`` entries, the
first the run's start (``from_step`` 0), one more for every explicit ``resume=PATH`` (a fresh id and
the step resumed from). Every manifest and every survivor's fragment carries the lineage of the
state it holds (``header["lineage"]``), and the run directory records the current one in
``checkpoints/LINEAGE.json`` (rank 0 writes it when the run starts).

``resume=auto`` continues the current lineage only: a file descends from it when its run id is the
run's and its last entry is an entry of the current lineage at a step no later than the next
entry's ``from_step`` (the state of a branch the user left by resuming from an older step is not
an ancestor). Why a record on disk and not just the newest checkpoint's manifest: a run may crash
before its first checkpoint, and survivors' files copied in from another run must still be told
apart. Files written before lineages existed (no ``lineage`` field) are taken as the run's.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from subnetdp.core import records
from subnetdp.core.errors import CheckpointError
from subnetdp.core.records import Int, ListOf, Record, Str
from subnetdp.train.checkpoints import files as ck

RECORD = "LINEAGE.json"
ENTRY = Record({"id": Str(r"[0-9a-f]{32}", "a lineage id (32 hex digits)"), "from_step": Int(0)})
LINEAGE = ListOf(ENTRY)
FILE = Record({"run_id": Str(), "lineage": LINEAGE})


def new_entry(from_step: int) -> dict[str, Any]:
    return {"id": uuid.uuid4().hex, "from_step": int(from_step)}


def record_path(run_dir: Path) -> Path:
    return ck.checkpoints_dir(run_dir) / RECORD


def read(run_dir: Path) -> dict[str, Any] | None:
    """The run's current run id and lineage, or None when no run has recorded one here."""
    path = record_path(run_dir)
    if path.is_symlink():
        raise CheckpointError(f"{path}: is a symbolic link: a run's lineage is read from its own directory only; "
                              "remove the link (resume=auto then continues the newest checkpoint)")
    if not path.is_file():
        return None
    try:
        found = records.read_json(path)
    except records.BadJSON as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}): the run's lineage record is corrupted; "
                              "remove it (resume=auto then continues the newest checkpoint)") from None
    records.check(FILE, found, path, "the run's lineage record is damaged; remove it")
    return found


def write(run_dir: Path, run_id: str, chain: list[dict[str, Any]]) -> None:
    path = record_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()  # never written through
    ck.write_text_atomic(path, json.dumps({"run_id": run_id, "lineage": chain}, indent=1))


def descends(current: dict[str, Any] | None, header: dict[str, Any]) -> str | None:
    """Why a file whose header is ``header`` is not of the run and lineage ``current``, or None if it is."""
    if current is None:
        return None
    if header.get("run_id") != current["run_id"]:
        return f"written by run {header.get('run_id')}, this run is {current['run_id']}"
    theirs = header.get("lineage")
    if theirs is None or not current["lineage"]:
        return None  # written before lineages: the run id is all there is
    try:
        records.check(LINEAGE, theirs, "header", "")
    except CheckpointError:
        return "its lineage is damaged"
    chain, step = current["lineage"], int(header.get("step", -1))
    last = theirs[-1]["id"] if theirs else None
    for i, entry in enumerate(chain):
        if entry["id"] == last:
            later = chain[i + 1]["from_step"] if i + 1 < len(chain) else None
            if later is None or step <= later:
                return None
            return (f"its step {step} is on a branch this run left when it resumed from step {later} "
                    f"(lineage {chain[i + 1]['id'][:8]})")
    return f"it continues lineage {str(last)[:8]}, not this run's ({chain[-1]['id'][:8]})"

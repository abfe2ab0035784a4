"""Checkpoints on disk: atomic writes, the layout, verification and safe reading.

``RUN_DIR/checkpoints/step_{:08d}/`` holds (format ``subnetdp-checkpoint/2``, keyed by unit)

- ``pieces_{r}.safetensors``: the parameter pieces rank r writes, each with its optimizer state
  (``optim.exp_avg/KEY``, ``optim.step/KEY``, ...) and any local-steps outer state
  (``outer_anchor/KEY``). A piece is a shared tensor, or one unit's slice of a tensor as the
  partition cuts it (``name@dim:start:stop``), never a rank's local layout; every piece is written
  once, by one of its owners, the writers chosen so each rank writes about 1/W of the bytes
  (:mod:`subnetdp.train.checkpoints.units`).
- ``rank_{r}.safetensors``: what is truly rank r's among the tensors: its buffers (BatchNorm
  running statistics differ by rank, as in DDP), keyed by piece.
- ``rank_{r}.state.pt``: the data-loader position, RNG states (as tensors), scheduler and optimizer
  hyper-parameters, the step; only tensors and plain containers, so ``torch.load(weights_only=True)``
  reads it and nothing is ever unpickled.
- ``plan.json``, ``config.yaml``: the mask plan (with the partition's units) and the resolved config.
- ``MANIFEST.json``: format, run id, step, world size, plan and partition digests, model and data
  spec, the size and sha256 of every other file, and ``pieces``: the index saying which file holds
  each piece. Rank 0 writes it last, after every rank's files are on disk; only a directory with a
  manifest is a checkpoint.

Every file is written under a temporary name, fsynced, then renamed; the directory is built as
``step_XXXXXXXX.tmp`` and renamed when complete, so a kill at any moment leaves the previous
checkpoint loadable. Reading checks sizes and checksums before torch sees a byte, and turns every
problem into a :class:`~subnetdp.core.errors.CheckpointError` that names the file. A checkpoint of
format 1 (one full copy per rank) is refused with a message saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from subnetdp.core import records
from subnetdp.core.errors import CheckpointError
from subnetdp.train.checkpoints import schema
# The kill points live in one module; re-exported here because tests and benchmarks read them as ck.*.
from subnetdp.train.faults import (KILL_AT_STEP, KILL_IN_PRUNE, KILL_IN_SYNC, KILL_IN_UPDATE, KILL_IN_WRITE,  # noqa: F401
                                   KILL_RANK, KILL_SIGNAL, NO_SPACE_IN_ASSEMBLY, fault_marker, fault_point,
                                   step_faults)

FORMAT = "subnetdp-checkpoint/2"
FORMAT_1 = "subnetdp-checkpoint/1"  # per-rank copies of every held tensor: refused, see read_manifest
MANIFEST = "MANIFEST.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


# --------------------------------------------------------------------------- layout


def checkpoints_dir(run_dir: Path) -> Path:
    """``RUN_DIR/checkpoints``; a symbolic link there is refused (it would write into another tree)."""
    path = Path(run_dir) / "checkpoints"
    if path.is_symlink():
        raise CheckpointError(f"{path}: is a symbolic link (to {os.readlink(path)}): a run's checkpoints are "
                              "written, pruned and resumed inside its own directory only — replace the link "
                              "with a folder, or use another run.name")
    return path


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:08d}"


def rank_files(rank: int) -> tuple[str, str]:
    """Rank ``rank``'s own files: its buffers (safetensors) and its state (loader, RNG, schedule)."""
    return f"rank_{rank}.safetensors", f"rank_{rank}.state.pt"


def pieces_file(rank: int) -> str:
    """The file holding the parameter pieces (and their optimizer state) that ``rank`` writes."""
    return f"pieces_{rank}.safetensors"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run (directories with a manifest), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    # A link is never taken for this run's checkpoint (nor pruned through): it may point into another run.
    found = [d for d in root.iterdir() if STEP_DIR.match(d.name) and _real_dir(d) and _real_file(d / MANIFEST)]
    return sorted(found, key=lambda d: d.name)


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _real_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory's newest complete checkpoint."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if checkpoints_dir(path).is_dir():
        newest = latest_checkpoint(path)
        if newest is None:
            raise CheckpointError(f"{checkpoints_dir(path)}: holds no complete checkpoint (none has a {MANIFEST}); "
                                  "an interrupted save leaves only a .tmp directory")
        return newest
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    raise CheckpointError(f"{path}: not a checkpoint (no {MANIFEST}: the save did not finish, or this is not "
                          "a subnetdp checkpoint) and not a run directory (no checkpoints/ folder)")


# --------------------------------------------------------------------------- atomic writes


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: Path, write: Callable[[Path], None], fault: tuple[int, int] | None = None) -> dict[str, Any]:
    """``write(temporary path)``, fsync, rename to ``path``; returns its size and sha256.

    ``fault`` = (step, rank) enables the test-only kill between the temporary file and the rename.
    """
    tmp = path.with_name(f".{path.name}.partial")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    entry = {"bytes": tmp.stat().st_size, "sha256": sha256_file(tmp)}
    if fault is not None:
        fault_point(KILL_IN_WRITE, fault[0], fault[1], path.parent.parent.parent)  # run_dir/checkpoints/step.tmp/file
    os.replace(tmp, path)
    return entry


def write_text_atomic(path: Path, text: str) -> dict[str, Any]:
    return write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))


def finish_directory(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest last, then rename ``tmp`` to ``final`` (replacing an older one)."""
    write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2))
    _fsync_dir(tmp)
    if final.exists() or final.is_symlink():  # re-reaching a step after resuming from an older checkpoint
        remove_checkpoint(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


DELETING = ".deleting"  # suffix of a checkpoint being removed: renamed first, so removal is atomic


def remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint directory atomically: rename it out of the ``step_*`` namespace, then delete.

    A kill at any moment leaves either the whole checkpoint or a ``*.deleting`` leftover that
    :func:`prune` cleans. A symbolic link is removed as a link: nothing it points to is touched.
    """
    path = Path(path)
    if path.is_symlink():
        path.unlink()
        return
    if not path.exists():
        return
    doomed = path if path.name.endswith(DELETING) else path.with_name(path.name + DELETING)
    if doomed != path:
        if doomed.exists():  # an earlier removal of the same step was killed
            shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)  # atomic: from here on it is no checkpoint, whatever is left of it
        _fsync_dir(doomed.parent)
    fault_point(KILL_IN_PRUNE, _step_of(path), 0, doomed.parent.parent)
    shutil.rmtree(doomed, ignore_errors=True)  # never follows links inside (they are unlinked)


def _step_of(path: Path) -> int:
    m = re.match(r"step_(\d{8})", path.name)
    return int(m.group(1)) if m else -1


def prune(run_dir: Path, keep: int, newest: Path) -> list[Path]:
    """Keep the ``keep`` newest complete checkpoints (0 = all); drop leftovers of interrupted saves.

    Leftovers: ``step_*.tmp`` older than ``newest`` (a save that was killed), ``step_*.deleting`` and
    ``step_*.replaced`` (a removal that was killed), and ``step_*`` directories without a manifest
    older than ``newest`` (removals by earlier releases, which deleted in place). Symbolic links are
    left alone: they are not this run's checkpoints, and what they point to is not this run's to delete.
    """
    removed = []
    found = complete_checkpoints(run_dir)
    if keep > 0:
        for d in found[:-keep]:
            remove_checkpoint(d)
            removed.append(d)
    for d in checkpoints_dir(run_dir).glob("step_*"):
        if d.is_symlink():
            continue
        if d.name.endswith((DELETING, ".replaced")):
            remove_checkpoint(d)
        elif d.name.endswith(".tmp") or (STEP_DIR.match(d.name) and not (d / MANIFEST).is_file()):
            if d.name < newest.name:
                remove_checkpoint(d)
    return removed


# --------------------------------------------------------------------------- reading


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's manifest, checked against :data:`~subnetdp.train.checkpoints.schema.MANIFEST`."""
    path = Path(ckpt) / MANIFEST
    try:
        manifest = records.read_json(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing: {ckpt} is not a complete checkpoint") from None
    except records.BadJSON as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}): the manifest is corrupted") from None
    if isinstance(manifest, dict) and manifest.get("format") == FORMAT_1:
        raise CheckpointError(f"{path}: format {FORMAT_1!r} (a full copy per rank, written before checkpoints "
                              f"were keyed by unit), this version reads {FORMAT!r} only: resume, evaluate or "
                              "export it with the subnetdp release that wrote it (its export is a plain "
                              "state_dict any release can use), or start a new run")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: format {found!r}, expected {FORMAT!r}: not a subnetdp checkpoint")
    # Every field a reader uses, typed, and every file name plain, before any other file is read.
    records.check(schema.MANIFEST, manifest, path, "the manifest is damaged or was not written by subnetdp")
    return manifest


def _safetensors_identity(path: Path) -> dict[str, str] | None:
    """The metadata of a safetensors file, or None if it is not one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # any parse failure: the file is not (or no longer) a safetensors file
        return None


def verify_file(ckpt: Path, name: str, manifest: dict[str, Any]) -> Path:
    """Check that ``name`` exists with the size and checksum the manifest records."""
    path = check_size(ckpt, name, manifest)
    entry = manifest["files"][name]
    if sha256_file(path) != entry["sha256"]:
        meta = _safetensors_identity(path) if name.endswith(".safetensors") else None
        if meta and (meta.get("run_id") != manifest["run_id"] or meta.get("step") != str(manifest["step"])):
            raise CheckpointError(f"{path}: belongs to run {meta.get('run_id')} step {meta.get('step')}, not to this "
                                  f"checkpoint (run {manifest['run_id']} step {manifest['step']}): a shard from another run")
        raise CheckpointError(f"{path}: corrupted: its sha256 differs from the one in {MANIFEST}")
    return path


def check_size(ckpt: Path, name: str, manifest: dict[str, Any]) -> Path:
    """Check that ``name`` is a plain file of the checkpoint with the size the manifest records."""
    problem = records.plain_name_problem(name)
    if problem:  # read_manifest refuses such names; this guards every other caller too
        raise CheckpointError(f"{Path(ckpt) / MANIFEST}: names the file {name!r}, which {problem}: a checkpoint's "
                              "files are read from its own directory only")
    path = Path(ckpt) / name
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{path}: not listed in {MANIFEST}: the checkpoint was written for "
                              f"{manifest['world_size']} rank(s) or the manifest is corrupted")
    if path.is_symlink():
        raise CheckpointError(f"{path}: is a symbolic link (to {os.readlink(path)}): a checkpoint's files are "
                              "read from its own directory only; copy the file there instead")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the manifest lists it): a rank's file was lost or deleted; "
                              "restore it or resume from an older checkpoint")
    size = path.stat().st_size
    if size != entry["bytes"]:
        kind = "truncated" if size < entry["bytes"] else "longer than written"
        raise CheckpointError(f"{path}: {kind}: {size} bytes, the manifest records {entry['bytes']}")
    return path


class TensorFile:
    """A verified safetensors file of a checkpoint, read one tensor at a time (memory-mapped).

    Opening checks the metadata (format, run id, step and ``identity``, e.g. the rank), so a file
    copied in from another run, step or rank is named; :meth:`get` reads one tensor, never the file.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], identity: dict[str, str]) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        try:
            self._f = safe_open(str(path), framework="pt", device="cpu")
            meta = self._f.metadata() or {}
            self._keys = set(self._f.keys())
            self._offsets: dict[str, tuple[int, dict[str, Any]]] | None = None
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
        expected = {"format": FORMAT, "run_id": manifest["run_id"], "step": str(manifest["step"]), **identity}
        for key, value in expected.items():
            if meta.get(key) != value:
                raise CheckpointError(f"{path}: metadata {key}={meta.get(key)!r}, expected {value!r}: "
                                      "a shard from another run, step or rank")

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def keys(self) -> set[str]:
        return set(self._keys)

    def shape(self, key: str) -> list[int]:
        """Tensor ``key``'s shape, from the file's header (nothing is read)."""
        if key not in self._keys:
            self.get(key)  # raises, naming the file
        return list(self._f.get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise CheckpointError(f"{self.path}: lacks the tensor {key} that {MANIFEST} places in it: "
                                  "the checkpoint is corrupted")
        return self._f.get_tensor(key)

    def read_into(self, key: str, dst: torch.Tensor) -> None:
        """Read tensor ``key`` straight into ``dst`` (a contiguous CPU tensor or view of one): no
        intermediate copy, so a model is filled from a checkpoint without a second copy of anything."""
        if not (dst.device.type == "cpu" and dst.is_contiguous()):
            dst.copy_(self.get(key))
            return
        if key not in self._keys:
            self.get(key)  # raises, naming the file
        if self._offsets is None:
            self._offsets = _tensor_offsets(self.path)
        if key not in self._offsets:
            raise CheckpointError(f"{self.path}: lacks the tensor {key} in its header: the file changed after it "
                                  "was opened or is corrupted")
        start, info = self._offsets[key]
        if info["shape"] != list(dst.shape) or info["dtype"] != _ST_DTYPES.get(dst.dtype):
            raise CheckpointError(f"{self.path}: tensor {key} is {info['dtype']} {tuple(info['shape'])}, the model "
                                  f"needs {_ST_DTYPES.get(dst.dtype)} {tuple(dst.shape)}: the checkpoint is from a "
                                  "different model")
        size = info["data_offsets"][1] - info["data_offsets"][0]
        if size == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(start)
            got = f.readinto(memoryview(dst.detach().reshape(-1).view(torch.uint8).numpy()))
        if got != size:
            raise CheckpointError(f"{self.path}: truncated inside tensor {key}")


def _tensor_offsets(path: Path) -> dict[str, tuple[int, dict[str, Any]]]:
    """Each tensor's absolute data offset and header entry, from the safetensors header of ``path``.

    The header is data read from disk: it goes through the project's one JSON reader and is checked
    before use, so a crafted one (nested 200,000 deep, a 5000-digit integer, a length beyond the file)
    ends in one line naming the file, never in a traceback."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise CheckpointError(f"{path}: its safetensors header claims {n} bytes, the file holds {size}: "
                                  "truncated or not a safetensors file")
        try:
            header = records.parse_json(f.read(n))
        except records.BadJSON as e:
            raise CheckpointError(f"{path}: its safetensors header is not valid JSON ({e}): the file is "
                                  "corrupted") from None
    offsets = {}
    for k, v in header.items() if isinstance(header, dict) else [("", None)]:
        if k == "__metadata__":
            continue
        ends = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(ends, list) and len(ends) == 2 and all(type(x) is int for x in ends)
                and 0 <= ends[0] <= ends[1] <= size - 8 - n and isinstance(v.get("shape"), list)):
            raise CheckpointError(f"{path}: its safetensors header describes the tensor {k!r} as {str(v)[:80]}: "
                                  "the file is corrupted")
        offsets[k] = (8 + n + ends[0], v)
    return offsets


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` as a safetensors file, one tensor at a time.

    Unlike ``safetensors.torch.save_file`` this takes views (narrowed slices, tensors sharing
    storage) as they are and never builds the file in memory: at most one tensor is copied (made
    contiguous on the CPU) at any moment, so writing costs no second copy of what is written.
    """
    names = sorted(tensors)
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in names:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            t = tensors[name].detach().to("cpu").contiguous()
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def read_state(path: Path) -> dict[str, Any]:
    """A rank's state file, read with ``weights_only=True`` (never unpickles arbitrary objects)."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot be read safely ({first}): truncated, corrupted, or holding "
                              "objects other than tensors and plain containers") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a subnetdp state file")
    return state

"""Checkpoints under hostile conditions, in one process (comm ``local``).

Two short real runs write real checkpoints; each test damages a copy the way disks, users and
crashes do and checks that loading stops with a CheckpointError naming the file and the problem,
never a deep torch error, and never by unpickling an object.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints.units import PieceReader
from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import CheckpointError, NonFiniteError
from subnetdp.train.loop import train
from subnetdp.evaluate.export import load_union
from tests.helpers import plugin_manager, small_config

ONE = LaunchEnv(0, 1, 0, 1, "test")
BASE = ("comm.name=local", "masker.coverage=1", "train.batch_size=8", "optim.warmup_steps=0", "checkpoint.enabled=true",
        "checkpoint.final=always")


def train_loop(run_dir: Path, name: str, *overrides: str):
    cfg = small_config(*BASE, f"run.name={name}", *overrides, run_dir=run_dir)
    return train(cfg, ONE, plugin_manager())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt-runs")
    train_loop(root, "a", "train.steps=2", "checkpoint.every=1", "checkpoint.keep=0")
    train_loop(root, "b", "train.steps=1", "seed=1")
    return root


@pytest.fixture
def ckpt(runs, tmp_path) -> Path:
    """A private copy of run a's newest checkpoint (step 2)."""
    dst = tmp_path / "a" / "checkpoints" / "step_00000002"
    shutil.copytree(runs / "a" / "checkpoints" / "step_00000002", dst)
    return dst


def _load_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_union(path, plugin_manager())
    return str(e.value)


def _resume_error(path: Path, *overrides: str) -> str:
    with pytest.raises(CheckpointError) as e:
        train_loop(path.parent.parent.parent, "resumer", "train.steps=3", f"resume={path}", *overrides)
    return str(e.value)


def test_layout_manifest_and_retention(runs):
    a = runs / "a" / "checkpoints"
    assert sorted(p.name for p in a.iterdir()) == ["LINEAGE.json", "step_00000001", "step_00000002"]
    assert sorted(p.name for p in (runs / "b" / "checkpoints").iterdir()) == ["LINEAGE.json", "step_00000001"]  # every=0: at the end
    files = sorted(p.name for p in (a / "step_00000002").iterdir())
    assert files == ["MANIFEST.json", "config.yaml", "pieces_0.safetensors", "plan.json", "rank_0.safetensors",
                     "rank_0.state.pt"]
    manifest = ck.read_manifest(a / "step_00000002")
    assert manifest["format"] == "subnetdp-checkpoint/2"
    assert manifest["step"] == 2 and manifest["world_size"] == 1 and set(manifest["files"]) == set(files) - {"MANIFEST.json"}
    for name, entry in manifest["files"].items():
        assert ck.sha256_file(a / "step_00000002" / name) == entry["sha256"]
    # The state file holds nothing but tensors and plain containers.
    state = ck.read_state(a / "step_00000002" / "rank_0.state.pt")
    assert state["step"] == 2 and state["loader"] == {"epoch": 0, "batch": 2}
    assert isinstance(state["rng"]["torch"], torch.Tensor) and state["optimizer"]["class"] == "SGD"
    # Every parameter piece is indexed, with its optimizer state beside it (SGD momentum).
    reader = PieceReader(a / "step_00000002", manifest)
    assert reader.kinds("fc.weight")["optim"] == {"momentum_buffer"}
    assert reader.get("fc.weight").shape == (10, 512)
    # A run directory resolves to its newest checkpoint; the union loads from the files alone.
    assert ck.resolve_checkpoint(runs / "a").name == "step_00000002"
    loaded = load_union(runs / "a", plugin_manager())
    assert loaded.manifest["step"] == 2 and sum(p.numel() for p in loaded.model.parameters()) > 10_000_000


def test_truncated_file(ckpt):
    f = ckpt / "pieces_0.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    msg = _load_error(ckpt)
    assert str(f) in msg and "truncated: 1000 bytes" in msg
    msg = _resume_error(ckpt)
    assert str(f) in msg and "truncated" in msg and msg.startswith("rank 0:")


def test_corrupted_byte(ckpt):
    f = ckpt / "rank_0.state.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    msg = _resume_error(ckpt)
    assert str(f) in msg and "corrupted: its sha256 differs" in msg


def test_shard_from_another_run(ckpt, runs):
    for name in ("pieces_0.safetensors", "rank_0.safetensors"):
        own = (ckpt / name).read_bytes()
        shutil.copy(runs / "b" / "checkpoints" / "step_00000001" / name, ckpt / name)
        msg = _load_error(ckpt)
        assert "a shard from another run" in msg and "step 1" in msg and str(ckpt / name) in msg
        (ckpt / name).write_bytes(own)


def test_missing_rank_file(ckpt):
    (ckpt / "rank_0.safetensors").unlink()
    msg = _load_error(ckpt)
    assert str(ckpt / "rank_0.safetensors") in msg and "missing" in msg
    (ckpt / "pieces_0.safetensors").unlink()
    msg = _resume_error(ckpt)
    assert str(ckpt / "pieces_0.safetensors") in msg and "missing" in msg


def test_manifest_damaged_or_absent(ckpt):
    (ckpt / "MANIFEST.json").write_text('{"format": "subnetdp-checkpoint/1", "run_id"')
    assert "not valid JSON" in _load_error(ckpt)
    (ckpt / "MANIFEST.json").write_text(json.dumps({"format": "something-else"}))
    assert "not a subnetdp checkpoint" in _load_error(ckpt)
    (ckpt / "MANIFEST.json").unlink()  # what an interrupted save leaves: not a checkpoint
    msg = _load_error(ckpt)
    assert "not a checkpoint (no MANIFEST.json" in msg
    assert ck.latest_checkpoint(ckpt.parent.parent) is None


class _Exploit:
    """Unpickling this would create a file: weights_only loading must refuse it first."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_state_file_with_a_pickled_object_is_refused_unexecuted(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    f = ckpt / "rank_0.state.pt"
    state = ck.read_state(f)
    state["loader"] = _Exploit(marker)
    torch.save(state, f)
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())  # a consistent manifest: checksums pass
    manifest["files"][f.name] = {"bytes": f.stat().st_size, "sha256": ck.sha256_file(f)}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))
    msg = _resume_error(ckpt)
    assert str(f) in msg and "cannot be read safely" in msg
    assert not marker.exists()
    # A foreign file under a valid name (and matching checksums) is named too.
    f.write_bytes(b"not a torch file at all")
    manifest["files"][f.name] = {"bytes": f.stat().st_size, "sha256": ck.sha256_file(f)}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))
    assert "cannot be read safely" in _resume_error(ckpt)


def test_resume_refuses_other_model_partition_or_format(ckpt):
    msg = _resume_error(ckpt, "model.zero_init_residual=true")
    assert "written for model" in msg and "zero_init_residual" in msg
    msg = _resume_error(ckpt, "masker.granularity=neuron")
    assert "written for a partition of 8 block-level units" in msg and "masker.granularity" in msg
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())
    (ckpt / "MANIFEST.json").write_text(json.dumps({**manifest, "plan_digest": "0123456789abcdef"}))
    assert "plan.json: does not match MANIFEST.json" in _resume_error(ckpt)
    (ckpt / "MANIFEST.json").write_text(json.dumps({**manifest, "format": "subnetdp-checkpoint/1"}))
    for msg in (_resume_error(ckpt), _load_error(ckpt)):
        assert "format 'subnetdp-checkpoint/1'" in msg and "reads 'subnetdp-checkpoint/2' only" in msg
        assert "release that wrote it" in msg


def test_nonfinite_stop_keeps_the_last_good_checkpoint_and_skip_skips(tmp_path):
    with pytest.raises(NonFiniteError) as e:
        train_loop(tmp_path, "nan", "train.steps=4", "checkpoint.every=1", "optim.lr=1e30")
    assert "non-finite loss or gradients at step 2, rank(s) 0" in str(e.value)
    good = tmp_path / "nan" / "checkpoints" / "step_00000001"
    assert str(good) in str(e.value)
    assert ck.latest_checkpoint(tmp_path / "nan") == good
    load_union(good, plugin_manager())  # intact
    # skip: every step after the first is skipped, so the weights stay those of step 1.
    run = train_loop(tmp_path, "skip", "train.steps=3", "optim.lr=1e30", "train.on_nonfinite=skip")
    step1 = PieceReader(good, ck.read_manifest(good)).get("fc.weight")
    params = dict(run.state.model.named_parameters())
    assert run.state.step == 3 and torch.equal(params["fc.weight"], step1)


def test_adamw_run_extended_by_resume_is_bit_identical(tmp_path):
    """2 steps, then ``resume=auto`` with ``train.steps=4``, equals 4 straight steps (AdamW state included)."""
    extra = ("optim.name=adamw", "optim.lr=1e-3", "optim.schedule=constant")
    straight = train_loop(tmp_path, "straight", "train.steps=4", *extra)
    train_loop(tmp_path, "extended", "train.steps=2", "resume=auto", *extra)  # fresh start: no checkpoint yet
    extended = train_loop(tmp_path, "extended", "train.steps=4", "resume=auto", *extra)
    assert extended.state.step == 4
    for (name, a), (_, b) in zip(straight.state.model.state_dict().items(), extended.state.model.state_dict().items()):
        assert torch.equal(a, b), name
    sa, sb = straight.state.optimizer.state_dict()["state"], extended.state.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)


def test_local_steps_hand_a_nonfinite_inner_step_to_the_synchronisation(tmp_path):
    """With ``sync.mode=local_steps`` the guard defers a bad inner step to the synchroniser: the run
    stops at the next synchronisation (naming it and the count), or, with ``skip``, trains on."""
    local = ("sync.mode=local_steps", "sync.every=2", "optim.lr=1e30", "checkpoint.enabled=false",
             "checkpoint.final=auto")
    with pytest.raises(NonFiniteError) as e:
        train_loop(tmp_path, "ls-nan", "train.steps=4", *local)
    assert "in the local steps before the synchronisation at step 2 (rank 0: 1 step(s))" in str(e.value)
    run = train_loop(tmp_path, "ls-skip", "train.steps=4", *local, "train.on_nonfinite=skip")
    assert run.state.step == 4 and run.state.synchronizer.syncs == 2


def test_resume_refuses_a_float64_piece_naming_file_piece_and_dtype(ckpt):
    """A piece stored as float64 is refused on resume (as ``eval`` refuses it), not cast to float32."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    manifest = json.loads((ckpt / ck.MANIFEST).read_text())
    key, entry = next((k, e) for k, e in manifest["pieces"].items() if "@" not in k)
    f = ckpt / entry["file"]
    with safe_open(str(f), "pt") as opened:
        metadata = opened.metadata()  # the shard's identity (format, run, step, rank) stays
    tensors = load_file(f)
    tensors[key] = tensors[key].double()
    save_file(tensors, f, metadata=metadata)
    manifest["files"][f.name] = {"bytes": f.stat().st_size, "sha256": ck.sha256_file(f)}
    (ckpt / ck.MANIFEST).write_text(json.dumps(manifest))
    msg = _resume_error(ckpt)
    assert msg.count("\n") == 0 and str(f) in msg and f"piece {key} is float64" in msg and "float32" in msg


@pytest.mark.parametrize("header", [b"[" * 200_000, b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, '
                                    + b"9" * 5000 + b"]}}", None])
def test_crafted_safetensors_header_is_one_line_naming_the_file(tmp_path, header):
    # The header is read a second time by read_into (after safe_open checked it): a file changed in
    # between, or crafted, must end in a CheckpointError naming it, not a RecursionError or ValueError.
    path = tmp_path / "rank_0.safetensors"
    ck.save_safetensors(path, {"w": torch.ones(2)}, {"format": ck.FORMAT, "run_id": "r", "step": "1"})
    f = ck.TensorFile(path, {"run_id": "r", "step": 1}, {})
    raw = header if header is not None else b"{}"
    claimed = len(raw) if header is not None else 1 << 40  # None: a header length beyond the file
    path.write_bytes(claimed.to_bytes(8, "little") + raw + b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"rank_0\.safetensors: its safetensors header") as e:
        f.read_into("w", torch.empty(2))
    assert "\n" not in str(e.value)

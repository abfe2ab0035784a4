"""Hostile inputs, in one process (comm ``local``), with real files and real symbolic links.

A crafted checkpoint must never run code on ``eval`` / ``export``; a run never writes, deletes or
resumes outside its own directory, whatever links its checkpoint tree holds; a recipe that is not
one is shown by its first lines only.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from subnetdp import cli
from subnetdp.train.checkpoints import files as ck
from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import CheckpointError, ConfigError
from subnetdp.train.loop import train
from subnetdp.plugins.data.cifar import write_tiny_cifar
from tests.helpers import plugin_manager, small_config

ONE = LaunchEnv(0, 1, 0, 1, "test")
BASE = ("comm.name=local", "masker.coverage=1", "train.batch_size=8", "optim.warmup_steps=0",
        "checkpoint.enabled=true", "checkpoint.keep=0")


def _train(run_dir: Path, name: str, *overrides: str):
    cfg = small_config(*BASE, f"run.name={name}", *overrides, run_dir=run_dir)
    return train(cfg, ONE, plugin_manager())


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A real run with checkpoints at steps 1 and 2."""
    root = tmp_path_factory.mktemp("hostile")
    _train(root, "src", "train.steps=2", "checkpoint.every=1")
    return root / "src"


class _Payload:
    """Unpickling this runs Python code that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).touch()",))


def _craft(ckpt: Path, data: dict) -> None:
    """Rewrite a checkpoint's config.yaml data section and re-hash it in the manifest, as anyone can."""
    cfg = OmegaConf.load(ckpt / "config.yaml")
    cfg.data = OmegaConf.create(data)
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    manifest = json.loads((ckpt / ck.MANIFEST).read_text())
    f = ckpt / "config.yaml"
    manifest["files"]["config.yaml"] = {"bytes": f.stat().st_size, "sha256": ck.sha256_file(f)}
    (ckpt / ck.MANIFEST).write_text(json.dumps(manifest))


def test_crafted_checkpoint_cannot_run_code_on_eval_or_export(source, tmp_path, capsys):
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(ck.step_dir(source, 2), ckpt)
    evil = tmp_path / "evil"
    folder = write_tiny_cifar(evil)
    marker = tmp_path / "pwned"
    for name in ("data_batch_1", "test_batch"):  # what recalibration and evaluation read first
        with open(folder / name, "wb") as f:
            pickle.dump(_Payload(marker), f)
    _craft(ckpt, {"name": "cifar10", "root": str(evil), "verify_checksums": False})
    for argv in (["eval", str(ckpt)], ["export", str(ckpt), str(tmp_path / "out")]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "data.verify_checksums=false" in err and "data.root=DIR" in err, err
        assert not marker.exists()
    assert not (tmp_path / "out").exists()
    # With checksums on, the crafted files fail torchvision's published MD5s before a byte is unpickled.
    _craft(ckpt, {"name": "cifar10", "root": str(evil), "verify_checksums": True})
    assert cli.main(["eval", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "MD5 differs" in err and not marker.exists(), err
    # Data the user names on the command line replaces the checkpoint's: evaluation runs.
    assert cli.main(["eval", str(ckpt), "data.name=digits", "data.image_size=8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 2 and 0.0 <= out["eval"]["accuracy"] <= 1.0
    assert cli.main(["eval", str(ckpt), "seed=3"]) == 2  # only data.* may be chosen
    assert "data.* overrides only" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../../x", "/abs/path", "..", "a/b", "n" * 256])
def test_run_name_that_leaves_run_dir_is_refused(name, tmp_path):
    with pytest.raises(ConfigError) as e:
        small_config(f"run.name={name}", run_dir=tmp_path)
    assert str(e.value).startswith("run.name=")
    assert list(tmp_path.iterdir()) == []


def test_links_in_the_checkpoint_tree_are_never_followed(source, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(source, other)
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    root = ck.checkpoints_dir(tmp_path / "victim")
    root.mkdir(parents=True)
    # A save over a .tmp link, a newer step_* link resume=auto would take, and an old one pruning would delete.
    (root / "step_00000001.tmp").symlink_to(ck.step_dir(other, 1))
    (root / "step_00000009").symlink_to(ck.step_dir(other, 2))
    (root / "step_00000000").symlink_to(ck.step_dir(other, 1))
    run = _train(tmp_path, "victim", "train.steps=2", "checkpoint.every=1", "checkpoint.keep=1", "resume=auto")
    assert run.step == 2
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before  # nothing there touched
    assert [p.name for p in ck.complete_checkpoints(run.run_dir)] == ["step_00000002"]
    assert (root / "step_00000009").is_symlink() and (root / "step_00000000").is_symlink()
    assert not (root / "step_00000001.tmp").exists()  # the link itself is gone, its target is not
    # A file of a checkpoint that is a link is refused; so is checkpoints/ itself as a link.
    shutil.copytree(ck.step_dir(other, 2), tmp_path / "linked")
    (tmp_path / "linked" / "plan.json").unlink()
    (tmp_path / "linked" / "plan.json").symlink_to(ck.step_dir(other, 2) / "plan.json")
    with pytest.raises(CheckpointError, match="symbolic link"):
        from subnetdp.evaluate.export import load_union
        load_union(tmp_path / "linked", plugin_manager())
    (tmp_path / "linked2").mkdir()
    (tmp_path / "linked2" / "checkpoints").symlink_to(ck.checkpoints_dir(other))
    with pytest.raises(CheckpointError, match="symbolic link"):
        _train(tmp_path, "linked2", "train.steps=1")
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before


def test_a_recipe_that_is_not_one_shows_its_first_lines_only(tmp_path, capsys):
    secret = tmp_path / "secrets.txt"
    secret.write_text("".join(f"user{i}:x:{i}:{i}:secret-{i}:/home/u{i}:/bin/sh\n" for i in range(50)))
    binary = tmp_path / "blob"
    binary.write_bytes(b"\x7fELF\x00\x01" * 100)
    for path in (secret, binary):
        assert cli.main(["plan", str(path), "-n", "2", "--no-estimate"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "secret-3" not in err and len(err) < 600, err
    assert cli.main(["plan", str(secret), "-n", "2", "--no-estimate"]) == 2
    assert "user0:x:0:0:secret-0" in capsys.readouterr().err  # the opening is shown, so the user sees what it is

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
    assert run.state.step == 2
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before  # nothing there touched
    assert [p.name for p in ck.complete_checkpoints(run.context.run_dir)] == ["step_00000002"]
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


# --------------------------------------------------------------------------- a checkpoint's files are data


@pytest.fixture(scope="module")
def lm_source(tmp_path_factory) -> Path:
    """A real language-model run (tokens built from the standard library into its own cache) whose
    config used an interpolation: the checkpoint stores it resolved."""
    root = tmp_path_factory.mktemp("hostile-lm")
    cfg = small_config(*BASE, "run.name=lm", "train.steps=1", "train.batch_size=4", "eval.batches=1",
                       "data.stdlib_max_mb=0.5", "data.seq_len=32", f"data.cache_dir={root / 'train-cache'}",
                       "eval.batch_size=${train.batch_size}", "checkpoint.final=always", recipe="llama_tiny_stdlib",
                       run_dir=root)
    train(cfg, ONE, plugin_manager())
    return ck.latest_checkpoint(root / "lm")


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt" / ckpt.name
    shutil.copytree(ckpt, dst)
    return dst


def _rehash(ckpt: Path, name: str) -> None:
    manifest = json.loads((ckpt / ck.MANIFEST).read_text())
    manifest["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": ck.sha256_file(ckpt / name)}
    (ckpt / ck.MANIFEST).write_text(json.dumps(manifest))


def _one_line_error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("subnetdp: error: "), err
    return err


def test_eval_and_export_write_only_where_their_invocation_says(lm_source, tmp_path, monkeypatch, capsys):
    """The checkpoint's data.cache_dir (crafted, or an honest absolute path from another machine) and
    data.download are never used: the default, resolved in the working directory, or data.KEY given."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    honest = _copy(lm_source, tmp_path)
    assert OmegaConf.load(honest / "config.yaml").data.cache_dir == str(lm_source.parents[2] / "train-cache")
    shutil.rmtree(lm_source.parents[2] / "train-cache")  # as on another machine: that path means nothing here
    assert cli.main(["eval", str(honest)]) == 0
    assert not (lm_source.parents[2] / "train-cache").exists()
    assert any((cwd / "runs" / "data").rglob("*train*.bin"))  # the default, under the working directory
    crafted = tmp_path / "crafted"
    shutil.copytree(honest, crafted)
    cfg = OmegaConf.load(crafted / "config.yaml")
    cfg.data.cache_dir = str(tmp_path / "elsewhere")
    (crafted / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    _rehash(crafted, "config.yaml")
    mine = tmp_path / "mine"
    assert cli.main(["eval", str(crafted), f"data.cache_dir={mine}"]) == 0  # the checkpoint's other data keys kept
    assert cli.main(["export", str(crafted), str(tmp_path / "hf"), f"data.cache_dir={tmp_path / 'mine-hf'}",
                     "--format", "hf"]) == 0
    assert any(mine.rglob("*train*.bin")) and any((tmp_path / "mine-hf").rglob("*train*.bin"))
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert not (tmp_path / "elsewhere").exists()
    capsys.readouterr()


def test_a_checkpoint_cannot_ask_for_a_download(source, tmp_path, capsys):
    ckpt = _copy(ck.step_dir(source, 2), tmp_path)
    _craft(ckpt, {"name": "cifar10", "root": str(tmp_path / "dl"), "download": True})
    assert "CIFAR-10 not found" in _one_line_error(capsys, ["eval", str(ckpt)])
    assert not (tmp_path / "dl").exists()  # data.download is this invocation's (false), not the checkpoint's


def _manifest(tmp_path: Path, source: Path, change) -> Path:
    """A copy of a real checkpoint's manifest, changed by ``change(manifest)``, in a folder of its own."""
    ckpt = tmp_path / "m" / "step_00000002"
    ckpt.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((ck.step_dir(source, 2) / ck.MANIFEST).read_text())
    change(manifest)
    (ckpt / ck.MANIFEST).write_text(json.dumps(manifest))
    return ckpt


def test_a_manifest_names_only_files_inside_the_checkpoint(source, tmp_path, capsys):
    ckpt = _copy(ck.step_dir(source, 2), tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(str(ckpt / "pieces_0.safetensors"), outside / "p0.safetensors")
    manifest = json.loads((ckpt / ck.MANIFEST).read_text())
    name = "../../outside/p0.safetensors"
    manifest["files"][name] = manifest["files"].pop("pieces_0.safetensors")
    for entry in manifest["pieces"].values():
        entry["file"] = name
    (ckpt / ck.MANIFEST).write_text(json.dumps(manifest))
    for argv in (["eval", str(ckpt)], ["export", str(ckpt), str(tmp_path / "out")]):
        err = _one_line_error(capsys, argv)
        assert f"{ckpt / ck.MANIFEST}: files has the key {name!r}" in err and "plain file name" in err, err
    assert not (tmp_path / "out").exists()


BAD_NAMES = ["../x", "/etc/passwd", "a/b", "a\\b", ".", "..", "x\0y", ""]
NAME_FIELDS = {  # where a manifest carries a file name -> how to put one there
    "files": lambda m, bad: m["files"].update({bad: m["files"]["plan.json"]}),
    "pieces['fc.weight'].file": lambda m, bad: m["pieces"]["fc.weight"].update(file=bad),
    "pieces['fc.weight'].copies['0']": lambda m, bad: m["pieces"]["fc.weight"].update(copies={"0": bad}),
}


@pytest.mark.parametrize("where", list(NAME_FIELDS))
def test_every_file_name_in_a_manifest_is_a_plain_name(where, source, tmp_path):
    for bad in BAD_NAMES:
        ckpt = _manifest(tmp_path, source, lambda m: NAME_FIELDS[where](m, bad))
        with pytest.raises(CheckpointError) as e:
            ck.read_manifest(ckpt)
        msg = str(e.value)
        assert msg.startswith(f"{ckpt / ck.MANIFEST}: {where}") and repr(bad) in msg and "\n" not in msg, msg
    with pytest.raises(CheckpointError, match="names the file '../x'"):  # and whoever builds a manifest by hand
        ck.verify_file(ckpt, "../x", {"files": {"../x": {"bytes": 0, "sha256": ""}}})


def test_a_stored_config_is_never_resolved(source, lm_source, tmp_path, monkeypatch):
    text = (lm_source / "config.yaml").read_text()
    assert "${" not in text and OmegaConf.create(text).eval.batch_size == 4  # the run stored it resolved
    monkeypatch.setenv("SUBNETDP_TEST_SECRET", "7")
    honest = (ck.step_dir(source, 2) / "config.yaml").read_text()
    for key, line, crafted in (("seed", "seed: 0", "seed: ${oc.env:SUBNETDP_TEST_SECRET}"),
                               ("data.root", "  root: ''", "  root: /x/${run.dir}"),
                               ("optim.betas[1]", "  - 0.999", "  - '${seed}'")):
        ckpt = _copy(ck.step_dir(source, 2), tmp_path / key)
        assert line in honest
        (ckpt / "config.yaml").write_text(honest.replace(line, crafted, 1))
        _rehash(ckpt, "config.yaml")
        with pytest.raises(CheckpointError) as e:
            from subnetdp.evaluate.export import load_union
            load_union(ckpt, plugin_manager())
        msg = str(e.value)
        assert msg.startswith(f"{ckpt / 'config.yaml'}: {key} holds the interpolation") and "\n" not in msg, msg


DAMAGED_MANIFESTS = {  # change -> what the message names
    "pieces-list": (lambda m: m.update(pieces=[]), "pieces is [] (a list), expected a mapping"),
    "files-str": (lambda m: m.update(files="x"), "files is 'x' (a string), expected a mapping"),
    "data_spec-extra": (lambda m: m["data_spec"].update(evil=1), "data_spec has the field 'evil'"),
    "step-str": (lambda m: m.update(step="2"), "step is '2' (a string), expected an integer >= 0"),
    "world_size-0": (lambda m: m.update(world_size=0), "world_size is 0 (an integer), expected an integer >= 1"),
    "bytes-str": (lambda m: m["files"]["plan.json"].update(bytes="1"), "files['plan.json'].bytes is '1'"),
    "sha-missing": (lambda m: m["files"]["plan.json"].pop("sha256"), "lacks the field files['plan.json'].sha256"),
    "shape-neg": (lambda m: m["pieces"]["fc.weight"].update(shape=[-1]), "pieces['fc.weight'].shape[0] is -1"),
    "model-list": (lambda m: m.update(model=[1]), "model is [1] (a list)"),
    "run_id-missing": (lambda m: m.pop("run_id"), "lacks the field run_id"),
    "top-list": (lambda m: m.clear() or m.update(format="subnetdp-checkpoint/2"), "lacks the field run_id"),
}


@pytest.mark.parametrize("case", list(DAMAGED_MANIFESTS))
def test_a_damaged_manifest_is_one_line_naming_the_field(case, source, tmp_path):
    change, expected = DAMAGED_MANIFESTS[case]
    ckpt = _manifest(tmp_path, source, change)
    with pytest.raises(CheckpointError) as e:
        ck.read_manifest(ckpt)
    msg = str(e.value)
    assert msg.startswith(f"{ckpt / ck.MANIFEST}: ") and expected in msg and "\n" not in msg, msg


DEEP = "[" * 200_000 + "]" * 200_000  # past the JSON parser's recursion limit


@pytest.mark.parametrize("name, text, expected", [
    (ck.MANIFEST, DEEP, "nested deeper than the JSON parser can follow"),
    (ck.MANIFEST, '{"format": "subnetdp-checkpoint/2", "step": ' + "7" * 5000 + "}", "a number too long to read"),
    ("plan.json", DEEP, "nested deeper than the JSON parser can follow"),
], ids=["manifest-deep", "manifest-long-int", "plan-deep"])
def test_a_crafted_json_file_is_one_line_naming_it(name, text, expected, source, tmp_path):
    from subnetdp.train.checkpoints.source import read_plan
    ckpt = _copy(ck.step_dir(source, 2), tmp_path)
    (ckpt / name).write_text(text)
    if name != ck.MANIFEST:
        _rehash(ckpt, name)
    with pytest.raises(CheckpointError) as e:
        read_plan(ckpt, ck.read_manifest(ckpt))
    msg = str(e.value)
    assert msg.startswith(f"{ckpt / name}: ") and expected in msg and "\n" not in msg, msg


def test_a_damaged_manifest_stops_a_resume_before_any_worker(source, tmp_path):
    ckpt = _copy(ck.step_dir(source, 2), tmp_path)
    manifest = json.loads((ckpt / ck.MANIFEST).read_text())
    (ckpt / ck.MANIFEST).write_text(json.dumps({**manifest, "pieces": []}))
    from subnetdp.train.setup import preflight
    cfg = small_config("run.name=r", f"resume={ckpt}", run_dir=tmp_path)
    with pytest.raises(CheckpointError, match=r"MANIFEST.json: pieces is \[\]"):
        preflight(cfg, 2, plugin_manager())  # what the launcher runs before it starts any worker


@pytest.mark.parametrize("summary, expected", [
    ('{"steps": "abc"}', "steps is 'abc' (a string), expected an integer >= 0"),
    ('{"steps": [1]}', "steps is [1] (a list), expected an integer >= 0"),
    ('{"steps": 2, "eval": {"accuracy": "x"}}', "eval['accuracy'] is 'x' (a string), expected a number"),
    ('{"steps": 2, "eval": [1]}', "eval is [1] (a list), expected null or a mapping"),
    ('{"eval": {}}', "lacks the field steps"),
    ("[]", "the file is [] (a list), expected a mapping with steps"),
    ('{"steps": 2', "cannot be read as JSON"),
    (DEEP, "cannot be read as JSON (nested deeper than the JSON parser can follow)"),
])
def test_a_damaged_summary_stops_resume_auto_in_one_line(summary, expected, tmp_path, capsys):
    run = tmp_path / "s"
    run.mkdir()
    (run / "summary.json").write_text(summary)
    err = _one_line_error(capsys, ["train", "resnet18_digits", f"run.dir={tmp_path}", "run.name=s", "resume=auto",
                                   "train.steps=2", "optim.warmup_steps=0", "comm.name=local"])
    assert f"{run / 'summary.json'}: {expected}" in err and "delete" in err, err
    assert [p.name for p in run.iterdir()] == ["summary.json"]  # nothing started


def test_eval_of_a_run_that_kept_no_checkpoint_says_so_and_how_to_keep_one(source, tmp_path, capsys):
    # A run's own files without its checkpoints/: what checkpoint.enabled=false or a short run leaves.
    run = tmp_path / "nockpt"
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("checkpoints"))
    assert (run / "config.yaml").is_file() and not (run / "checkpoints").exists()
    for argv in (["eval", str(run)], ["export", str(run), str(tmp_path / "out")]):
        err = _one_line_error(capsys, argv)
        assert err.startswith(f"subnetdp: error: {run}: a run directory (metrics.jsonl, ") and "kept no checkpoint" in err
        assert "checkpoint.final=always" in err, err
    assert "no such checkpoint or run directory" in _one_line_error(capsys, ["eval", str(tmp_path / "missing")])

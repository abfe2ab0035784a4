"""docs/plugins.md is enough to write a model adapter: its code blocks, extracted from the Markdown,
make a package that pip installs and that trains two steps on 2 gloo ranks.

Blocks that belong to a file follow a ``<!-- file: PATH -->`` line; blocks of one file are joined by
two blank lines. The package is installed for real (offline, ``--no-deps`` into a target folder) and
used only through the ``subnetdp`` command line in subprocesses, through the real local launcher.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "plugins.md"
TEMPLATE_MODULE = REPO / "examples" / "plugin-template" / "src" / "subnetdp_strided" / "resmlp.py"
BLOCK = re.compile(r"<!-- file: (?P<path>\S+) -->\n```[a-z]*\n(?P<code>.*?)\n```", re.DOTALL)


def guide_files() -> dict[str, str]:
    files: dict[str, list[str]] = {}
    for m in BLOCK.finditer(GUIDE.read_text(encoding="utf-8")):
        files.setdefault(m["path"], []).append(m["code"])
    return {path: "\n\n\n".join(parts) + "\n" for path, parts in files.items()}


def test_guide_lists_every_kind_and_a_table_of_contents():
    text = GUIDE.read_text(encoding="utf-8")
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    anchors = re.findall(r"\]\(#([a-z0-9-]+)\)", contents)
    headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^## (.+)$", text, re.M)}
    assert len(anchors) >= 10 and set(anchors) <= headings, (anchors, headings)
    for kind in ("## 4. Masker", "## 5. Communicator", "## 6. Model adapter", "## 7. Dataset"):
        assert kind in text
    assert "docs/plugins.md" in (REPO / "README.md").read_text(encoding="utf-8")


def test_guide_lists_the_shared_keys_of_every_kind_as_the_code_has_them():
    import dataclasses

    from subnetdp.core.contracts import CommConfig, DataConfig, MaskerConfig, ModelConfig

    text = " ".join(GUIDE.read_text(encoding="utf-8").split())
    for shared in (MaskerConfig, CommConfig, ModelConfig, DataConfig):
        keys = ", ".join(f.name for f in dataclasses.fields(shared))
        assert f"`{shared.__name__}` has `{keys}`" in text, (shared.__name__, keys)


def guide_section(heading: str) -> str:
    """The text of the guide's section that starts with ``heading``, up to the next ``## ``."""
    text = GUIDE.read_text(encoding="utf-8")
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_guide_names_every_member_of_every_base_class_in_its_section():
    # "This page is the whole contract": a method added to a base class and left out of the guide
    # is one a plugin author never hears of. Plugin's own members belong to section 2.
    from subnetdp import Communicator, DataModule, Masker, ModelAdapter
    from subnetdp.core.contracts import Plugin

    sections = {Plugin: "## 2. What every plugin class has", Masker: "## 4. Masker",
                Communicator: "## 5. Communicator", ModelAdapter: "## 6. Model adapter", DataModule: "## 7. Dataset"}
    missing = {}
    for cls, heading in sections.items():
        members = {n for n in vars(cls) if not n.startswith("_")} - (set() if cls is Plugin else set(vars(Plugin)))
        body = guide_section(heading)
        missing[cls.__name__] = sorted(n for n in members if not re.search(rf"`{n}\b", body))
    assert len({n for n in vars(ModelAdapter) if not n.startswith("_")}) >= 20  # the walk sees the adapter's members
    assert missing == {name: [] for name in missing}, missing


def test_guide_shows_every_hook_with_the_hookspec_parameters():
    import inspect

    from subnetdp.core import hookspecs

    specs = {n: list(inspect.signature(f).parameters) for n, f in vars(hookspecs).items() if n.startswith("subnetdp_")}
    assert len(specs) == 8
    for name, params in specs.items():
        heading = "## 9. Lifecycle hooks" if name.startswith("subnetdp_on_") else "## 1. How a plugin is found"
        assert f"`{name}({', '.join(params)})`" in guide_section(heading), (name, params)


def test_adapter_built_from_the_guide_trains_on_two_gloo_ranks(tmp_path):
    files = guide_files()
    assert set(files) == {"pyproject.toml", "src/subnetdp_resmlp/__init__.py", "src/subnetdp_resmlp/resmlp.py"}
    # The guide shows the template's module, not a copy that drifts from it.
    assert files["src/subnetdp_resmlp/resmlp.py"] == TEMPLATE_MODULE.read_text(encoding="utf-8")
    pkg = tmp_path / "subnetdp-resmlp"
    for rel, code in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(code, encoding="utf-8")
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--disable-pip-version-check", "--target", str(site), str(pkg)],
                         capture_output=True, text=True, timeout=180)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(site), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("SUBNETDP_DISABLE_PLUGINS", None)

    listing = subprocess.run([sys.executable, "-m", "subnetdp", "plugins"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    row = next((line.split() for line in listing.stdout.splitlines() if line.startswith("resmlp ")), None)
    assert row is not None and row[1:4] == ["model", "subnetdp-resmlp", "0.1.0"], listing.stdout + listing.stderr

    runs = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, "-m", "subnetdp", "train", "model.name=resmlp", "data.name=digits", "launch.nproc=2",
         "comm.name=gloo", "masker.coverage=0.5", "train.steps=2", "train.batch_size=16", "train.progress=false",
         "eval.bn_recalibrate_batches=0", "checkpoint.enabled=false", f"run.dir={runs}", "run.name=guide"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    summary = json.loads((runs / "guide" / "summary.json").read_text())
    plan = json.loads((runs / "guide" / "plan.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2
    assert plan["owned"] == [[0, 1], [2, 3]]  # cyclic at C = 0.5: each rank holds two of the four blocks
    held = [r["params_held"] for r in summary["ranks"]]
    assert all(h < summary["full_model_params"] for h in held)
    assert 0.0 <= summary["eval"]["accuracy"] <= 1.0

    bad = subprocess.run([sys.executable, "-m", "subnetdp", "train", "model.name=resmlp", "data.name=digits",
                          "model.depth=0", f"run.dir={runs}"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "model.depth=0: must be >= 1" in bad.stderr, bad.stderr

"""docs/architecture.md's module list is generated from the package tree and cannot go stale."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "scripts" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_page_lists_every_module_as_the_tree_has_it():
    gen = _generator()
    page = gen.PAGE.read_text(encoding="utf-8")
    assert gen.render(page, gen.module_lines()) == page, "run `python scripts/architecture.py`"
    for path in (ROOT / "subnetdp").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        assert f"- `{name}` — " in page


def test_a_new_module_makes_the_page_stale(tmp_path):
    gen = _generator()
    package = tmp_path / "subnetdp"
    package.mkdir()
    (package / "__init__.py").write_text('"""Top."""\n')
    page = f"x\n{gen.BEGIN}\n{gen.END}\ny\n"
    fresh = gen.render(page, gen.module_lines(package))
    assert "- `subnetdp` — Top." not in fresh and "- `subnetdp.__init__` — Top." in fresh
    (package / "room.py").write_text('"""A new room.\n\nMore."""\n')
    assert gen.render(fresh, gen.module_lines(package)) != fresh
    assert "- `subnetdp.room` — A new room." in gen.render(fresh, gen.module_lines(package))

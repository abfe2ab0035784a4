"""Import paths of 0.1.0 still work for one release, warn naming the new path; the version is one number."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

import subnetdp
from subnetdp import cli
from subnetdp.core.moved import MOVED

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_import_path_is_the_new_module_with_a_warning(old: str) -> None:
    new = MOVED[old]
    assert importlib.util.find_spec(new) is not None, f"{old} points at {new}, which does not exist"
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} moved to {re.escape(new)}: import {re.escape(new)}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    # A file at the old path would shadow the alias (and a core/ one would break the layering).
    assert not (REPO / (old.replace(".", "/") + ".py")).exists()


def test_version_is_one_number_with_a_changelog_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"subnetdp {subnetdp.__version__}"
    assert subnetdp.__version__ != "0.1.0"
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{subnetdp.__version__}]" in changelog and "## [0.1.0]" in changelog
    for old, new in MOVED.items():
        if old.count(".") == 1 or old.startswith("subnetdp.core."):  # the public-facing moves are listed
            assert f"`{old}`" in changelog and f"`{new}`" in changelog, old

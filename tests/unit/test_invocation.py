"""Printed resume commands name the program as the user started it (.venv/bin/subnetdp, python -m subnetdp)."""

from __future__ import annotations

import shlex
import sys

import pytest

from subnetdp.launchers import invocation
from subnetdp.train.stopping import continue_command


@pytest.fixture
def no_record(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(invocation.INVOKED_ENV, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    return monkeypatch


def test_a_script_path_is_printed_as_typed(no_record: pytest.MonkeyPatch) -> None:
    no_record.setattr(sys, "argv", [".venv/bin/subnetdp", "train", "resnet18_digits", "resume=never", "run.name=a"])
    line = continue_command(sys.argv, "runs", "a")
    assert shlex.split(line) == [".venv/bin/subnetdp", "train", "resnet18_digits", "resume=auto", "run.dir=runs",
                                 "run.name=a"]


def test_python_dash_m_and_a_launchers_record(no_record: pytest.MonkeyPatch) -> None:
    # A worker's own command line is the launcher's `python -m subnetdp`: the interpreter as given.
    no_record.setattr(sys, "argv", ["/x/subnetdp/__main__.py", "train", "lr=1"])
    no_record.setattr(sys, "orig_argv", ["venv/bin/python3", "-m", "subnetdp", "train", "lr=1"])
    assert invocation.invoked_as() == ["venv/bin/python3", "-m", "subnetdp"]
    # The launching process recorded how the user started it; its workers print that.
    no_record.setenv(invocation.INVOKED_ENV, "'/my dir/.venv/bin/subnetdp'")
    assert shlex.split(continue_command(sys.argv, "r", "n"))[:2] == ["/my dir/.venv/bin/subnetdp", "train"]
    # On PATH under its own name, the bare name is what the user typed.
    no_record.delenv(invocation.INVOKED_ENV)
    no_record.setenv("PATH", str(invocation.Path(sys.executable).parent))
    no_record.setattr(sys, "argv", [str(invocation.Path(sys.executable).parent / "subnetdp"), "train"])
    assert invocation.invoked_as() == ["subnetdp"]

"""A run directory that cannot be written is one line naming run.dir, before any worker starts."""

from __future__ import annotations

import os
import stat

import pytest

from subnetdp.core.errors import ConfigError
from subnetdp.train import runlock


def test_run_dir_under_a_regular_file_is_one_line(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError) as err:
        runlock.check_free(blocker / "exp1")
    line = str(err.value)
    assert "\n" not in line and line.startswith("run.dir=")
    assert str(blocker / "exp1") in line and "not a folder" in line and "choose a run.dir" in line


def test_read_only_run_dir_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)  # 0500
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("this user (root) may write a 0500 directory")
        for run_dir in (ro, ro / "exp1"):  # the run directory itself, or the folder it would be made in
            with pytest.raises(ConfigError, match=r"^run\.dir=.*is not writable by this user — choose a run\.dir"):
                runlock.check_free(run_dir)
    finally:
        ro.chmod(stat.S_IRWXU)


def test_writable_and_missing_run_dirs_pass(tmp_path):
    runlock.check_free(tmp_path)
    runlock.check_free(tmp_path / "a" / "b")

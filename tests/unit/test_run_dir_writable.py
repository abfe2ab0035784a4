"""A run directory that cannot be written is one line naming run.dir, before any worker starts."""

from __future__ import annotations

import shutil
import stat

import pytest

from subnetdp.core.errors import ConfigError
from subnetdp.train import runlock
from tests.helpers import as_nobody, unprivileged_folder


def test_run_dir_under_a_regular_file_is_one_line(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError) as err:
        runlock.check_free(blocker / "exp1")
    line = str(err.value)
    assert "\n" not in line and line.startswith("run.dir=")
    assert str(blocker / "exp1") in line and "not a folder" in line and "choose a run.dir" in line


def test_read_only_run_dir_is_one_line():
    # As uid 65534 when run as root (root writes into any folder), in a folder that user owns.
    base = unprivileged_folder("run-dir-writable-")
    try:
        with as_nobody():
            ro = base / "ro"
            ro.mkdir()
            ro.chmod(stat.S_IRUSR | stat.S_IXUSR)  # 0500
            for run_dir in (ro, ro / "exp1"):  # the run directory itself, or the folder it would be made in
                with pytest.raises(ConfigError, match=r"^run\.dir=.*is not writable by this user — choose a run\.dir"):
                    runlock.check_free(run_dir)
            ro.chmod(stat.S_IRWXU)
            runlock.check_free(ro / "exp1")  # the same folder with its write bit back passes
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_writable_and_missing_run_dirs_pass(tmp_path):
    runlock.check_free(tmp_path)
    runlock.check_free(tmp_path / "a" / "b")

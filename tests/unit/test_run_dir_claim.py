"""A run directory the launching process cannot write is one line naming ``run.dir``, before any worker starts.

Under torchrun each worker otherwise failed on its own with an ``OSError`` on the lock file (or the
launcher with a ``FileExistsError`` traceback when the run's folder is a file).
"""

from __future__ import annotations

import os
import shutil

import pytest

from subnetdp import cli
from subnetdp.core.errors import ConfigError
from subnetdp.train.runlock import LOCK_FILE, check_writable
from tests.helpers import as_nobody, unprivileged_folder

LAUNCH = ["launch", "--nproc", "2", "resnet18_digits", "masker.coverage=1", "launch.threads_per_rank=1",
          "comm.name=gloo", "train.steps=1", "optim.warmup_steps=0"]


def test_launch_under_torchrun_refuses_a_run_folder_that_is_a_file_in_one_line(tmp_path, capsys):
    (tmp_path / "taken").write_text("not a folder")
    assert cli.main([*LAUNCH, f"run.dir={tmp_path}", "run.name=taken"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"subnetdp: error: run.dir='{tmp_path}': {tmp_path / 'taken'} is not a folder"), lines
    assert "chmod u+w" in lines[0] and "run.name" in lines[0]
    assert "torchrun" not in out  # refused before the command was printed or run
    assert (tmp_path / "taken").read_text() == "not a folder"


def test_a_folder_without_its_write_bit_is_refused_naming_the_folder():
    # As uid 65534 when run as root (root writes into any folder): the folder is that user's own, so only
    # its write bit decides.
    base = unprivileged_folder("run-dir-claim-")
    try:
        with as_nobody():
            run = base / "ro"
            run.mkdir()
            check_writable(run, str(base))  # a writable folder passes, as does one still to be made
            check_writable(run / "deeper" / "still", str(base))
            run.chmod(0o500)
            assert not os.access(run, os.W_OK)
            for where in (run, run / "missing"):
                with pytest.raises(ConfigError) as e:
                    check_writable(where, str(base))
                assert e.value.key == "run.dir" and str(e.value).startswith(f"run.dir='{base}': {run} is not writable")
            run.chmod(0o700)
            (run / LOCK_FILE).write_text("")
            (run / LOCK_FILE).chmod(0o400)
            with pytest.raises(ConfigError, match="is not writable"):
                check_writable(run, str(base))
    finally:
        shutil.rmtree(base, ignore_errors=True)

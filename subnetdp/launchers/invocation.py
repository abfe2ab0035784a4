"""How the user started ``subnetdp``, so the commands the program prints can be run again as typed.

A printed resume command that says ``subnetdp train ...`` fails for a user who ran
``.venv/bin/subnetdp`` (the README's form) or ``python -m subnetdp`` without the virtual environment
on ``PATH``. The launching process (``subnetdp train launch.nproc=N``, ``subnetdp launch``) records its
own invocation in :data:`INVOKED_ENV`; its workers, whose own command line is the launcher's
``python -m subnetdp``, inherit it. A process started otherwise (one process, or a worker of the
user's own ``torchrun``) reads its command line.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

INVOKED_ENV = "SUBNETDP_INVOKED_AS"


def _shortest(path: str) -> str:
    """``subnetdp`` when ``PATH`` finds this very file under that name, else the path as given."""
    name = Path(path).name
    found = shutil.which(name)
    if found and os.path.abspath(found) == os.path.abspath(path):  # not resolve(): a venv python is a symlink
        return name
    return path


def program_as_typed() -> list[str]:
    """This process's way of starting subnetdp: ``[".venv/bin/subnetdp"]`` or ``["python", "-m", "subnetdp"]``."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "__main__.py" or not argv0:  # python -m subnetdp (torchrun's workers too)
        python = (getattr(sys, "orig_argv", None) or [sys.executable])[0]
        return [_shortest(python), "-m", "subnetdp"]
    return [_shortest(argv0)]


def invoked_as() -> list[str]:
    """How the user started the job: the launcher's record (:data:`INVOKED_ENV`), else this process's."""
    recorded = os.environ.get(INVOKED_ENV, "")
    return shlex.split(recorded) if recorded else program_as_typed()


def record_invocation() -> None:
    """Called by a process that starts workers: they print commands in the form this one was started by."""
    os.environ.setdefault(INVOKED_ENV, shlex.join(program_as_typed()))

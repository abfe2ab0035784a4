"""Workers never outlive their launcher, and a launcher passes one signal on to its workers.

On Linux, :func:`die_with_parent` asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to kill
this process the moment its parent exits, whatever killed the parent (``kill -9`` included). A
worker calls it at start-up under every launcher (the local elastic launcher, ``torchrun``,
``mpirun``, ``srun``); ``subnetdp launch`` sets it on the launcher it starts, so killing
``subnetdp launch`` takes torchrun (or mpirun) and, through them, the workers with it. Elsewhere
(macOS, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "SUBNETDP_LAUNCHER_PID"  # set by the launchers this project starts: the workers' parent


def die_with_parent(expected_parent: int | None = None) -> bool:
    """Have the kernel SIGKILL this process when its parent exits; True where that is supported.

    Args:
        expected_parent: the parent's PID when known: if the parent already exited before the
            request was made (its orphans are adopted by another process), exit now.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(128 + int(signal.SIGKILL))  # the launcher died before we could ask: follow it
    return True


def worker_dies_with_launcher() -> None:
    """Called by a worker at start-up under any launcher."""
    parent = os.environ.get(PARENT_ENV)
    die_with_parent(int(parent) if parent and parent.isdigit() else None)


def run_child_launcher(cmd: Sequence[str], env: dict[str, str]) -> int:
    """Run a launcher (torchrun, mpirun, srun) that dies with this process; pass SIGINT/SIGTERM on once.

    The child starts in a session of its own, so a Ctrl-C in the terminal reaches this process
    only, and it forwards exactly one signal per signal received (a second Ctrl-C is the child's
    cue to abort at once). Returns the child's exit status (128 + signal when it was killed).
    """
    proc = subprocess.Popen(list(cmd), env=env, start_new_session=True,
                            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)

    def forward(signum: int, frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    saved = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, old in saved.items():
            signal.signal(s, old)
    return 128 - rc if rc < 0 else rc

"""Failed workers under torch's elastic agent (``torchrun``, ``subnetdp train launch.nproc=N``).

A worker whose error is kept in its run directory's log says so to its agent through the error file
the agent names (``TORCHELASTIC_ERROR_FILE``), in the file's plain-message form: torchrun's own
failure summary then shows that line (which rank stopped, why, where the log is) where it would say
"To enable traceback see ...", and our launchers read the log's path from it to say where each
worker's full error is, rather than pointing at a traceback that was never printed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Mapping, Optional

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: "console": leave the C++ side's stderr of workers, supervisors and agents on the console (debugging)
NATIVE_ENV = "SUBNETDP_NATIVE_STDERR"
LOG_FIELD = "subnetdp_log"  # our own field in the error file; torch reads only message and timestamp


def tell_agent(line: str, log: Optional[str]) -> None:
    """Leave ``line`` (and the log's path) in the agent's error file, when the agent named one."""
    path = os.environ.get(ERROR_FILE_ENV, "")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": str(int(time.time())), LOG_FIELD: log}, f)
    except OSError:
        pass


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def describe_failures(failures: Mapping[int, Any]) -> str:
    """``rank 0: exit code 2; rank 1: killed by SIGKILL ...``, then where each worker's error is.

    ``failures``: rank -> torch's ``ProcessFailure`` (``exitcode``, ``error_file_data``) of every
    failed worker.
    """
    how = "; ".join(f"rank {r}: {_how(int(f.exitcode))}" for r, f in sorted(failures.items()))
    logs: dict[int, str] = {}
    for r, f in failures.items():
        data = getattr(f, "error_file_data", None)
        if isinstance(data, dict) and isinstance(data.get(LOG_FIELD), str):
            logs[r] = data[LOG_FIELD]
    said = [f"a worker failed ({how})"]
    if logs:
        folders = {str(Path(p).parent) for p in logs.values()}
        if len(folders) == 1:
            names = ", ".join(Path(logs[r]).name for r in sorted(logs))
            said.append(f"the full errors are in {folders.pop()} ({names})")
        else:
            said.append("the full errors are in " + ", ".join(logs[r] for r in sorted(logs)))
    printed = [r for r, f in sorted(failures.items()) if r not in logs and int(f.exitcode) > 0]
    if len(printed) == 1:
        said.append(f"rank {printed[0]} printed its error above")
    elif printed:
        said.append(f"ranks {', '.join(map(str, printed))} printed their errors above")
    return "; ".join(said)

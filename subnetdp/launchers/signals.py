"""Signal handlers installed for a span of code and the previous ones put back after it.

The launcher's :class:`~subnetdp.launchers.local.StopWatch` and the worker's
:class:`~subnetdp.train.stopping.StopRequest` both take SIGINT and SIGTERM for as long as they run;
:class:`Handlers` is what both use, so neither leaves its handler behind. Python lets only the main
thread install handlers: elsewhere (a test calling the loop from a thread) nothing is installed.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Iterable


class Handlers:
    """Context manager: ``handler`` for each of ``signals`` inside the block, the previous after it."""

    def __init__(self, signals: Iterable[int], handler: Callable[[int, Any], Any]) -> None:
        self.signals, self.handler = tuple(signals), handler
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> "Handlers":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._saved[s] = signal.signal(s, self.handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, old in self._saved.items():
            signal.signal(s, old)
        self._saved.clear()

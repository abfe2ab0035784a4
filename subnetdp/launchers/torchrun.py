"""``python -m subnetdp.launchers.torchrun ARGS``: torchrun (``torch.distributed.run``), with one line on a signal.

torchrun turns SIGINT/SIGTERM into a ``SignalException``: it passes the signal to its workers (which
finish their step, write a checkpoint and exit) and then raises it, so the user's terminal ends in a
traceback. This entry point runs the same ``torch.distributed.run.main`` and ends that case with one
line and the exit status ``128 + signal``, as ``subnetdp train launch.nproc=N`` does. Everything else,
arguments included, is torchrun's.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as e:
        name = signal.Signals(int(e.sigval)).name
        print(f"torchrun: stopped by {name}: the workers were passed the signal and stopped at a step boundary "
              "(the run's newest checkpoint holds that step)", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

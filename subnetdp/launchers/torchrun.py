"""``python -m subnetdp.launchers.torchrun ARGS``: torchrun (``torch.distributed.run``), with one line on a signal.

torchrun turns SIGINT/SIGTERM into a ``SignalException``: it passes the signal to its workers (which
finish their step, write a checkpoint and exit) and then raises it, so the user's terminal ends in a
traceback. This entry point runs the same ``torch.distributed.run.main`` and ends that case with one
line and the exit status ``128 + signal``, as ``subnetdp train launch.nproc=N`` does; a worker group
that failed with no restart left, or a rendezvous that failed, ends with one line and status 1 (each
worker printed its own line above it; the line names the run directory's logs that hold their full
errors, :mod:`subnetdp.launchers.failures`). Everything else, arguments included, is torchrun's.

Each round of the rendezvous gets a fresh store for its workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
unless set): with the store shared by the agents (torch's default), a node that joins a running
elastic job waits for an address that the agent that was already rank 0 never publishes again, until the
store's read timeout (60 s) fails both agents (torch 2.14.1), and a re-formed group could read the keys of the previous one. The workers learn the
agent's process id (``SUBNETDP_LAUNCHER_PID``), so one whose agent died before it could ask to die
with it exits at once (:mod:`subnetdp.launchers.lifetime`).
"""

from __future__ import annotations

import os
import signal
import sys

from subnetdp.launchers.failures import describe_failures

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    from subnetdp.launchers.lifetime import PARENT_ENV

    os.environ.setdefault(SHARE_STORE_ENV, "1")
    os.environ[PARENT_ENV] = str(os.getpid())  # the workers' parent: they die with this agent
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as e:
        name = signal.Signals(int(e.sigval)).name
        print(f"torchrun: stopped by {name}: the workers were passed the signal and stopped at a step boundary "
              "(the run's newest checkpoint holds that step)", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(f"torchrun: no restart is left (--max-restarts): {describe_failures(e.failures)}", file=sys.stderr,
              flush=True)
        return 1
    except (RendezvousError, DistError) as e:
        print(f"torchrun: the rendezvous failed ({type(e).__name__}: {_first_line(e)}): the agent that hosts "
              "the rendezvous endpoint is gone or unreachable, or the nodes did not gather in time",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stopping on SIGINT and SIGTERM at a step boundary, with a checkpoint, on every rank at once.

Ctrl-C (SIGINT) and SIGTERM (what SLURM and Kubernetes send before they kill a job) do not stop a
rank where it stands: the handler only records the signal (:meth:`StopRequest.pending`), and every
rank learns in the step whether any rank received one: the signal numbers ride in the step's world
reduction beside the inf/NaN flags (:class:`~subnetdp.sdp.sync.NonFiniteGuard`; in the world's
gradient bucket at C = 1), so agreeing costs no collective of its own. A signal that arrives after
this rank's flags left is agreed at the next step. Local steps carry the signals in their
synchronisation's world bucket, so a stop waits for the next one (up to ``sync.every - 1`` steps);
with ``sync.stop_every_step`` a step between synchronisations agrees in
:meth:`StopRequest.agreed`, one tiny all-reduce.
All ranks then write a checkpoint of that step together and leave with :class:`Interrupted` (exit
code 128 + the signal's number, one line on the console, no traceback). A second signal aborts at
once, without a checkpoint. Ctrl-C is answered at once with a line saying so; a first SIGTERM only
by the stop line at the boundary (an elastic agent sends one to every worker when another worker
died: those ranks then leave on the lost peer instead, and a notice of a stop that never comes would
only mislead).

SIGUSR1 is SLURM's pre-emption notice (``#SBATCH --signal=USR1@120``: sent to every task of the
job's steps that many seconds before the time limit or a pre-emption): it stops the run as SIGTERM
does, and then rank 0 asks SLURM to requeue the job (``scontrol requeue $SLURM_JOB_ID``, what
Lightning does), whose script, started again with ``resume=auto``, continues from that checkpoint
(:func:`requeue_job`).

A signal that arrives before the loop starts (set-up, rendezvous, resuming) leaves at once too:
there is nothing to save yet.

The local launcher and torchrun start workers in a session of their own and forward one signal to
each, so one Ctrl-C in a terminal is one signal per worker.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import torch

from subnetdp.core.errors import SubnetdpError
from subnetdp.launchers.invocation import invoked_as
from subnetdp.launchers.signals import Handlers

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
REQUEUE_SIGNAL = signal.SIGUSR1  # SLURM's notice before a time limit or pre-emption (#SBATCH --signal=USR1@120)
REQUEUE_TIMEOUT_S = 30  # scontrol asks slurmctld; a controller that does not answer must not hold the exit
#: test-only: seconds a stopping rank waits before its checkpoint, so that a test's second signal
#: is sure to arrive while the first stop is still under way (a fast step would race it).
STOP_HOLD = "SUBNETDP_TEST_STOP_HOLD_S"


def hold_for_test() -> None:
    seconds = float(os.environ.get(STOP_HOLD, "0") or 0)
    if seconds > 0:
        time.sleep(seconds)


class Interrupted(SubnetdpError):
    """A run stopped by a signal; the CLI prints ``message`` (when not empty) and exits ``exit_code``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.message, self.exit_code = message, exit_code


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """Records SIGINT/SIGTERM for the loop; use as a context manager around set-up and training.

    Args:
        rank: this rank (only rank 0 prints).
        exit_now: called with the exit code for a signal that must end the process at once
            (before the loop, or a second signal); ``os._exit`` by default.
    """

    def __init__(self, rank: int = 0, exit_now: Callable[[int], Any] = os._exit) -> None:
        self.rank = rank
        self.signum = 0
        self.armed = False  # set by the loop: from then on a first signal waits for the step boundary
        self._leaving = False
        self._exit_now = exit_now
        self._handlers = Handlers(SIGNALS, self._handle)

    def __enter__(self) -> "StopRequest":
        self._handlers.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handlers.__exit__(*exc)

    def _say(self, text: str) -> None:
        if self.rank == 0:
            os.write(sys.stderr.fileno(), f"subnetdp: {text}\n".encode())

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal_name(signum)
        if not self.armed:
            self._say(f"{name} during set-up: stopped (nothing to save yet)")
            self._exit_now(128 + signum)
            return
        if self.signum:
            self._say(f"second signal ({name}): aborting now, without a checkpoint")
            self._exit_now(128 + signum)
            return
        self.signum = signum
        # Ctrl-C is a person waiting for an answer. SIGTERM comes from a scheduler, or from an agent
        # whose other worker just died (this rank then meets the loss, and no stop follows): the stop
        # line at the step boundary names it.
        if signum == signal.SIGINT and not self._leaving:
            self._say(f"{name} received: stopping after this step, with a checkpoint "
                      "(press Ctrl-C again to abort at once)")

    def leaving(self) -> None:
        """This rank leaves on an error (a lost peer) once its files are written: a first signal (the
        agent's SIGTERM after a worker's death) is recorded without announcing a stop that will not
        come; a second one still aborts at once."""
        self._leaving = True

    def pending(self) -> int:
        """This rank's signal not yet acted on (0: none): what the step's world reduction carries."""
        return self.signum

    def agreed(self, comm: Any) -> dict[int, int]:
        """Which ranks received a signal (rank -> signal number); empty to go on. Collective.

        One all-reduce of ``world_size`` numbers: every rank gets the same answer, so all stop
        after the same step. Only for a step whose world reduction did not carry the signals
        (:attr:`~subnetdp.train.step.StepResult.stops` is None).
        """
        world = comm.world_size
        if world == 1:
            return {0: self.signum} if self.signum else {}
        flags = torch.zeros(world, dtype=torch.float32, device=comm.device)
        flags[comm.rank] = float(self.signum)
        with comm.bytes.phase("stop"):  # a control message, not a training step's traffic
            # collective: every rank reaches this at the end of a step that carried no signals (local steps).
            comm.all_reduce(flags, comm.world).wait()
        return {r: int(f) for r, f in enumerate(flags.tolist()) if f}


def continue_command(argv: Sequence[str], run_dir: Any, run_name: str) -> str:
    """The command that continues this run, quoted for a POSIX shell: the program as it was invoked
    (:func:`~subnetdp.launchers.invocation.invoked_as`), this process's ``train`` arguments with ``resume=auto`` and the run's directory and name (a name the job made included)."""
    args = list(argv)
    args = args[args.index("train") + 1:] if "train" in args else []
    keep = [a for a in args if not a.split("=", 1)[0].lstrip("+~") in ("resume", "run.dir", "run.name")]
    # The program as the user started it (.venv/bin/subnetdp, python -m subnetdp): a bare `subnetdp`
    # is not found where the virtual environment is not on PATH.
    return shlex.join([*invoked_as(), "train", *keep, "resume=auto", f"run.dir={run_dir}", f"run.name={run_name}"])


def requeue_job(environ: Any = None) -> str:
    """Ask SLURM to requeue this job (``scontrol requeue $SLURM_JOB_ID``); what happened, as a clause.

    Called by rank 0 once the stop's checkpoint is written. A requeued job runs its batch script
    again with the same ``SLURM_JOB_ID`` (so the same ``run.name`` when the script derives it from
    the id), and ``resume=auto`` continues from the newest checkpoint.
    """
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if not job:
        return "not requeued: SLURM_JOB_ID is not set (not a SLURM job)"
    cmd = ["scontrol", "requeue", job]
    exe = shutil.which("scontrol", path=env.get("PATH"))
    try:
        if exe is None:
            raise FileNotFoundError("not found on PATH")
        done = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_S, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"requeue failed ({shlex.join(cmd)}: {e}); requeue it by hand"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return f"requeue failed ({shlex.join(cmd)} exited {done.returncode}: {why[-1] if why else 'no output'}); requeue it by hand"
    return f"requeued SLURM job {job} ({shlex.join(cmd)}): it continues from this checkpoint when it starts again"


def stop_message(who: dict[int, int], step: int, checkpoint: Any, resume_hint: str) -> str:
    """The one line printed when a run stops on a signal."""
    kinds = sorted({signal_name(s) for s in who.values()})
    ranks = ", ".join(map(str, sorted(who)))
    where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (checkpoint.enabled=false)"
    line = f"stopped by {'/'.join(kinds)} (rank {ranks}) after step {step}: {where}"
    return line + (f"; continue with {resume_hint}" if checkpoint and resume_hint else "")

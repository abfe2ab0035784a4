"""Test-only fault injection: every kill point the reliability tests and benchmarks use, in one place.

Each point is an environment variable holding a step number; nothing fires unless it is set, so a
production run pays one ``os.environ.get`` per point. The names are part of what tests and
``benchmarks/recovery.py`` rely on: do not rename them.

- :data:`KILL_AT_STEP`: after this step's checkpoint decision (the checkpointer).
- :data:`KILL_IN_WRITE`: between a checkpoint file's temporary name and its rename.
- :data:`KILL_IN_PRUNE`: rank 0, amid the removal of an old checkpoint.
- :data:`KILL_IN_SYNC` / :data:`KILL_IN_UPDATE`: inside this step's gradient averaging / right after
  its update (the training step, through :func:`step_faults`).
- :data:`KILL_IN_OPTIMIZER`: inside this step's ``optimizer.step()``, half of the rank's parameters
  updated and the rest not (:func:`step_faults`, ``where="optimizer"``).
- :data:`KILL_IN_REFORM` (``STEP:RANK[:WHERE]``): a second death while the survivors of a first one
  re-form the world to go on from STEP (``train/continuation.py``): the job's first rank RANK (its
  worker id, whatever its rank of now) dies at WHERE, ``agree`` (before it registers), ``groups`` (the
  world formed, before the owner groups) or ``heal`` (the owner groups formed, before the heal's
  broadcasts; the default). :data:`KILL_RANK` does not apply: the first death's rank is another.
- :data:`KILL_IN_JOIN`: amid a join's heal after this step, the owner groups made, before the broadcasts
  (``train/rejoin.py``; the newcomer fills the dead rank's place, so ``KILL_RANK`` names it too).
- :data:`AWAIT_JOIN`: the members wait at this step's boundary until a replacement announced itself.
- :data:`NO_SPACE_IN_ASSEMBLY`: ENOSPC while building a recovered step (:func:`no_space`).
- :data:`MODELS_ALIVE` (a directory): each worker writes, at the start of every segment of its loop
  (set-up, each continuation, a join), how many of the models its training state built are alive, and
  how many it built (:func:`models_alive`): one alive, unless a re-plan left the one it replaced alive;
  and after each re-formation's re-plan, what its optimizer state holds beyond its tensors
  (:func:`optimizer_storage`).
- :data:`FLIP_BIT` (``STEP:RANK:UNIT[:BIT]``, comma-separated; UNIT a unit id or ``shared``; BIT 0 = the
  lowest, the default): flips that bit of the first value of the unit's first parameter piece on RANK
  after STEP, the silent corruption a faulty memory cell makes, for the owners' verification
  (:func:`flip_bits`). A flipped low mantissa bit can be rounded away by the next update; a test that
  needs the fault to last until the next verification flips a higher one.

:data:`KILL_RANK` picks the ranks ("1", the default, or "1,2" at once) and :data:`KILL_SIGNAL` the
signal (KILL, the default, or STOP: a stalled rank instead of a dead one).
"""

from __future__ import annotations

import errno
import os
import signal
import weakref
from pathlib import Path
from typing import Callable

import torch

from subnetdp.core.contracts import Communicator
from subnetdp.sdp.verify import SHARED, unit_tensors

KILL_AT_STEP = "SUBNETDP_TEST_KILL_AT_STEP"  # test-only: SIGKILL a rank after this step
KILL_IN_WRITE = "SUBNETDP_TEST_KILL_IN_CHECKPOINT_WRITE"  # test-only: SIGKILL between temp file and rename
KILL_IN_PRUNE = "SUBNETDP_TEST_KILL_IN_CHECKPOINT_PRUNE"  # test-only: SIGKILL rank 0 amid a removal
KILL_IN_SYNC = "SUBNETDP_TEST_KILL_IN_SYNC"  # test-only: SIGKILL a rank inside this step's gradient averaging
KILL_IN_UPDATE = "SUBNETDP_TEST_KILL_IN_UPDATE"  # test-only: SIGKILL a rank right after this step's update
KILL_IN_JOIN = "SUBNETDP_TEST_KILL_IN_JOIN"  # test-only: SIGKILL a rank amid a join's heal (the join's step)
KILL_IN_OPTIMIZER = "SUBNETDP_TEST_KILL_IN_OPTIMIZER"  # test-only: SIGKILL a rank amid this step's optimizer update
KILL_IN_REFORM = "SUBNETDP_TEST_KILL_IN_REFORM"  # test-only: STEP:RANK[:WHERE], a second death amid a re-formation
KILL_RANK = "SUBNETDP_TEST_KILL_RANK"  # which ranks these hooks kill: "1" (the default) or "1,2" (at once)
KILL_SIGNAL = "SUBNETDP_TEST_KILL_SIGNAL"  # KILL (the default), or STOP: the rank stalls instead of dying
NO_SPACE_IN_ASSEMBLY = "SUBNETDP_TEST_NO_SPACE_IN_ASSEMBLY"  # test-only: ENOSPC while building a recovered step
#: test-only: the members wait at the boundary after this step until a replacement has announced itself
#: (a replacement's start takes seconds; a short test run would end before it could join)
AWAIT_JOIN = "SUBNETDP_TEST_AWAIT_JOIN"


def fault_point(name: str, step: int, rank: int, marker_dir: Path) -> None:
    """Test-only fault injection: SIGKILL this process once when ``$name`` equals ``step``.

    Fires on the ranks listed in ``$SUBNETDP_TEST_KILL_RANK`` (default 1; "1,2" kills two at the same
    point), once per rank and run directory (a marker file remembers it), so a restarted group runs
    through. ``$SUBNETDP_TEST_KILL_SIGNAL=STOP`` sends SIGSTOP instead: a stalled peer, which its
    agent's SIGKILL ends. Does nothing unless the variable is set.
    """
    if os.environ.get(name) != str(step) or str(rank) not in os.environ.get(KILL_RANK, "1").split(","):
        return
    marker = fault_marker(marker_dir, name, step, rank)
    if marker.exists():
        return
    marker.write_text("fired\n")
    os.kill(os.getpid(), signal.SIGSTOP if os.environ.get(KILL_SIGNAL) == "STOP" else signal.SIGKILL)


def fault_marker(marker_dir: Path, name: str, step: int, rank: int) -> Path:
    """The file :func:`fault_point` leaves when it fired (tests check the kill really happened)."""
    return Path(marker_dir) / f".{name.lower()}-{step}.rank{rank}"


def step_faults(rank: int, marker_dir: Path) -> Callable[..., None] | None:
    """Test-only: the training step's fault injection (``where``: ``sync``, ``optimizer``, called with the
    optimizer just before its step, or ``update``), or None when none of :data:`KILL_IN_SYNC`,
    :data:`KILL_IN_OPTIMIZER` and :data:`KILL_IN_UPDATE` is set (the usual case)."""
    names = {"sync": KILL_IN_SYNC, "update": KILL_IN_UPDATE, "optimizer": KILL_IN_OPTIMIZER}
    if not any(os.environ.get(n) for n in names.values()):
        return None

    def fault(where: str, step: int, optimizer: torch.optim.Optimizer | None = None) -> None:
        if where == "optimizer":
            if optimizer is not None:
                kill_amid_update(optimizer, step, rank, marker_dir)
            return
        fault_point(names[where], step, rank, marker_dir)

    return fault


def kill_amid_update(optimizer: torch.optim.Optimizer, step: int, rank: int, marker_dir: Path) -> None:
    """When :data:`KILL_IN_OPTIMIZER` is due for this rank at ``step``: arm the optimizer so that its next
    ``step()`` updates the first half of the parameters that have gradients and is SIGKILLed inside the
    call, the second half untouched (a death in the middle of an update: the rank's tensors are of two
    steps at once). The real optimizer does the updating: the second half's gradients are hidden, which
    every torch optimizer skips."""
    if os.environ.get(KILL_IN_OPTIMIZER) != str(step) or str(rank) not in os.environ.get(KILL_RANK, "1").split(","):
        return
    if fault_marker(marker_dir, KILL_IN_OPTIMIZER, step, rank).exists():
        return

    def hide_half(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        for p in params[len(params) // 2:]:
            p.grad = None

    optimizer.register_step_pre_hook(hide_half)
    # Post-hooks run inside optimizer.step(), after the (half) update.
    optimizer.register_step_post_hook(lambda opt, args, kwargs: fault_point(KILL_IN_OPTIMIZER, step, rank, marker_dir))


def reform_fault(step: int, worker: int, where: str, marker_dir: Path) -> None:
    """Test-only: SIGKILL the job's first rank ``worker`` at ``where`` of the re-formation that goes on
    from ``step``, when :data:`KILL_IN_REFORM` asks for it (once per run directory, like the others)."""
    asked = os.environ.get(KILL_IN_REFORM)
    if not asked:
        return
    at, who, *place = asked.split(":")
    if int(at) != step or int(who) != worker or (place[0] if place else "heal") != where:
        return
    marker = fault_marker(marker_dir, KILL_IN_REFORM, step, worker)
    if not marker.exists():
        marker.write_text("fired\n")
        os.kill(os.getpid(), signal.SIGKILL)


def await_join(step: int, waiting: Callable[[], bool], timeout_s: float) -> None:
    """Test-only: at the boundary after ``$AWAIT_JOIN``'s step, wait until ``waiting()`` (a replacement
    announced itself) or ``timeout_s``. Does nothing unless the variable is set."""
    import time

    if os.environ.get(AWAIT_JOIN) != str(step):
        return
    deadline = time.monotonic() + timeout_s
    while not waiting() and time.monotonic() < deadline:
        time.sleep(0.05)


MODELS_ALIVE = "SUBNETDP_TEST_MODELS_ALIVE"
_built: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_built_count = 0


def track_model(model: torch.nn.Module) -> None:
    """Test-only: remember (weakly) a model the training state built, when ``$MODELS_ALIVE`` is set (a
    model installed again, having lost units in place, is counted once)."""
    global _built_count
    if os.environ.get(MODELS_ALIVE) and model not in _built:
        _built.add(model)
        _built_count += 1


def models_alive() -> None:
    """Test-only: append ``ALIVE BUILT`` (of the models :func:`track_model` saw, those alive now and all of
    them) to ``$MODELS_ALIVE/models-PID.txt``. Does nothing unless the variable is set."""
    where = os.environ.get(MODELS_ALIVE)
    if where:
        with open(Path(where) / f"models-{os.getpid()}.txt", "a") as f:
            f.write(f"{len(_built)} {_built_count}\n")


def optimizer_storage(optimizer: torch.optim.Optimizer) -> None:
    """Test-only: append ``EXTRA TENSORS`` to ``$MODELS_ALIVE/storage-PID.txt``: the bytes the optimizer's
    state holds beyond its tensors' own (the distinct storages behind them, less the tensors), and how many
    tensors. A state tensor taken as a view of a buffer that holds more (a heal's message) shows there;
    one taken from a message of its own shows its alignment alone (under 64 bytes a tensor)."""
    where = os.environ.get(MODELS_ALIVE)
    if where:
        tensors = {id(v): v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
        extra = sum(storages.values()) - sum(t.numel() * t.element_size() for t in tensors.values())
        with open(Path(where) / f"storage-{os.getpid()}.txt", "a") as f:
            f.write(f"{extra} {len(tensors)}\n")


def no_space(step: int, what: Path) -> None:
    """Test-only: raise ENOSPC (a full disk) naming ``what`` when ``$NO_SPACE_IN_ASSEMBLY`` equals ``step``."""
    if os.environ.get(NO_SPACE_IN_ASSEMBLY) == str(step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(what))


FLIP_BIT = "SUBNETDP_TEST_FLIP_BIT"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flips_asked(step: int, rank: int) -> list[tuple[int, int]]:
    """``(unit, bit)`` of every flip this rank makes after ``step``."""
    out = []
    for fault in filter(None, os.environ.get(FLIP_BIT, "").split(",")):
        at, who, unit, *bit = fault.strip().split(":")
        if int(at) == step and int(who) == rank:
            out.append((SHARED if unit == "shared" else int(unit), int(bit[0]) if bit else 0))
    return out


def flip_bits(step: int, state, comm: Communicator) -> None:
    """Flip the bits :func:`flips_asked` names (no communication: the other owners never learn of it)."""
    for unit, bit in flips_asked(step, comm.rank):
        for u, _, _, view in unit_tensors(state.model, state.optimizer, state.pmap, state.partition, state.plan,
                                          comm.rank):
            if u == unit:
                with torch.no_grad():
                    first = view.detach()[(0,) * view.dim()]  # a 0-d view into the tensor's storage
                    bits = first.clone().reshape(1).view(_INT_OF_SIZE[first.element_size()])
                    bits ^= 1 << bit
                    first.copy_(bits.view(first.dtype).reshape(()))
                break
        else:
            raise ValueError(f"{FLIP_BIT}: rank {comm.rank} does not own {unit}")

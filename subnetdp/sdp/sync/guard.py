"""The synchroniser's inf/NaN guard (:class:`NonFiniteGuard`) and what it learns of a step (:class:`Checked`)."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

from subnetdp.core.errors import NonFiniteError
from subnetdp.sdp.sync.norm import clip_to
from subnetdp.sdp.sync.protocol import GradSynchronizer
from subnetdp.sdp.sync.settings import FLAG_SLOTS

class Checked(NamedTuple):
    """What :meth:`NonFiniteGuard.check` learnt of a step."""

    finite: bool  # every rank's loss and averaged gradients are finite
    norm: float | None  # the averaged gradient's global norm, when it was needed
    #: rank -> pending stop signal, the same on every rank (empty: none); None when the step issued no
    #: world reduction that carried them (local steps: their synchronisation carries them instead).
    stops: dict[int, int] | None


class NonFiniteGuard:
    """The synchroniser's inf/NaN guard: a step whose loss or gradients are not finite on any rank.

    The loss flags ride with the gradients (:meth:`carry`, in the bucket that goes to the whole
    world); the gradient flags ride in the gradient-norm all-reduce when the norm is needed (the
    norm is then the gradient check: one pass over the gradients, not two), or in one small
    all-reduce of their own. At C = 1 every rank holds the same averaged gradient, so its own check
    is everyone's and no collective is issued. The guard's scalars are counted in phase ``"guard"``.

    Each rank's pending stop signal (SIGINT/SIGTERM, :class:`~subnetdp.train.stopping.StopRequest`)
    rides in the same world reduction, beside its flag (:data:`FLAG_SLOTS`), so every rank learns in
    the step whether any rank was asked to stop, and the loop needs no collective of its own for it.

    Args:
        comm: the communicator.
        policy: ``train.on_nonfinite``: ``stop`` raises :class:`NonFiniteError` on every rank,
            ``skip`` skips the update (rank 0 prints a warning).
        last_good: gives the last good checkpoint (for the error message), or None.
    """

    def __init__(self, comm: Communicator, policy: str = "stop", last_good: Callable[[], Any] = lambda: None) -> None:
        self.comm, self.policy, self.last_good = comm, policy, last_good

    def carry(self, sync: GradSynchronizer, loss: torch.Tensor, signum: int = 0) -> None:
        """Hand this rank's "loss is not finite" flag and its pending signal ``signum`` (0: none) to
        the synchroniser, before the last backward.

        No host synchronisation happens here.
        """
        world, rank = self.comm.world_size, self.comm.rank
        flags = torch.zeros(FLAG_SLOTS * world, dtype=torch.float32, device=loss.device)
        flags[rank] = (~torch.isfinite(loss)).any().float()
        flags[world + rank] = float(signum)
        sync.carry(flags)

    def check(self, step: int, sync: GradSynchronizer, loss: torch.Tensor, need_norm: bool,
              signum: int = 0) -> Checked:
        """Whether every rank's loss and averaged gradients are finite; the gradient norm if asked;
        and which ranks hold a stop signal (``signum``: this rank's, 0 for none).

        Collective below C = 1 (every rank calls it once per step).
        """
        comm, world = self.comm, self.comm.world_size
        flags = torch.zeros(FLAG_SLOTS * world, dtype=torch.float64, device=loss.device)
        carried = sync.carried()
        if carried is None:
            flags[comm.rank] += (~torch.isfinite(loss)).any().double()
        fold = world > 1 and not (sync.replicated and carried is not None)  # flags need a collective
        if fold or carried is None:
            flags[world + comm.rank] = float(signum)  # read now: a signal since carry still counts this step
        norm = None
        with comm.bytes.phase("guard"):  # a guard, not a training step's traffic
            if need_norm:
                # inf and NaN in any gradient make the norm non-finite: it is the gradient check too.
                norm = sync.grad_norm(flags if fold else None)  # collective unless C = 1
                if not fold and not math.isfinite(norm):
                    flags[comm.rank] += 1.0
            else:
                grads = sync.local_grads()
                if grads:
                    # One fused pass of 2-norms (as torch's clip_grad_norm_): inf and NaN propagate into
                    # the norm and nothing gradient-sized is allocated. (The max-norm would cost ten times
                    # as much on the CPU; a norm that overflows only for gradients above 1e19 counts as
                    # non-finite, as it should.)
                    norms = torch.stack(torch._foreach_norm(grads, 2.0))
                    flags[comm.rank] += (~torch.isfinite(norms)).any().double()
                if fold:
                    # collective: every rank, once a step: who saw inf/NaN, who holds a stop signal.
                    comm.all_reduce(flags, comm.world).wait()
        if carried is not None:
            flags[:world] += carried[:world].double()
            if not fold:  # the signals the gradients carried (when the guard's reduction did, they are in flags)
                flags[world:] = carried[world:].double()
        values = flags.tolist()
        ranks = [r for r, f in enumerate(values[:world]) if f]
        agreed = world == 1 or not sync.checks_locally
        stops = {r: int(s) for r, s in enumerate(values[world:]) if s} if agreed else None
        if not ranks:
            return Checked(True, norm, stops)
        if sync.defer_nonfinite(step):
            # Local steps: no collective between synchronisations; this rank skips its step, and every
            # rank hears of it at the next synchronisation (which applies train.on_nonfinite).
            return Checked(False, norm, stops)
        where = f"step {step}, rank(s) {', '.join(map(str, ranks))}"
        if self.policy == "skip":
            if comm.rank == 0:
                print(f"warning: non-finite loss or gradients at {where}: step skipped", flush=True)
            return Checked(False, norm, stops)
        raise NonFiniteError(f"non-finite loss or gradients at {where}; the last good checkpoint is "
                             f"{self.last_good() or 'none (no checkpoint was written yet)'} — lower optim.lr, set "
                             "optim.clip_grad_norm, or set train.on_nonfinite=skip")

    def clip(self, sync: GradSynchronizer, norm: float | None, max_norm: float) -> None:
        """Scale the gradients so their global norm is at most ``max_norm`` (0: no clipping)."""
        if max_norm > 0:
            clip_to(sync, float(norm), max_norm)

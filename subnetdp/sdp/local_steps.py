"""Local steps with an outer optimizer among owners (``sync.mode=local_steps``, DiLoCo-style).

Every rank runs ``sync.every`` = H inner optimizer steps on its own subnetwork with no collective at
all: no gradient averaging, and the inner checks (gradient clipping, the inf/NaN guard) look at this
rank's own gradients. Then, at a *synchronisation*, every owner of a piece hands its pseudo-gradient
``anchor - theta`` (the parameters at the last synchronisation minus its current ones, i.e. minus
its delta) to the same owner-keyed buckets the per-step synchroniser uses
(:class:`~subnetdp.sdp.sync.OwnerGroupAverager`, reused as is: shared tensors over the world, each
unit among exactly its owners), the buckets are averaged, and an outer SGD with Nesterov momentum
steps from the anchor::

    g      = mean over owners of (anchor - theta_r)
    m      = mu * m + g                     (outer momentum, zero at the start)
    anchor = anchor - lr * (g + mu * m)     (Nesterov; mu = 0: anchor - lr * g)
    theta  = anchor                         (every owner, bit-identical)

``sync.outer_lr = 1`` and ``sync.outer_momentum = 0`` is plain averaging of the owners' parameters
(up to rounding: the deltas are averaged, not the parameters). The last step of a run always
synchronises, so a run ends with owners in agreement; evaluations fall on synchronisations
(``eval.every`` must be a multiple of ``sync.every``), so the union model is the synchronised one.

The outer state (anchor and momentum, one copy of each trainable local parameter; no momentum at
``mu = 0``) lives on the device, or on the host with ``sync.outer_on_host`` (pinned when a GPU is
used); it is checkpointed by unit like the parameters, so a run resumes bit-identically in the
middle of a cycle.

Inner optimizer state stays local: each rank's AdamW moments (or SGD momentum) keep evolving across
synchronisations from its own gradients, as DiLoCo does; only parameters are averaged. The
alternative, averaging the inner state among owners at every synchronisation too, would keep
owners' optimizer state identical (the per-step invariant) but triple the bytes of a
synchronisation for AdamW (docs/local_steps.md).

Warm start (``sync.warmup_steps`` = S, a multiple of H): the first S steps are synchronised after
every backward, exactly as ``sync.mode=every_step`` does (the same owner buckets, averaging
gradients; owners bit-identical after every step; the guard's flags and stop signals in the step's
world reduction), and local steps begin from the model they trained: after step S the anchor is the
parameters every owner holds and the outer momentum is zero. DiLoCo starts its inner loops from a
model trained with per-step synchronisation the same way. The outer state is allocated at that
point, not before, and a checkpoint written during the warm-up holds none.

Non-finite steps: between synchronisations a rank that sees an inf/NaN loss or gradient skips its
own inner step and counts it; the counts travel with the next synchronisation's world bucket, so
every rank learns of them at the same point and, with ``train.on_nonfinite=stop``, stops there
together (before the outer update); with ``skip`` rank 0 reports them and training goes on.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from omegaconf import OmegaConf
from torch import nn

from subnetdp.core.contracts import Communicator, ParamMap, Partition
from subnetdp.core.errors import ConfigError, NonFiniteError
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.sync.averager import OwnerGroupAverager
from subnetdp.sdp.sync.legacy import OldStateMethods
from subnetdp.sdp.sync.settings import FLAG_SLOTS, SyncSettings


def check_config(cfg: Any) -> None:
    """``sync.mode=local_steps``: what it does not compose with, a warm-up of whole cycles, and
    evaluations that fall on a synchronisation (the ranges of ``sync.*`` are declared with the fields)."""
    if cfg.sync.mode != "local_steps":
        warmup = cfg.sync.warmup_steps
        if warmup:
            raise ConfigError("sync.warmup_steps", warmup, "is the per-step warm-up before local steps; with "
                              f"sync.mode={cfg.sync.mode} every step is synchronised anyway",
                              "set sync.mode=local_steps, or leave sync.warmup_steps at 0")
        if cfg.sync.stop_every_step:
            raise ConfigError("sync.stop_every_step", True, "chooses where local steps agree on a stop; with "
                              f"sync.mode={cfg.sync.mode} every step's world reduction carries the signals anyway",
                              "set sync.mode=local_steps, or leave sync.stop_every_step at false")
        return
    every = cfg.sync.every
    needs = (("fsdp.shard_size", 1, "composing local steps with FSDP's sharded parameters is not built"),
             ("masker.resample_every", 0, "a re-drawn plan would move units in the middle of a cycle"))
    for key, want, why in needs:
        value = OmegaConf.select(cfg, key, default=want)
        if value != want:
            raise ConfigError(key, value, f"sync.mode=local_steps needs {key}={want}: {why}",
                              f"set {key}={want}, or sync.mode=every_step")
    warmup, steps = cfg.sync.warmup_steps, cfg.train.steps
    if warmup % every or warmup > steps:
        raise ConfigError("sync.warmup_steps", warmup, f"must be a multiple of sync.every={every} and at most "
                          f"train.steps={steps}, so every cycle of local steps is whole and starts after it",
                          f"use sync.warmup_steps={min(every * (warmup // every), every * (steps // every))} "
                          "(0: local steps from the first step)")
    if cfg.eval.every % every:
        raise ConfigError("eval.every", cfg.eval.every, f"must be a multiple of sync.every={every} with "
                          "sync.mode=local_steps, so the union model is evaluated right after a synchronisation",
                          f"use eval.every={every * -(-cfg.eval.every // every)} (0: only at the end)")


class LocalStepsSynchronizer(OldStateMethods):
    """Owner-group averaging of parameter deltas every ``every`` steps, with an outer Nesterov SGD.

    Between synchronisations it stands in for the per-step synchroniser in the loop (``prepare``,
    ``no_sync``, ``carry``, ``finish``, ``grad_norm``: all local); :meth:`after_update` synchronises
    when a cycle ends (:meth:`due`, :meth:`synchronise`). During the warm-up (``settings.warmup_steps``)
    it is the per-step synchroniser: every call goes to its owner buckets, which average gradients
    during backward, and :attr:`local` is False until the warm-up's last step. Made by
    :func:`~subnetdp.sdp.sync.make_synchronizer` for ``sync.mode=local_steps``.

    Args:
        model, pmap, plan, partition, comm: as for :class:`OwnerGroupAverager`.
        settings: ``every`` (H, inner steps per synchronisation), the outer SGD's ``outer_lr`` and
            Nesterov ``outer_momentum``, ``outer_on_host`` (outer state in host memory),
            ``warmup_steps`` (steps synchronised every step before local steps begin), the bucket
            layout (``bucket_cap_mb``, ``max_groups``) and ``on_nonfinite`` (``stop`` or ``skip``).
        last_good: gives the last good checkpoint, named when a synchronisation stops on inf/NaN.
        dense: force the buckets' dense (True) or grouped (False) mode; None chooses by ``max_groups``.
    """

    def __init__(self, model: nn.Module, pmap: ParamMap, plan: MaskPlan, partition: Partition,
                 comm: Communicator, settings: SyncSettings, last_good: Callable[[], Any] = lambda: None,
                 dense: bool | None = None) -> None:
        # collective: the owner groups are created here, exactly as for the per-step synchroniser.
        self.buckets = OwnerGroupAverager(model, pmap, plan, partition, comm, settings.bucket_cap_mb,
                                          settings.max_groups, dense)
        self.comm, self.every = comm, int(settings.every)
        self.warmup = int(settings.warmup_steps)
        self.outer_lr, self.outer_momentum = float(settings.outer_lr), float(settings.outer_momentum)
        self.on_nonfinite = settings.on_nonfinite
        self.last_good = last_good
        self.params = self.buckets.params
        self.dense = self.buckets.dense
        self.on_host = bool(settings.outer_on_host)
        self._anchor: dict[str, torch.Tensor] = {}
        self._momentum: dict[str, torch.Tensor] = {}
        self.nonfinite = torch.zeros(comm.world_size, dtype=torch.float32)  # this cycle's skipped steps, per rank
        self._loss_flags: torch.Tensor | None = None
        self.syncs, self.sync_bytes, self.last_sync_bytes = 0, 0, 0
        self.local = False  # in the warm-up: every call goes to the per-step buckets
        if self.warmup == 0:
            self._begin_local()

    def _begin_local(self) -> None:
        """Local steps from here on: the buckets leave backward (deltas are packed at a synchronisation),
        and the outer state starts at the current parameters, every owner's the same."""
        self.buckets.remove_hooks()
        pin = self.on_host and torch.cuda.is_available()
        for name, p in self.params.items():
            a = torch.empty(p.shape, dtype=p.dtype, device="cpu" if self.on_host else p.device, pin_memory=pin)
            self._anchor[name] = a.copy_(p.detach())
            if self.outer_momentum > 0:
                self._momentum[name] = torch.zeros_like(a)
        self.local = True

    # What the guard, the loop and the checkpointer ask (GradSynchronizer): in the warm-up the
    # per-step buckets' answers; then the inner step's inf/NaN check is this rank's own (no world
    # collective between synchronisations: the guard reads :meth:`carried` and never folds flags
    # over the world, and the loop agrees on a stop itself), and owners' copies differ between
    # synchronisations, so each owner checkpoints its own.
    @property
    def replicated(self) -> bool:
        return True if self.local else self.buckets.replicated

    @property
    def checks_locally(self) -> bool:
        return self.local

    @property
    def owners_diverge(self) -> bool:
        return self.local

    # ------------------------------------------------------------------ inner steps (no collective)
    def prepare(self, keep_grads: bool = False) -> None:
        """Drop the last step's gradients (the per-step synchroniser's buckets hold them)."""
        self.buckets.prepare(keep_grads)
        self._loss_flags = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if not self.local:
            with self.buckets.no_sync():
                yield
        else:
            yield  # nothing is communicated during backward anyway

    def carry(self, flags: torch.Tensor) -> bool:
        """Keep this rank's loss flags: the guard's check is local between synchronisations."""
        if not self.local:
            return self.buckets.carry(flags)
        self._loss_flags = flags
        return True

    def carried(self) -> torch.Tensor | None:
        return self._loss_flags if self.local else self.buckets.carried()

    def finish(self) -> None:
        """No gradient collective between synchronisations: the inner step uses local gradients.
        Collective in the warm-up (owner groups average, as every step)."""
        if not self.local:
            self.buckets.finish()

    def local_grads(self) -> list[torch.Tensor]:
        if not self.local:
            return self.buckets.local_grads()
        return [p.grad for p in self.params.values() if p.grad is not None]

    def grad_norm(self, flags: torch.Tensor | None = None) -> float:
        """Norm of this rank's own gradient (inner clipping: every piece it trains counted once); in
        the warm-up the averaged gradient's (collective unless C = 1)."""
        if not self.local:
            return self.buckets.grad_norm(flags)
        grads = self.local_grads()
        if not grads:
            return 0.0
        squares = torch.stack(torch._foreach_norm(grads, 2.0)).double().pow(2).sum()
        return math.sqrt(float(squares))

    def scale_grads_(self, coef: float) -> None:
        for g in self.local_grads():
            g.mul_(coef)

    def defer_nonfinite(self, step: int) -> bool:
        """This rank skips inner step ``step`` (inf/NaN); every rank hears of it at the next synchronisation.
        In the warm-up every rank heard of it already: the guard applies ``train.on_nonfinite``."""
        if not self.local:
            return False
        self.nonfinite[self.comm.rank] += 1
        return True

    # ------------------------------------------------------------------ synchronisation
    def after_update(self, step: int, last_step: int, signum: int = 0) -> Optional[dict[int, int]]:
        """Synchronise when ``step`` ends a cycle (collective then: every rank at the same steps), with
        this rank's pending stop signal ``signum`` in the world bucket; returns the signals agreed there
        (None between synchronisations). Local steps begin after the warm-up's last step."""
        if not self.local:
            if step >= self.warmup:
                self._begin_local()  # every owner holds the same values: the anchor of the first cycle
            return None
        if self.due(step, last_step):
            # collective: owners average their parameter deltas; the outer optimizer steps.
            return self.synchronise(step, signum)
        return None

    def due(self, step: int, last: int) -> bool:
        """Whether ``step`` ends a cycle (every ``every`` steps, and the run's last step)."""
        return step % self.every == 0 or step == last

    @torch.no_grad()
    def synchronise(self, step: int, signum: int = 0) -> dict[int, int]:
        """Average the owners' deltas in the owner buckets, then the outer step. Collective.

        Every rank of the world calls it at the same steps (:meth:`due`). The cycle's inf/NaN counts
        and every rank's pending stop signal (``signum``: this rank's) ride in the world bucket;
        returns the signals (rank -> number, empty for none), the same on every rank.
        """
        before = self.comm.bytes.total()
        b = self.buckets
        b.prepare()  # zeroed buckets; .grad of viewable parameters points into them
        for name, p in self.params.items():
            a = self._anchor[name]
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(a, non_blocking=True).sub_(p)  # this rank's pseudo-gradient: minus its delta
        world = self.comm.world_size
        flags = torch.zeros(FLAG_SLOTS * world, device=b._device(), dtype=b._dtype())
        flags[:world] = self.nonfinite
        flags[world + self.comm.rank] = float(signum)
        carried = b.carry(flags)
        b.finish()  # collective: every owner group averages its buckets (the world its shared tensors)
        if carried:
            flags = b.carried()
        elif world > 1:  # no bucket goes to the whole world: the counts need their own
            self.comm.all_reduce(flags, self.comm.world).wait()  # collective: every rank
        stops = {r: int(s) for r, s in enumerate(flags[world:].tolist()) if s}
        self._check_finite(flags[:world].cpu(), step)
        lr, mu = self.outer_lr, self.outer_momentum
        for name, p in self.params.items():
            a = self._anchor[name]
            g = p.grad if a.device == p.grad.device else p.grad.to(a.device)
            if mu > 0:
                m = self._momentum[name]
                m.mul_(mu).add_(g)
                g = g.add(m, alpha=mu)  # Nesterov
            a.add_(g, alpha=-lr)
            p.copy_(a, non_blocking=True)
            p.grad = None
        self.nonfinite.zero_()
        self.syncs += 1
        self.last_sync_bytes = self.comm.bytes.total() - before
        self.sync_bytes += self.last_sync_bytes
        return stops

    def _check_finite(self, counts: torch.Tensor, step: int) -> None:
        ranks = {r: int(n) for r, n in enumerate(counts.tolist()) if n}
        if not ranks:
            return
        where = ", ".join(f"rank {r}: {n} step(s)" for r, n in ranks.items())
        if self.on_nonfinite == "skip":
            if self.comm.rank == 0:
                print(f"warning: non-finite loss or gradients in the cycle ending at step {step} ({where}): "
                      "those inner steps were skipped", flush=True)
            return
        good = self.last_good()
        raise NonFiniteError(f"non-finite loss or gradients in the local steps before the synchronisation at "
                             f"step {step} ({where}); every rank stops here, without the outer update; the last "
                             f"good checkpoint is {good or 'none (no checkpoint was written yet)'} — lower "
                             "optim.lr, set optim.clip_grad_norm, or set train.on_nonfinite=skip")

    # ------------------------------------------------------------------ state, figures
    def _outer(self) -> dict[str, dict[str, torch.Tensor]]:
        """The outer state by key prefix and local parameter name (empty before local steps begin)."""
        out = {"outer_anchor/": self._anchor}
        return {**out, "outer_momentum/": self._momentum} if self._momentum else out

    def state_dict(self) -> dict[str, Any]:
        """The outer state (anchor and momentum, each of its parameter's local shape, so a checkpoint
        cuts it into pieces and keys it by unit exactly as the parameter) and the inner steps this rank
        skipped in the cycle so far (inf/NaN), for its checkpoint file. The live tensors."""
        pieces = {prefix: dict(tensors) for prefix, tensors in self._outer().items() if tensors}
        return {"pieces": pieces, "rank": {"local_steps_nonfinite": self.nonfinite.clone()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resuming after ``state["step"]``: past the warm-up, local steps from here on; in it, per-step
        synchronisation until its last step. Without an anchor (a checkpoint written with per-step
        synchronisation, or a re-plan from peers) a cycle starts at the loaded parameters; a missing
        momentum stays zero."""
        if "step" in state and not self.local and int(state["step"]) >= self.warmup:
            self._begin_local()  # the anchor of a cycle, at the parameters the source loaded
        pieces = state.get("pieces") or {}
        if self.local:
            if "outer_anchor/" not in pieces:
                self.restart_cycle()
            for prefix, live in self._outer().items():
                for name, t in (pieces.get(prefix) or {}).items():
                    if name in live:
                        live[name].copy_(t)
        saved = (state.get("rank") or {}).get("local_steps_nonfinite")
        if saved is not None and tuple(saved.shape) == tuple(self.nonfinite.shape):
            self.nonfinite.copy_(saved)

    def restart_cycle(self) -> None:
        """Anchor at the current parameters, zero momentum."""
        for name, p in self.params.items():
            self._anchor[name].copy_(p.detach())
        for m in self._momentum.values():
            m.zero_()

    def log_figures(self) -> dict[str, float]:
        """The last synchronisation's payload over its H-step cycle (nothing before the first)."""
        return {"rank/bytes_sent_per_step_cycle": self.bytes_per_step_cycle()} if self.syncs else {}

    def outer_state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._outer().values() for t in ts.values())

    def state_tensors(self) -> list[torch.Tensor]:
        """Persistent bucket buffers and the outer state (on the host too), for memory accounting."""
        return self.buckets.state_tensors() + [t for ts in self._outer().values() for t in ts.values()]

    def bytes_per_step(self) -> float:
        """Payload per step averaged over the cycle: one synchronisation's buckets every ``every`` steps
        (in the warm-up, the buckets every step)."""
        return self.buckets.bytes_per_step() / (self.every if self.local else 1)

    def bytes_per_step_cycle(self) -> float:
        """Measured: the last synchronisation's payload divided by the cycle length."""
        return self.last_sync_bytes / self.every

    def remove_hooks(self) -> None:
        self.buckets.remove_hooks()

    def owner_groups(self) -> list[tuple[int, ...]]:
        return self.buckets.owner_groups()

    def describe(self) -> dict[str, Any]:
        """The summary's fields of this synchroniser (per rank)."""
        return {"sync_mode": "local_steps", "sync_every": self.every, "sync_warmup_steps": self.warmup,
                "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "outer_state_on": "host" if self.on_host else "device",
                "outer_state_bytes": self.outer_state_bytes(), "syncs": self.syncs,
                "bytes_per_sync": self.sync_bytes / max(1, self.syncs),
                "bytes_per_step_cycle": self.sync_bytes / max(1, self.syncs) / self.every}

"""The owners' verification in the run: when it is due, what it says, and when it stops the run.

Every ``recovery.verify_every`` steps, and before every checkpoint (the step-``checkpoint.every``
ones, the final one and a signal's), at the step boundary, the owners of every unit compare digests
of its bytes (:mod:`subnetdp.sdp.verify`). A checkpoint is therefore only ever written from a state
its owners were just shown to agree on, so the newest checkpoint is always a verified one and
``resume=auto`` after a stop resumes from it.

A mismatch with a strict majority among the unit's owners (three or more owners) is repaired from a
majority owner and the run goes on; one without (two owners, or a tie) stops every rank with
:class:`~subnetdp.sdp.verify.OwnersDisagree` before the step can be checkpointed. Off with
``sync.mode=local_steps`` (owners train apart between synchronisations by design) and with FSDP
(``fsdp.shard_size > 1``: a rank holds a shard, not its units).
"""

from __future__ import annotations

import sys
from pathlib import Path

from subnetdp.core.contracts import RunContext
from subnetdp.sdp.verify import OwnersDisagree, Verdict, compare, repair, unit_digests, unit_name
from subnetdp.train.checkpoints.checkpointer import final_wanted
from subnetdp.train.failures import log_path, stamp
from subnetdp.train.faults import flip_bits


class OwnerCheck:
    """Verifies, at the step boundaries that are due, that every unit's owners agree (``recovery.verify_every``).

    Attributes:
        history: ``(step, units compared, units repaired)`` of every verification this run made.
    """

    def __init__(self, ctx: RunContext, state) -> None:
        cfg = ctx.cfg
        self.ctx, self.state = ctx, state
        self.every = cfg.recovery.verify_every
        self.on = (self.every > 0 and cfg.sync.mode == "every_step" and cfg.fsdp.shard_size == 1)
        self.history: list[tuple[int, int, int]] = []

    def due(self, step: int, stopping: bool = False) -> bool:
        """A verification step, or one after which a checkpoint is written."""
        cfg = self.ctx.cfg
        every, last = cfg.checkpoint.every, self.ctx.steps
        saving = cfg.checkpoint.enabled and (stopping or (step == last and final_wanted(cfg, last))
                                                   or (every > 0 and step % every == 0))
        return self.on and (step % self.every == 0 or saving)

    def after_step(self, step: int, stopping: bool = False) -> None:
        """At the boundary after ``step``: verify when due; repair or raise :class:`OwnersDisagree`.

        ``stopping``: the ranks agreed to stop after this step (its checkpoint follows).
        """
        flip_bits(step, self.state, self.ctx.comm)  # test-only (SUBNETDP_TEST_FLIP_BIT); nothing when unset
        if not self.due(step, stopping):
            return
        st, comm = self.state, self.ctx.comm
        mine = unit_digests(st.model, st.optimizer, st.pmap, st.partition, st.plan, comm.rank)
        verdict = compare(comm, st.plan, mine)  # collective: every rank reaches this
        if verdict.mismatches:
            self._log(step, verdict)
            if not verdict.repairable:
                raise OwnersDisagree(self._stop_line(step, verdict))
            # collective: every rank walks the same mismatches (members of each owner group broadcast).
            repair(comm, st.model, st.optimizer, st.pmap, st.partition, st.plan, verdict.mismatches)
            if comm.rank == 0:
                fixed = "; ".join(f"{unit_name(m.unit)}: ranks {m.odd} received it from rank {min(m.majority)}"
                                  for m in verdict.mismatches)
                print(f"{stamp()} subnetdp: owners disagreed after step {step}, repaired by their majority "
                      f"({fixed}); the run goes on (details: {log_path(self.ctx.run_dir, 0)})", file=sys.stderr,
                      flush=True)
        self.history.append((step, verdict.units, len(verdict.mismatches)))

    def _stop_line(self, step: int, verdict: Verdict) -> str:
        bad = [m for m in verdict.mismatches if m.majority is None]
        what = "; ".join(f"{unit_name(m.unit)} on ranks {list(m.owners)}" for m in bad)
        return (f"owners disagree after step {step} with no majority to repair them ({what}); this step is not "
                "checkpointed: resume with resume=auto from the newest checkpoint, which was verified")

    def _log(self, step: int, verdict: Verdict) -> None:
        """Every rank's log gets the whole verdict: digests of every disagreeing unit, by rank."""
        path: Path = log_path(self.ctx.run_dir, self.ctx.comm.rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                for m in verdict.mismatches:
                    f.write(f"{stamp()} {m.line(step)}\n")
        except OSError as e:  # the run's verdict does not depend on its log
            print(f"subnetdp: could not write {path}: {e.strerror}", file=sys.stderr, flush=True)

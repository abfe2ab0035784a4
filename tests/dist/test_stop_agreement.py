"""The stop agreement rides in the step's world reduction, beside the inf/NaN flags (2 real gloo ranks).

Each rank's pending signal (a real SIGTERM, through :class:`StopRequest`'s handler) is summed with
the flags in the world's last gradient bucket at C = 1 and in the guard's all-reduce below it, so:

- no collective is issued in phase ``stop`` (C = 1 and C = 0.5, clipping on: the norm's all-reduce),
  and at C = 1 none outside the gradient buckets at all; C = 0.5 issues exactly the guard's one;
- a signal pending when the step starts stops every rank after that step; one that arrives after
  the step's flags left stops them after the next; each rank's :class:`StepResult` names the same
  rank and signal, and both leave with 128 + SIGTERM;
- the flags' two halves stay apart: an inf/NaN loss on one rank (``train.on_nonfinite=skip``)
  skips the step on both ranks and is no stop, and a signal is not taken for an inf/NaN;
- local steps (no world collective between synchronisations, H = 2) agree at their synchronisations:
  the signals ride in the synchronisation's world bucket, no ``stop`` collective is ever issued, and a
  signal that arrives after step 2's synchronisation stops both ranks after step 4's; with
  ``sync.stop_every_step=true`` they agree in a ``stop`` all-reduce after every step between
  synchronisations and stop after the step the signal arrived in.
"""

from __future__ import annotations

import os
import signal

from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.loop import train_loop
from subnetdp.train.setup import setup
from subnetdp.train.stopping import Interrupted, StopRequest
from tests.helpers import plugin_manager, run_ranks, small_config

TERM = int(signal.SIGTERM)
# tag -> (overrides, step whose start sees rank 1's signal pending (or None), step after which it arrives,
# (rank, step) whose loss is NaN)
RUNS = {
    "c1": (["masker.coverage=1", "optim.clip_grad_norm=0"], 3, None, (0, 2)),
    "c05": (["masker.coverage=0.5", "optim.clip_grad_norm=1.0"], None, 2, (1, 1)),
    "local": (["masker.coverage=0.5", "sync.mode=local_steps", "sync.every=2"], None, 2, None),
    "local_every": (["masker.coverage=0.5", "sync.mode=local_steps", "sync.every=2", "sync.stop_every_step=true"],
                    None, 1, None),
}


def _counts(comm) -> dict[str, int]:
    return {phase: sum(groups.values()) for phase, groups in comm.bytes.calls_by_phase.items()}


def _run(rank: int, world: int, init_method: str, tag: str) -> dict:
    overrides, before, after, nan_at = RUNS[tag]
    cfg = small_config("train.steps=6", "train.batch_size=8", "optim.name=sgd", "train.on_nonfinite=skip",
                       "eval.every=0", *overrides, f"comm.init_method={init_method}-{tag}", f"run.name={tag}",
                       run_dir=init_method.removeprefix("file://") + "-runs")
    with StopRequest(rank) as stopper:  # the real handler: os.kill below goes through it
        ctx, st = setup(cfg, LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
        record: dict = {"stops": [], "updated": [], "counts": []}
        poison = {"on": False}
        st.model.register_forward_hook(lambda m, i, o: o * float("nan") if poison["on"] else o)
        real_step = st.train_step

        def step(batches, *, step: int, **kw):
            record["counts"].append(_counts(ctx.comm))  # at each step's start: a step's collectives between two
            if rank == 1 and step == before:
                os.kill(os.getpid(), signal.SIGTERM)  # pending before the step's flags leave
            poison["on"] = nan_at == (rank, step)
            out = real_step(batches, step=step, **kw)
            poison["on"] = False
            record["stops"].append(out.stops)
            record["updated"].append(out.updated)
            if rank == 1 and step == after:
                os.kill(os.getpid(), signal.SIGTERM)  # the step's flags have left
            return out

        st.train_step = step
        try:
            train_loop(ctx, st, stopper)
            record["exit"] = 0
        except Interrupted as stop:
            record["exit"] = stop.exit_code
        finally:
            ctx.comm.shutdown()
        record["step"] = st.step
        record["counts_end"] = _counts(ctx.comm)
        return record


def _worker(rank: int, world: int, init_method: str) -> dict:
    return {tag: _run(rank, world, init_method, tag) for tag in RUNS}


def _per_step(counts: list[dict[str, int]]) -> list[dict[str, int]]:
    """Collectives by phase between consecutive steps' starts (a whole step, the loop's end included)."""
    out = []
    for a, b in zip(counts, counts[1:]):
        out.append({p: b.get(p, 0) - a.get(p, 0) for p in sorted(set(a) | set(b)) if b.get(p, 0) != a.get(p, 0)})
    return out


def test_stop_signals_ride_in_the_world_reduction_and_issue_no_collective_of_their_own(tmp_path):
    results = run_ranks(_worker, 2, tmp_path, timeout=600)
    for r in results:
        # C = 1: the signal pending at step 3's start stops both ranks after step 3; the NaN of step 2 is no stop.
        c1 = r["c1"]
        assert c1["exit"] == 128 + TERM and c1["step"] == 3
        assert c1["stops"] == [{}, {}, {1: TERM}]
        assert c1["updated"] == [True, False, True]
        for counts in _per_step(c1["counts"]):
            assert "stop" not in counts and "guard" not in counts, counts
            assert set(counts) == {"step"}, counts  # nothing outside the gradient buckets
        # C = 0.5: one guard all-reduce a step (the norm's, clipping on) carries the flags and the signals.
        c05 = r["c05"]
        assert c05["exit"] == 128 + TERM and c05["step"] == 3  # arrived after step 2's flags: agreed in step 3
        assert c05["stops"] == [{}, {}, {1: TERM}]
        assert c05["updated"] == [False, True, True]
        for counts in _per_step(c05["counts"]):
            assert "stop" not in counts and counts.get("guard") == 1, counts
        # Local steps: the signal that arrived after step 2's synchronisation rides in step 4's.
        local = r["local"]
        assert local["exit"] == 128 + TERM and local["step"] == 4
        assert local["stops"] == [None, {}, None, {1: TERM}]
        assert all("stop" not in counts for counts in _per_step(local["counts"]))
        # ... or, with sync.stop_every_step, in a stop all-reduce after a step between synchronisations.
        every = r["local_every"]
        assert every["exit"] == 128 + TERM and every["step"] == 1
        assert every["stops"] == [None]
        assert _per_step(every["counts"] + [every["counts_end"]])[0].get("stop") == 1

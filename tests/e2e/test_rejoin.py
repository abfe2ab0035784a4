"""``launch.replace``: a worker dies, the survivors go on at W-1, a replacement joins and the world grows back.

Real processes and a real SIGKILL under the real ``subnetdp train launch.nproc=4 launch.on_failure=continue``:
the supervisor starts a replacement, which announces itself in the job's store; the members take it
in at a step boundary they all agree on, and it receives every piece of the W-rank plan it owns, with
its optimizer state and buffers, from their current owners over the network (docs/inprocess.md).

The reference that makes "rejoined correctly" checkable: the run's own checkpoint of the join step,
written at W-1 before the join, resumed at W (``launch.nproc=4 resume=<it>``) on the config's plan,
the W-rank plan the job started with. A rejoin at step J must train what that resume trains, bit for bit.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from subnetdp import hookimpl
from subnetdp.core.plan import MaskPlan
from subnetdp.train import faults
from subnetdp.train.continuation import WentOn

from tests.e2e.test_inprocess_launch import _run, _steps, _tensors


def test_a_replacement_joins_healed_and_the_world_grows_back(tmp_path):
    # Rank 1 is SIGKILLed inside step 3's gradient averaging: the survivors go on at W=3 from step 2, the
    # supervisor starts a replacement, the members take it in at a step boundary, and the run ends at W=4.
    # The members wait at the boundary after step 4 until the replacement has announced itself (it needs
    # seconds to start, the members well under one to reach step 4), so they join it after step 5, whose
    # checkpoint (written at W=3, before the join) is the reference's start.
    job = ["train.steps=8", "optim.name=adamw", "masker.min_owners=2", "checkpoint.every=5"]
    models = tmp_path / "models"
    models.mkdir()
    proc = _run(tmp_path, "rejoin", *job, "recovery.verify_every=1", "launch.nproc=4", "launch.on_failure=continue",
                "launch.replace=1", env={faults.KILL_IN_SYNC: "3", faults.AWAIT_JOIN: "4", faults.MODELS_ALIVE: str(models)})
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    # At the start of every segment (set-up, going on at W-1, the join) each worker holds one model: a re-plan
    # leaves nothing alive of the one it replaced. The newcomer trains the model it built at set-up (for
    # exactly its units, filled over the network), and builds no second one while the members wait for it.
    segments = {f.name: [tuple(map(int, line.split())) for line in f.read_text().splitlines()]
                for f in models.glob("models-*.txt")}
    # The members' 3 segments; one each for the newcomer and for rank 1, killed in its first.
    assert sorted(len(s) for s in segments.values()) == [1, 1, 3, 3, 3], segments
    assert all(alive == 1 for s in segments.values() for alive, _ in s), segments
    assert [s for s in segments.values() if len(s) == 1] == [[(1, 1)]] * 2, segments
    # A member builds no model at the join either: one that gained units at W-1 (a new model then) drops
    # them from it in place (ModelAdapter.drop_units), and one that gained none keeps its own.
    members = [s for s in segments.values() if len(s) == 3]
    assert all(s[2][1] == s[1][1] for s in members), segments
    assert any(s[1][1] == 2 for s in members), segments  # some member did gain units at W-1
    # After every re-plan of a re-formation (going on at W-1, the join) the optimizer state holds its own
    # bytes and their alignment alone: nothing it received keeps a message's other bytes alive.
    storage = [tuple(map(int, line.split())) for f in models.glob("storage-*.txt") for line in f.read_text().splitlines()]
    assert len(storage) == 3 + 3 + 1 and all(0 <= extra < 64 * n for extra, n in storage), storage
    run = tmp_path / "rejoin"
    assert faults.fault_marker(run, faults.KILL_IN_SYNC, 3, 1).exists()  # the SIGKILL happened
    assert "old ranks [0, 2, 3]) go on in-process from step 2" in console, console[-4000:]
    joined = re.search(r"a replacement joined as rank 1 after step (\d+): the world is 4 again .*?"
                       r"(\d+) piece\(s\) sent to it over the network \(([\d.]+) MiB", console)
    assert joined and int(joined.group(1)) == 5, console[-4000:]
    assert int(joined.group(2)) > 0 and float(joined.group(3)) > 0
    assert "owners disagree" not in console, console[-4000:]  # every step's digests agreed, after the join too
    steps = _steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == 8, steps  # no step logged twice, the run ended
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4
    # What was trained, across the three worlds: steps 1-2 at W=4, 3-5 at W=3, 6-8 at W=4 again (batch 4).
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/samples_seen"] for r in rows if r.get("step") == 8 and "train/loss" in r] == [2 * 16 + 3 * 12 + 3 * 16]
    # Bytes by owner group in worker ids (the replacement is worker 4, in rank 1's place), each over its world's steps.
    mine = summary["ranks"][0]["bytes_by_group"]
    assert (mine["0-1-2-3"]["steps"], mine["0-2-3"]["steps"], mine["0-2-3-4"]["steps"]) == (2, 3, 3), mine
    assert summary["ranks"][1]["worker"] == 4 and {g["steps"] for g in summary["ranks"][1]["bytes_by_group"].values()} == {3}

    # The final checkpoint is of the W-rank plan the job started with, and holds the newcomer's share. Each
    # piece is written once (by one of its owners), so the owners' equality is the digests' above: values and
    # optimizer state of every unit, the newcomer's included, compared among their owners after every step
    # from the join on, the final checkpoint's step included (a checkpoint is written only once verified).
    final = json.loads((run / "checkpoints" / "step_00000008" / "MANIFEST.json").read_text())
    assert final["world_size"] == 4 and final["plan_digest"] == _plan(run / "plan.json").digest()
    newcomer = load_file(str(run / "checkpoints" / "step_00000008" / "pieces_1.safetensors"))
    assert len(newcomer) > 10 and all(torch.isfinite(t).all() for t in newcomer.values() if t.is_floating_point())

    # The reference: the same job stopped at the join step (its checkpoint, written at W-1) and resumed at W.
    at_join = run / "checkpoints" / "step_00000005"
    assert json.loads((at_join / "MANIFEST.json").read_text())["world_size"] == 3
    again = _run(tmp_path, "resumed", *job, "launch.nproc=4", f"resume={at_join}")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "(step 5) on a new plan" in again.stdout, again.stdout[-3000:]  # the W=3 checkpoint, re-planned at W
    resumed = json.loads((tmp_path / "resumed" / "checkpoints" / "step_00000008" / "MANIFEST.json").read_text())
    assert resumed["plan_digest"] == final["plan_digest"]  # the W-rank plan: the config's, as the join's
    # In its own run directory, it counts on from what the W=3 checkpoint says was trained by step 5.
    assert resumed["consumed"][:2] == final["consumed"][:2] == [8, 2 * 16 + 3 * 12 + 3 * 16], resumed["consumed"]
    shutil.rmtree(at_join)  # the test's files stay small: only the two final checkpoints are compared
    a = _tensors(run / "checkpoints" / "step_00000008")
    b = _tensors(tmp_path / "resumed" / "checkpoints" / "step_00000008")
    assert a.keys() == b.keys() and len(a) > 100
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]  # values, optimizer state (AdamW's moments and step) and buffers


def test_a_replacement_lost_amid_its_join_leaves_the_members_to_go_on_in_process(tmp_path):
    # As above, and the replacement is SIGKILLed amid the join after step 5 (the world of W and its owner
    # groups formed, before the heal's messages). The members' state is still that of step 5 at W-1:
    # they go on in-process without it, as after a death, and nobody restarts.
    job = ["train.steps=8", "optim.name=adamw", "masker.min_owners=2", "recovery.verify_every=1"]
    proc = _run(tmp_path, "lost-join", *job, "launch.nproc=4", "launch.on_failure=continue", "launch.replace=1",
                env={faults.KILL_IN_SYNC: "3", faults.AWAIT_JOIN: "4", faults.KILL_IN_JOIN: "5"})
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    run = tmp_path / "lost-join"
    assert faults.fault_marker(run, faults.KILL_IN_JOIN, 5, 1).exists()  # the replacement was killed amid the join
    assert "the replacement for rank 1 did not join after step 5" in console, console[-4000:]
    assert "go on in-process from step 5" in console, console[-4000:]  # the second going on: after the failed join
    assert "resume=auto" not in console and "stopped after step" not in console, console[-4000:]  # no restart path
    assert "owners disagree" not in console, console[-4000:]  # every step's digests agreed, before and after
    steps = _steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == 8, steps  # no step logged twice, the run ended
    assert json.loads((run / "summary.json").read_text())["world_size"] == 3


class _FreezeSeen:
    def __init__(self) -> None:
        self.counts: list[int] = []

    @hookimpl
    def subnetdp_on_step_end(self, context, state, step, metrics):
        self.counts.append(gc.get_freeze_count())


def test_the_loop_trains_with_its_lasting_objects_out_of_the_collectors_sight(tmp_path):
    # A full collection scanned every object of the process (~370k here: 0.1-0.8 s on a loaded machine), a
    # pause every rank waited for at the next collective; a set-up's or a re-plan's allocations made one due
    # within the first steps after a join. The loop freezes what lives for the run and gives it back at the end.
    from tests.helpers import plugin_manager, small_config
    from subnetdp.train.loop import train

    seen, pm = _FreezeSeen(), plugin_manager()
    pm.register(seen, name="freeze-seen")
    try:
        train(small_config("comm.name=local", "masker.coverage=1", "train.steps=2", "train.batch_size=4", "eval.every=0",
                           run_dir=tmp_path), pm=pm)
    finally:
        pm.unregister(seen)
    assert len(seen.counts) == 2 and all(c > 10_000 for c in seen.counts), seen.counts  # the imports, the model
    assert gc.get_freeze_count() == 0  # the collector's again: a process may train more than one run


_CKPT = SimpleNamespace(run_id="", lineage=[], unlogged=None, last_saved=None)  # what a Handover reads


def test_going_on_drops_the_frames_that_held_the_replaced_model():
    # The loop keeps the WentOn it caught for the whole next segment; the frames it was raised through held
    # the segment's locals, among them the model the re-plan replaced (its values and optimizer state).
    def segment(refs: list) -> None:
        model = torch.nn.Linear(64, 64)
        refs.append(weakref.ref(model))
        try:
            raise RuntimeError("a peer was lost")
        except RuntimeError:
            raise WentOn(SimpleNamespace(step=3), _CKPT, [], None) from None

    refs: list = []
    gc.disable()  # freed by reference counting, not by a collection
    try:
        try:
            segment(refs)
        except WentOn as w:
            kept = w.without_frames()
        assert kept.continued.step == 3
        assert refs[0]() is None
    finally:
        gc.enable()


def _plan(path: Path) -> MaskPlan:
    return MaskPlan.from_dict(json.loads(path.read_text()))


def test_a_later_segment_collects_only_what_is_not_frozen_before_freezing_it():
    # A later segment's freeze (after a death's or a join's re-plan) collects the re-formation's cyclic
    # garbage, made since the last freeze, and leaves the frozen unscanned: un-freezing first cost a full
    # collection over every object of the process (0.1-0.3 s on every rank, inside the join's pause, measured).
    from subnetdp.train.setup import freeze_lasting, frozen_while_training

    class Node:
        pass

    def cycle() -> weakref.ref:
        node = Node()
        node.me = node  # reference counting alone never frees it
        return weakref.ref(node)

    with frozen_while_training():
        before_loop = cycle()
        freeze_lasting()  # the loop's first segment: everything alive is frozen, nothing collected
        assert before_loop() is not None
        made_since = cycle()  # a re-formation's garbage
        freeze_lasting()  # a later segment
        assert made_since() is None  # collected before the freeze
        assert before_loop() is not None  # frozen, so never scanned again while the loop runs
    gc.collect()
    assert before_loop() is None  # the collector's again once the loop ended


def test_going_on_keeps_only_the_handover_of_the_last_checkpointer():
    # The loop keeps the WentOn it caught for the whole next segment. It held the last segment's checkpointer,
    # which holds the model its re-plan replaced: every member trained the next segment holding two models.
    model = torch.nn.Linear(64, 64)
    ckpt = SimpleNamespace(run_id="r", lineage=[{"run_id": "r"}], unlogged=[], last_saved=None,
                           state=SimpleNamespace(model=model), _persistent=(model, set()))
    ref = weakref.ref(model)
    went_on = WentOn(SimpleNamespace(step=3), ckpt, [], None)
    del model, ckpt
    gc.disable()  # freed by reference counting, not by a collection
    try:
        assert ref() is None
        assert went_on.ckpt.run_id == "r" and went_on.ckpt.lineage == [{"run_id": "r"}]
    finally:
        gc.enable()

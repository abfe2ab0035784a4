"""What a checkpoint holds goes through each component's ``state_dict()`` / ``load_state_dict(state)``:
local steps resumed in the middle of a cycle (and across the warm-up's end) equal a run never
stopped, the optimizer's state is keyed by parameter name, the host RNGs restore their streams, and
a third-party synchroniser that still defines the old five state methods loads with a
DeprecationWarning, seen through the new two."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from subnetdp.core.contracts import LaunchEnv
from subnetdp.sdp.sync import make_synchronizer
from subnetdp.train.loop import train
from subnetdp.train.stateful import HostRng, OptimizerUnits
from tests.helpers import plugin_manager, small_config

ONE = LaunchEnv(0, 1, 0, 1, "test")
LOCAL = ("comm.name=local", "masker.coverage=1", "train.batch_size=2", "data.seq_len=32", "checkpoint.enabled=true",
         "checkpoint.every=1", "sync.mode=local_steps", "sync.every=2", "sync.warmup_steps=2", "sync.outer_lr=0.7",
         "sync.outer_momentum=0.9", "optim.name=adamw", "optim.lr=1e-3", "optim.schedule=constant")


def _run(root: Path, name: str, *overrides: str):
    cfg = small_config(*LOCAL, f"run.name={name}", *overrides, recipe="llama_tiny_stdlib", run_dir=root)
    return train(cfg, ONE, plugin_manager())


def test_local_steps_state_round_trips_through_a_checkpoint_mid_cycle(tmp_path):
    """Warm-up of 2 steps, then H = 2: resumed from the checkpoint after step 3 (local steps, in the
    middle of a cycle: the anchor of step 2, the momentum of no synchronisation yet) it trains steps
    4-5 exactly as the run that wrote it: parameters, anchor, momentum and the phase the step gave."""
    straight = _run(tmp_path, "straight", "train.steps=5", "checkpoint.keep=0")
    mid = tmp_path / "straight" / "checkpoints" / "step_00000003"
    resumed = _run(tmp_path, "resumed", "train.steps=5", f"resume={mid}")
    a, b = straight.state.synchronizer.state_dict(), resumed.state.synchronizer.state_dict()
    assert set(a) == {"pieces", "rank"} and set(a["pieces"]) == {"outer_anchor/", "outer_momentum/"}
    params = dict(resumed.state.model.named_parameters())
    for prefix in a["pieces"]:
        assert a["pieces"][prefix].keys() == b["pieces"][prefix].keys() and b["pieces"][prefix]
        for name, t in a["pieces"][prefix].items():
            assert t.shape == params[name].shape and torch.equal(t, b["pieces"][prefix][name]), (prefix, name)
    assert torch.equal(a["rank"]["local_steps_nonfinite"], b["rank"]["local_steps_nonfinite"])
    # Local from the step on (the warm-up ended at 2): it synchronised at 4 and at the last step, 5.
    assert resumed.state.synchronizer.local and resumed.state.synchronizer.syncs == 2
    for (name, x), (_, y) in zip(straight.state.model.state_dict().items(), resumed.state.model.state_dict().items()):
        assert torch.equal(x, y), name
    # The optimizer, per parameter name: equal after the resume, and taken back by name by an
    # optimizer whose parameters come in another order.
    states = resumed.state.stateful()
    assert set(states) == {"model", "optimizer", "scheduler", "sync"} and states["sync"] is resumed.state.synchronizer
    # The model, per piece (global name, and slice when cut): equal after the resume, no "module." prefix,
    # and loaded back by key into a model whose values were wiped.
    model, want_model = states["model"].state_dict(), straight.state.stateful()["model"].state_dict()
    assert model["params"].keys() == want_model["params"].keys() and model["params"]
    assert {k.split("@")[0] for k in model["params"]} == {resumed.state.pmap.pieces[n][0].global_name for n in params}
    assert all(torch.equal(t, want_model["params"][k]) for k, t in model["params"].items())
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    states["model"].load_state_dict({k: {n: t.clone() for n, t in d.items()} for k, d in want_model.items()})
    assert all(torch.equal(t, want_model["params"][k]) for k, t in states["model"].state_dict()["params"].items())
    got, want = states["optimizer"].state_dict(), straight.state.stateful()["optimizer"].state_dict()
    assert got["class"] == "AdamW" and set(got["params"]) == set(params) and len(got["param_groups"]) == 1
    for name, per in want["params"].items():
        assert per.keys() == got["params"][name].keys() and all(torch.equal(per[k], got["params"][name][k]) for k in per)
    backwards = torch.optim.AdamW(list(reversed(list(params.values()))), lr=1e-3)
    OptimizerUnits(resumed.state.model, backwards, resumed.state.parallel).load_state_dict(got)
    for name, p in params.items():
        assert torch.equal(backwards.state[p]["exp_avg"], got["params"][name]["exp_avg"]), name
    assert states["scheduler"].state_dict() == straight.state.scheduler.state_dict()
    # The old state methods still answer on the built-in synchronisers, with a DeprecationWarning.
    sync = resumed.state.synchronizer
    with pytest.warns(DeprecationWarning, match="extra_tensors.* use state_dict"):
        old = sync.extra_tensors()
    assert {(p, n) for p, n, _ in old} == {(p, n) for p in b["pieces"] for n in b["pieces"][p]}
    with pytest.warns(DeprecationWarning, match="rank_state"):
        assert set(sync.rank_state()) == {"local_steps_nonfinite"}
    with pytest.warns(DeprecationWarning, match="restore_extra"):
        sync.restore_extra({"outer_momentum/"})  # no anchor found: a cycle starts at the parameters, momentum zero
    now = sync.state_dict()["pieces"]
    assert all(torch.equal(now["outer_anchor/"][n], params[n].detach()) for n in now["outer_anchor/"])
    assert all(not m.any() for m in now["outer_momentum/"].values())


def test_host_rngs_restore_their_streams_or_start_from_a_seed():
    rng = HostRng()

    def draw():
        return torch.rand(3).tolist(), random.random(), np.random.rand()

    saved = rng.state_dict()
    first = draw()
    rng.load_state_dict(saved)
    assert draw() == first
    rng.load_state_dict({"seed": 5})
    seeded = draw()
    rng.load_state_dict({"seed": 5})
    assert draw() == seeded != first


class OldStyle:
    """A synchroniser of the protocol before state_dict: only the five old state methods."""

    dense = replicated = owners_diverge = False

    def __init__(self) -> None:
        self.anchor, self.calls, self.nonfinite = torch.zeros(3), [], 0

    def extra_tensors(self):
        return [("outer_anchor/", "w", self.anchor)]

    def resume_at(self, step):
        self.calls.append(("resume_at", step))

    def restore_extra(self, found):
        self.calls.append(("restore_extra", set(found), self.anchor.tolist()))

    def rank_state(self):
        return {"skipped": self.nonfinite}

    def load_rank_state(self, state):
        self.calls.append(("load_rank_state", dict(state)))


def test_a_synchroniser_with_the_old_state_methods_loads_with_a_deprecation_warning():
    old = OldStyle()
    with pytest.warns(DeprecationWarning, match="OldStyle defines extra_tensors, rank_state"):
        sync = make_synchronizer(None, None, None, None, None, None, sharded=lambda *a: old)
    assert sync.state_dict() == {"pieces": {"outer_anchor/": {"w": old.anchor}}, "rank": {"skipped": 0}}
    assert sync.state_dict()["pieces"]["outer_anchor/"]["w"] is old.anchor  # live, as extra_tensors gave it
    sync.load_state_dict({"step": 7, "pieces": {"outer_anchor/": {"w": torch.ones(3)}, "other/": {"w": torch.ones(3)}},
                          "rank": {"skipped": 2}})
    # The phase before the pieces, the pieces before restore_extra, as a checkpoint loaded them.
    assert old.calls == [("resume_at", 7), ("restore_extra", {"outer_anchor/"}, [1.0, 1.0, 1.0]),
                         ("load_rank_state", {"skipped": 2})]
    sync.load_state_dict({"pieces": {}})  # a re-plan from the live owners: no step, nothing found
    assert old.calls[-2:] == [("restore_extra", set(), [1.0, 1.0, 1.0]), ("load_rank_state", {})]
    sync.nonfinite = 5  # every other attribute is the synchroniser's own
    assert old.nonfinite == 5 and sync.dense is False and sync.inner is old


def test_a_synchroniser_with_state_dict_is_used_as_it_is():
    class New(OldStyle):
        def state_dict(self):
            return {"pieces": {}, "rank": {}}

        def load_state_dict(self, state):
            return None

    new = New()
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")
        assert make_synchronizer(None, None, None, None, None, None, sharded=lambda *a: new) is new

"""The run's three objects keep their shape: the context is frozen, the state changes only through
its own methods, the synchroniser is asked what it does (never which kind it is), and the loop stays
the loop."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from subnetdp.core.contracts import LaunchEnv, NullCommunicator, RunContext, RunResult, TrainStateView
from subnetdp.sdp.local_steps import LocalStepsSynchronizer
from subnetdp.sdp.sync import OwnerGroupAverager
from subnetdp.train.state import TrainState

PACKAGE = Path(__file__).parents[2] / "subnetdp"
SYNCHRONISER_KINDS = {LocalStepsSynchronizer.__name__, OwnerGroupAverager.__name__, "ShardedOwnerAverager"}


def _isinstance_on_a_synchroniser_kind(source: str) -> list[int]:
    """Lines of ``isinstance(x, K)`` / ``isinstance(x, (K, ...))`` with K a synchroniser class."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            kinds = node.args[1].elts if len(node.args) > 1 and isinstance(node.args[1], ast.Tuple) else node.args[1:]
            names = {k.id if isinstance(k, ast.Name) else getattr(k, "attr", None) for k in kinds}
            if names & SYNCHRONISER_KINDS:
                lines.append(node.lineno)
    return lines


def test_no_code_asks_which_kind_of_synchroniser_it_holds():
    found = {str(f.relative_to(PACKAGE)): lines for f in sorted(PACKAGE.rglob("*.py"))
             if (lines := _isinstance_on_a_synchroniser_kind(f.read_text()))}
    assert found == {}, f"ask the synchroniser (GradSynchronizer in sdp/sync.py) instead: {found}"


def test_the_check_sees_an_isinstance_on_a_synchroniser_kind():
    assert _isinstance_on_a_synchroniser_kind("isinstance(run.averager, LocalStepsSynchronizer)") == [1]
    assert _isinstance_on_a_synchroniser_kind("isinstance(s, (int, sync.OwnerGroupAverager))") == [1]
    assert _isinstance_on_a_synchroniser_kind("isinstance(s, int)") == []


def test_the_loop_file_is_the_loop():
    lines = (PACKAGE / "train" / "loop.py").read_text().splitlines()
    assert len(lines) < 200, f"train/loop.py has {len(lines)} lines: set-up, evaluation and reporting live elsewhere"


def test_the_run_context_is_frozen_and_its_config_read_only():
    cfg = OmegaConf.create({"seed": 0})
    OmegaConf.set_readonly(cfg, True)
    ctx = RunContext(cfg=cfg, env=LaunchEnv(), comm=NullCommunicator(None, LaunchEnv()), plugins=None, adapter=None,
                     data=None, spec=None, run_dir=Path("."))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.run_dir = Path("elsewhere")  # type: ignore[misc]
    with pytest.raises(ReadonlyConfigError):
        ctx.cfg.seed = 1
    assert ctx.rank == 0 and ctx.world_size == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunResult(summary={}).step = 3  # type: ignore[misc]


def test_what_hooks_see_of_the_state_cannot_be_set():
    views = [n for n, v in vars(TrainStateView).items() if isinstance(v, property)]
    assert {"model", "optimizer", "plan", "step"} <= set(views)
    for name in views:
        prop = getattr(TrainState, name)
        assert isinstance(prop, property) and prop.fset is None, f"TrainState.{name} must be read-only"

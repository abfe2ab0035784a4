"""Property-based fuzzing of what a run reads back from disk: a checkpoint's manifest and a run's summary.

A real run writes a real checkpoint and summary; hypothesis damages them (a field replaced by a
hostile JSON value, removed or added, a file name pointing elsewhere, a number one off, the text cut
short) and feeds them to what reads them: ``load_union`` (what ``subnetdp eval`` and ``export`` run)
and ``finished_run`` (what ``train resume=auto`` reads before anything starts). The property: success,
or a one-line :class:`SubnetdpError`; never another exception, and no file opened outside the
checkpoint (Python's audit hook sees every ``open``; safetensors opens natively, but only files that
``verify_file`` has opened, hashed and found inside first). Examples are fixed by a seed, as in
``test_config_fuzz.py`` (``SUBNETDP_FUZZ_SEED=N`` explores others, ``SUBNETDP_FUZZ_EXAMPLES`` more).
"""

from __future__ import annotations

import collections
import copy
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from subnetdp.core.config import config_root
from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import SubnetdpError
from subnetdp.train.upfront import finished_run
from subnetdp.evaluate.export import load_union
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.loop import train
from tests.helpers import plugin_manager, small_config

SEED = int(os.environ.get("SUBNETDP_FUZZ_SEED", "16"))
EXAMPLES = int(os.environ.get("SUBNETDP_FUZZ_EXAMPLES", "40"))
PM = plugin_manager()
OUTCOMES: collections.Counter = collections.Counter()
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)  # a load takes a second: shrinking would take many minutes
HOSTILE = [None, True, False, 0, -1, 1, 2, 2**31, 2**63, 2**70, 1.5, -0.0, float("nan"), float("inf"), "", "x",
           "../x", "../../../../etc/passwd", "/etc/passwd", "a/b", "a\\b", "..", ".", "x\0y", "\u202e", "é" * 3,
           "pieces_0.safetensors", "rank_0.safetensors", "plan.json", "config.yaml", "MANIFEST.json",
           "subnetdp-checkpoint/2", "subnetdp-checkpoint/1", "0" * 64, [], [1], [-1], [10, 512], {}, {"a": 1},
           {"bytes": 1, "sha256": "0" * 64}, {"file": "../x", "writer": 0, "shape": [1]}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-src")
    cfg = small_config("comm.name=local", "masker.coverage=1", "train.batch_size=8", "train.steps=1", "run.name=src",
                       "checkpoint.enabled=true", "checkpoint.final=always", run_dir=root)
    train(cfg, LaunchEnv(0, 1, 0, 1, "test"), PM)
    return root / "src"


@pytest.fixture(scope="module")
def summary_run(tmp_path_factory) -> tuple[object, Path]:
    """A resume=auto config and the summary.json it reads first."""
    root = tmp_path_factory.mktemp("fuzz-summary")
    (root / "s").mkdir()
    return small_config("run.name=s", "resume=auto", "checkpoint.enabled=true", "train.steps=1", run_dir=root), root / "s" / "summary.json"


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print(f"\ncheckpoint fuzzer (seed {SEED}): {dict(OUTCOMES)}")


def _paths(node, prefix=()) -> list[tuple]:
    """Every path into a JSON value (keys and list indices), containers included."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _mutate(record, path: tuple, action: str, value):
    """``record`` with the node at ``path`` replaced by ``value``, deleted, nudged by one, or given a new key."""
    if not path:
        return value if action == "replace" else record
    parent = record
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if action == "delete":
        parent.pop(last) if isinstance(parent, dict) else parent.pop(last)
    elif action == "nudge" and isinstance(parent[last], int) and not isinstance(parent[last], bool):
        parent[last] += 1
    elif action == "add" and isinstance(parent[last], dict):
        parent[last][value if isinstance(value, str) else "x"] = value
    else:
        parent[last] = value
    return record


def _edits(draw_record):
    """A strategy of 1-3 edits of ``draw_record`` (a fixed JSON value): (path, action, value)."""
    paths = _paths(draw_record)
    edit = st.tuples(st.sampled_from(paths), st.sampled_from(["replace", "replace", "delete", "nudge", "add"]),
                     st.sampled_from(HOSTILE))
    return st.lists(edit, min_size=1, max_size=3)


def _apply(record, edits) -> object:
    out = copy.deepcopy(record)
    for path, action, value in edits:
        try:
            out = _mutate(out, path, action, copy.deepcopy(value))
        except (KeyError, IndexError, TypeError, AttributeError):
            pass  # an earlier edit removed or replaced what this one aimed at
    return out


class OpenAudit:
    """Files opened while ``active`` (Python's audit hook: builtins.open, io.open, os.open)."""

    def __init__(self) -> None:
        self.active, self.opened = False, []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if self.active and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            self.opened.append(os.path.realpath(os.fsdecode(args[0])))


AUDIT = OpenAudit()


def _outside(opened: list[str], ckpt: Path) -> list[str]:
    """Opened files that are neither the checkpoint's, the installation's nor the config's temporary copy."""
    import subnetdp

    allowed = [str(ckpt.resolve()) + "/", str(config_root().resolve()) + "/", sys.prefix + "/", sys.base_prefix + "/",
               str(Path(subnetdp.__file__).resolve().parent) + "/", "/proc/", "/sys/", "/dev/"]
    recipe = re.compile(re.escape(os.path.realpath(tempfile.gettempdir())) + r"/tmp[^/]+(/config\.yaml)?")
    return [p for p in opened if not any(p.startswith(a) for a in allowed) and not recipe.fullmatch(p)]


def _check_outcome(call, where: str) -> str:
    try:
        call()
    except SubnetdpError as e:
        msg = str(e)
        assert "\n" not in msg and len(msg) < 2000, f"{where}: not one line: {msg!r}"
        return "refused: " + type(e).__name__
    except Exception as e:  # anything else is a traceback the user would see
        raise AssertionError(f"{where}: {type(e).__name__} escaped: {e}") from e
    return "accepted"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True,
          database=None, phases=NO_SHRINK)
@given(data=st.data())
@seed(SEED)
def test_fuzzed_manifest_loads_or_is_refused_in_one_line(data, run_dir, tmp_path_factory):
    source = ck.latest_checkpoint(run_dir)
    honest = json.loads((source / ck.MANIFEST).read_text())
    ckpt = tmp_path_factory.mktemp("fuzz") / source.name
    ckpt.mkdir()
    for f in source.iterdir():  # hard links: the tensors are read, never copied or changed
        if f.name != ck.MANIFEST:
            os.link(f, ckpt / f.name)
    if data.draw(st.integers(0, 9), label="raw text") == 0:
        text = json.dumps(honest)
        text = text[:data.draw(st.integers(0, len(text) - 1), label="cut at")]
    else:
        text = json.dumps(_apply(honest, data.draw(_edits(honest), label="edits")))
    (ckpt / ck.MANIFEST).write_text(text)
    where = f"(fuzzer seed {SEED}: rerun with SUBNETDP_FUZZ_SEED={SEED}) manifest {text[:300]!r}"
    AUDIT.opened.clear()
    AUDIT.active = True
    try:
        outcome = _check_outcome(lambda: load_union(ckpt, PM), where)
    finally:
        AUDIT.active = False
    outside = _outside(AUDIT.opened, ckpt)
    assert outside == [], f"{where}: opened {outside[:3]}, outside the checkpoint"
    OUTCOMES["manifest " + outcome] += 1


@settings(max_examples=EXAMPLES * 3, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True,
          database=None, phases=NO_SHRINK)
@given(data=st.data())
@seed(SEED)
def test_fuzzed_summary_is_read_or_refused_in_one_line(data, run_dir, summary_run):
    honest = json.loads((run_dir / "summary.json").read_text())
    cfg, summary = summary_run
    if data.draw(st.integers(0, 9), label="raw text") == 0:
        text = json.dumps(honest)
        text = text[:data.draw(st.integers(0, len(text) - 1), label="cut at")]
    else:
        text = json.dumps(_apply(honest, data.draw(_edits(honest), label="edits")))
    summary.write_text(text)
    where = f"(fuzzer seed {SEED}: rerun with SUBNETDP_FUZZ_SEED={SEED}) summary {text[:300]!r}"
    OUTCOMES["summary " + _check_outcome(lambda: finished_run(cfg), where)] += 1

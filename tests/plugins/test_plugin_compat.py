"""Plugin packages written against the 0.1.0 API, installed beside a current one.

Three real distributions (a ``.dist-info`` with ``entry_points.txt`` next to their module, on
``PYTHONPATH``), found by ``importlib.metadata`` as pip-installed ones are, and used through the
``subnetdp`` command in subprocesses:

- ``subnetdp-oldrun``: ``subnetdp_on_run_end(run)``, the 0.1.0 signature, adapted for this release;
- ``subnetdp-badapi``: ``subnetdp_register_maskers(registry, config)``, which no release had: left
  out with one line, listed as broken;
- ``subnetdp-goodapi``: ``subnetdp_on_run_end(context, result)``, current: it still runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from subnetdp.core.compat import IncompatiblePlugin, LegacyRun, check_plugin
from subnetdp.core.hookspecs import hookimpl

REPO = Path(__file__).resolve().parents[2]

PACKAGES = {
    "oldrun": '''
        import json
        from subnetdp import hookimpl

        @hookimpl
        def subnetdp_on_run_end(run):
            # The 0.1.0 names: run.rank, run.run_dir, run.summary, run.step, run.plan.
            (run.run_dir / f"oldrun_{run.rank}.json").write_text(json.dumps(
                {"step": run.step, "summary_steps": run.summary["steps"], "units": run.plan.num_units}))
        ''',
    "badapi": '''
        from subnetdp import hookimpl

        @hookimpl
        def subnetdp_register_maskers(registry, config):
            raise AssertionError("never called")
        ''',
    "goodapi": '''
        from subnetdp import hookimpl

        @hookimpl
        def subnetdp_on_run_end(context, result):
            (context.run_dir / f"goodapi_{context.rank}.txt").write_text(str(result.step))
        ''',
}


def _install(site: Path, name: str, source: str) -> None:
    """A distribution ``subnetdp-<name>`` 0.1.0 whose ``subnetdp`` entry point ``<name>`` is module ``subnetdp_<name>``."""
    (site / f"subnetdp_{name}.py").write_text(textwrap.dedent(source))
    info = site / f"subnetdp_{name}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: subnetdp-{name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[subnetdp]\n{name} = subnetdp_{name}\n")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("site")
    for name, source in PACKAGES.items():
        _install(site, name, source)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SUBNETDP_DISABLE_PLUGINS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _subnetdp(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "subnetdp", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_old_plugin_is_one_line_and_the_others_load(env: dict[str, str], tmp_path: Path) -> None:
    listing = _subnetdp(env, tmp_path, "plugins", "--json")
    assert listing.returncode == 0, listing.stderr
    assert "Traceback" not in listing.stderr and "PluginValidationError" not in listing.stderr, listing.stderr
    rows = {r["name"]: r for r in json.loads(listing.stdout)}
    assert rows["badapi"]["kind"] == "broken" and rows["badapi"]["package"] == "subnetdp-badapi"
    assert rows["badapi"]["version"] == "0.1.0" and rows["badapi"]["hooks"] == "subnetdp_register_maskers"
    assert (rows["goodapi"]["kind"], rows["goodapi"]["hooks"]) == ("hooks", "subnetdp_on_run_end")
    assert (rows["oldrun"]["kind"], rows["oldrun"]["hooks"]) == ("hooks", "subnetdp_on_run_end")
    assert rows["cyclic"]["package"] == "subnetdp"  # the built-ins still load
    # One line for the broken plugin: its package, the hook, what it declared and what the hook is now.
    bad = [line for line in listing.stderr.splitlines() if "badapi" in line]
    assert len(bad) == 1, listing.stderr
    for words in ("subnetdp-badapi", "subnetdp_register_maskers(registry, config)",
                  "subnetdp_register_maskers(registry)", "SUBNETDP_DISABLE_PLUGINS=badapi"):
        assert words in bad[0], bad[0]
    assert any("oldrun" in line and "0.3.0" in line for line in listing.stderr.splitlines()), listing.stderr

    table = _subnetdp(env, tmp_path, "plugins")
    assert table.returncode == 0, table.stderr
    assert f"broken: {rows['badapi']['problem']}" in table.stdout

    # A run with all three installed: the adapted 0.1.0 hook and the current one both run at the end.
    runs = tmp_path / "runs"
    train = _subnetdp(env, tmp_path, "train", "resnet18_digits", "launch.nproc=1", "comm.name=local",
                      "masker.coverage=1", "train.steps=2", "optim.warmup_steps=0", "train.batch_size=8",
                      f"run.dir={runs}", "run.name=t", "train.progress=false", "eval.bn_recalibrate_batches=0",
                      "model.variant=resnet18")
    assert train.returncode == 0, f"stdout:\n{train.stdout}\nstderr:\n{train.stderr}"
    assert (runs / "t" / "goodapi_0.txt").read_text() == "2"
    old = json.loads((runs / "t" / "oldrun_0.json").read_text())
    plan = json.loads((runs / "t" / "plan.json").read_text())
    assert old == {"step": 2, "summary_steps": 2, "units": plan["num_units"]}


def test_adapter_wraps_only_the_run_signature() -> None:
    class Old:
        @hookimpl(trylast=True)
        def subnetdp_on_step_end(self, run, step):
            return (run.rank, step)

    class Odd:
        @hookimpl
        def subnetdp_on_step_end(self, run, loss):
            pass

    opts = lambda obj, name: getattr(getattr(obj, name), "subnetdp_impl", None)  # noqa: E731
    with pytest.warns(DeprecationWarning, match=r"subnetdp_on_step_end\(run, step\) -> "
                                                r"subnetdp_on_step_end\(context, state, step, metrics\)"):
        adapted = check_plugin(Old(), "old", "pkg-old", opts)
    context = type("C", (), {"rank": 3})()
    result = type("R", (), {"summary": {"step": 5}})()
    # The wrapper keeps the hook's options and hands the old function a run view.
    assert adapted.subnetdp_on_step_end.subnetdp_impl["trylast"] is True
    assert adapted.subnetdp_on_step_end(context=context, state=object(), step=7, metrics={}) == (3, 7)
    view = LegacyRun(context, object(), result)
    assert (view.rank, view.summary) == (3, {"step": 5})
    with pytest.raises(AttributeError, match="read-only"):
        view.rank = 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        odd = check_plugin(Odd(), "odd", "pkg-odd", opts)
    assert isinstance(odd, IncompatiblePlugin) and "subnetdp_on_step_end(run, loss)" in odd.line

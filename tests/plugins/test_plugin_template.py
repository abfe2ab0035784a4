"""The third-party plugin template (``examples/plugin-template``) works as its README promises.

It is installed for real with pip (offline, into a temporary target directory) and then used
through the ``subnetdp`` command line in subprocesses, so this test process never loads it as a
plugin. Its masker is also checked in-process, loaded from its source file without registering it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from subnetdp.core.contracts import Partition, Unit
from subnetdp.core.errors import ConfigError
from subnetdp.core.plan import make_plan

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "examples" / "plugin-template"
MASKER_FILE = TEMPLATE / "src" / "subnetdp_strided" / "strided.py"


def _project_field(field: str) -> str:
    """``name`` or ``version`` from the template's ``[project]`` table."""
    text = (TEMPLATE / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    match = re.search(rf'^{field}\s*=\s*"([^"]+)"', project, re.MULTILINE)
    assert match, f"no {field} in [project] of {TEMPLATE / 'pyproject.toml'}"
    return match.group(1)


@dataclass
class Installed:
    site: Path
    env: dict[str, str]
    tmp: Path

    def subnetdp(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "subnetdp", *args], env=env or self.env, cwd=self.tmp,
                              capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The template pip-installed into ``<tmp>/site``, and an environment that sees it."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.fail("setuptools must be installed to build the template offline (--no-build-isolation)")
    tmp = tmp_path_factory.mktemp("plugin-template")
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources it builds.
    src = tmp / "src"
    shutil.copytree(TEMPLATE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                          "--no-index", "--disable-pip-version-check", "--target", str(site), str(src)],
                         capture_output=True, text=True, timeout=180)
    assert pip.returncode == 0, f"pip install of the template failed:\n{pip.stdout}\n{pip.stderr}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SUBNETDP_DISABLE_PLUGINS", None)
    # The repository comes second so the subprocesses run this checkout's subnetdp.
    paths = [str(site), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return Installed(site, env, tmp)


def _plugin_rows(stdout: str) -> dict[str, list[str]]:
    """``subnetdp plugins`` table rows by registered name: NAME KIND PACKAGE VERSION PLUGIN HOOKS."""
    lines = stdout.strip().splitlines()
    assert lines and lines[0].split()[:4] == ["NAME", "KIND", "PACKAGE", "VERSION"], stdout
    return {row.split()[0]: row.split() for row in lines[1:] if row.strip() and not row.startswith("disabled:")}


def test_pip_installed_template_is_listed_and_can_be_disabled(installed: Installed) -> None:
    name, version = _project_field("name"), _project_field("version")
    assert (installed.site / "subnetdp_strided" / "strided.py").is_file()

    listing = installed.subnetdp("plugins")
    assert listing.returncode == 0, listing.stderr
    rows = _plugin_rows(listing.stdout)
    assert "strided" in rows, listing.stdout
    _, kind, package, shown_version, plugin, hooks = rows["strided"]
    assert (kind, package, shown_version, plugin) == ("masker", name, version, "strided")
    assert set(hooks.split(",")) == {"subnetdp_register_maskers", "subnetdp_on_run_end"}
    assert rows["cyclic"][2] == "subnetdp"  # the built-ins are still there

    off = installed.subnetdp("plugins", env=dict(installed.env, SUBNETDP_DISABLE_PLUGINS="strided"))
    assert off.returncode == 0, off.stderr
    assert "strided" not in _plugin_rows(off.stdout)
    assert "disabled: strided" in off.stdout


def test_train_two_steps_selecting_the_template_masker(installed: Installed) -> None:
    runs = installed.tmp / "runs"
    result = installed.subnetdp(
        "train", "resnet18_digits", "launch.nproc=1", "comm.name=local", "masker.name=strided",
        "masker.coverage=1", "masker.offset=1", "train.steps=2", "optim.warmup_steps=0", f"run.dir={runs}", "run.name=t",
        "train.progress=false", "eval.bn_recalibrate_batches=0", "model.variant=resnet18")
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"

    run_dir = runs / "t"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 1 and plan["owned"] == [list(range(plan["num_units"]))]
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.masker.name == "strided"
    assert cfg.masker.offset == 1  # the plugin's own key, mounted under masker.
    # The lifecycle hook ran in the training process and saw the plan that was written.
    assert f"strided: plan {plan['digest']}, offset 1: rank 0 kept {plan['num_units']} of" in result.stdout


def test_typo_in_the_plugin_key_is_a_clear_error(installed: Installed) -> None:
    result = installed.subnetdp("train", "resnet18_digits", "launch.nproc=1", "comm.name=local",
                                "masker.name=strided", "masker.ofset=1", f"run.dir={installed.tmp / 'typo-runs'}")
    assert result.returncode == 2, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "masker.ofset" in result.stderr
    assert "did you mean 'offset'" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (installed.tmp / "typo-runs").exists()  # it stopped before making a run directory
    # The README and the template's README show this very line (they went stale as keys were added).
    line = result.stderr.strip().splitlines()[-1]
    for readme in (REPO / "README.md", REPO / "examples" / "plugin-template" / "README.md"):
        assert line in readme.read_text(encoding="utf-8"), (readme, line)


# --------------------------------------------------------------------------- the masker itself


@pytest.fixture(scope="module")
def strided():
    """The template's masker module, loaded from its file (not registered as a plugin)."""
    spec = importlib.util.spec_from_file_location("template_strided_under_test", MASKER_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _partition(*group_sizes: int) -> Partition:
    units, i = [], 0
    for g, size in enumerate(group_sizes):
        for _ in range(size):
            units.append(Unit(i, f"u{i}", f"g{g}", 1.0, ()))
            i += 1
    return Partition("block", units, shared=[])


def _plan(strided, partition: Partition, world_size: int, coverage: float, offset: int = 0, group_by: str = "auto"):
    cfg = OmegaConf.structured(strided.StridedMasker.Config(name="strided", coverage=coverage, offset=offset,
                                                            group_by=group_by))
    return strided.StridedMasker(cfg).plan(partition, world_size, seed=0)


def test_rank_r_keeps_units_r_plus_multiples_of_w(strided) -> None:
    part = _partition(8)
    assert _plan(strided, part, 4, 0.25).owned == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _plan(strided, part, 4, 0.25, offset=1).owned == [[1, 5], [2, 6], [3, 7], [0, 4]]
    # After a lap (0, 2) the next starts one unit on (1), so no unit is taken twice.
    assert _plan(strided, _partition(4), 2, 0.75).owned == [[0, 1, 2], [1, 2, 3]]
    # Groups are walked separately; group_by=model makes one group of all units.
    assert _plan(strided, _partition(4, 8), 2, 0.5).owned == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]
    assert _plan(strided, _partition(2, 2), 4, 0.5, group_by="model").owned == [[0, 1], [1, 2], [2, 3], [0, 3]]


def test_every_rank_keeps_n_g_distinct_units_per_group(strided) -> None:
    for sizes in [(1,), (2, 2, 2, 2), (3, 5), (7,), (12,)]:
        part = _partition(*sizes)
        groups = part.groups()
        for world in range(1, 7):
            for coverage in (0.1, 0.25, 0.5, 0.75, 1.0):
                for offset in (0, 1, 5):
                    plan = _plan(strided, part, world, coverage, offset)
                    for r, units in enumerate(plan.owned):
                        assert len(set(units)) == len(units)
                        for members in groups.values():
                            ids = {u.id for u in members}
                            expected = strided.units_kept(coverage, len(ids))
                            assert len(ids.intersection(units)) == expected, (sizes, world, coverage, offset, r)
    # Full coverage is plain data parallelism: every rank holds every unit.
    assert _plan(strided, _partition(3, 5), 3, 1.0).owned == [list(range(8))] * 3
    make_plan(strided.StridedMasker(OmegaConf.structured(strided.StridedMasker.Config(coverage=0.5))),
              _partition(2, 2, 2, 2), 2, seed=0)  # covers every unit: validation passes


def test_validate_config_rejects_a_negative_offset(strided) -> None:
    cfg = OmegaConf.structured(strided.StridedMasker.Config(name="strided", offset=-2))
    with pytest.raises(ConfigError, match=r"masker\.offset=-2: must be >= 0"):
        strided.StridedMasker.validate_config(cfg, None)
    strided.StridedMasker.validate_config(OmegaConf.structured(strided.StridedMasker.Config(name="strided")), None)

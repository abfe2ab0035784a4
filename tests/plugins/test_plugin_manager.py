"""The plugin manager: discovery, duplicates, disabling, hook documentation and lifecycle calls."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from subnetdp.core import hookspecs
from subnetdp.core.contracts import LaunchEnv
from subnetdp.cli import main
from subnetdp.core.errors import ConfigError, SubnetdpError
from subnetdp.core.hookspecs import hookimpl
from subnetdp.train.loop import train
from subnetdp.core.plugins import PluginManager
from subnetdp.plugins.maskers.cyclic import CyclicMasker
from tests.helpers import small_config

SPECS = [f for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("subnetdp_")]


def test_every_hook_is_documented_with_its_parameters():
    assert len(SPECS) == 8
    for spec in SPECS:
        doc = inspect.getdoc(spec) or ""
        assert "Called on every rank" in doc, spec.__name__
        for param in inspect.signature(spec).parameters:
            assert f":param {param}:" in doc, (spec.__name__, param)
        assert spec.__name__ in hookspecs.__doc__  # placed in the loop's pseudocode


class Recorder:
    """A plugin object with every lifecycle hook."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @hookimpl
    def subnetdp_on_run_start(self, context, state):
        self.calls.append(("start", context.rank, state.plan.digest()))

    @hookimpl
    def subnetdp_on_step_end(self, step, metrics):  # a hook takes only the keyword parameters it needs
        self.calls.append(("step", step, round(metrics["loss"], 6)))

    @hookimpl
    def subnetdp_on_eval_end(self, step, metrics):
        self.calls.append(("eval", step, sorted(metrics)))

    @hookimpl
    def subnetdp_on_run_end(self, result):
        self.calls.append(("end", result.summary["steps"]))


def test_lifecycle_hooks_fire_in_order(tmp_path):
    rec = Recorder()
    pm = PluginManager(extra=[rec])
    cfg = small_config("comm.name=local", "masker.coverage=1", "train.steps=3", "eval.every=2", "eval.batches=1",
                       "run.name=hooks", run_dir=tmp_path)
    train(cfg, LaunchEnv(), pm)
    kinds = [c[0] for c in rec.calls]
    # An evaluation at step s fires before that step's step-end hook.
    assert kinds == ["start", "step", "eval", "step", "eval", "step", "end"]
    assert [c[1] for c in rec.calls if c[0] == "step"] == [1, 2, 3]
    assert [c[1] for c in rec.calls if c[0] == "eval"] == [2, 3]
    assert ("eval", 2, ["accuracy", "loss"]) in rec.calls
    assert rec.calls[-1] == ("end", 3)


class Clash:
    @hookimpl
    def subnetdp_register_maskers(self, registry):
        registry.add("cyclic", CyclicMasker)


def test_duplicate_names_are_an_error_naming_both_plugins():
    with pytest.raises(SubnetdpError) as e:
        PluginManager(extra=[Clash()])
    assert "masker name 'cyclic' is registered twice" in str(e.value)
    assert "'cyclic'" in str(e.value) and "SUBNETDP_DISABLE_PLUGINS" in str(e.value)


def test_disable_by_name(monkeypatch):
    monkeypatch.setenv("SUBNETDP_DISABLE_PLUGINS", "synthetic")
    pm = PluginManager()
    assert "synthetic" not in pm.registries["data"].names()
    assert "digits" in pm.registries["data"].names()
    rest = PluginManager(disable=["digits"]).registries["data"].names()
    assert rest == sorted(set(pm.registries["data"].names()) - {"digits"})  # both disabled, the others stay


def test_a_disabled_plugin_is_named_as_disabled_and_by_what(monkeypatch, capsys):
    monkeypatch.setenv("SUBNETDP_DISABLE_PLUGINS", "digits, swin")
    assert main(["plan", "resnet18_digits", "-n", "2", "--no-estimate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("subnetdp: error: data.name='digits': dataset 'digits' is disabled: its plugin 'digits' is "
                          "switched off by SUBNETDP_DISABLE_PLUGINS=digits, swin (take 'digits' out of "
                          "SUBNETDP_DISABLE_PLUGINS to use it) — available: ") and err.count("\n") == 1, err
    monkeypatch.delenv("SUBNETDP_DISABLE_PLUGINS")
    # A plugin that registers several names (cifar: cifar10, cifar100), disabled from Python.
    data = PluginManager(disable=["cifar"]).registries["data"]
    with pytest.raises(ConfigError, match=r"^data.name='cifar100': dataset 'cifar100' is disabled: its plugin "
                                          r"'cifar' is switched off by PluginManager\(disable=\['cifar'\]\)"):
        data.get("cifar100")
    with pytest.raises(ConfigError, match=r"^data.name='digitz': unknown dataset; available: .* did you mean 'digits'"):
        data.get("digitz")  # a name no plugin registers stays unknown


def test_plugins_command_lists_builtins():
    out = subprocess.run([sys.executable, "-m", "subnetdp", "plugins", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    import json

    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["cyclic"]["kind"] == "masker" and rows["cyclic"]["package"] == "subnetdp"
    assert rows["gloo"]["kind"] == "communicator" and rows["resnet"]["kind"] == "model"
    assert rows["digits"]["hooks"] == "subnetdp_register_datasets"


class Misspelled:
    """A plugin whose hook name has a typo: pluggy alone would never call it, silently."""

    @hookimpl
    def subnetdp_register_masker(self, registry):  # the hook is subnetdp_register_maskers
        registry.add("never", CyclicMasker)


def test_a_misspelled_hook_implementation_is_refused_by_name():
    with pytest.raises(SubnetdpError, match=r"implements 'subnetdp_register_masker', which is no subnetdp hook.*"
                                            r"did you mean 'subnetdp_register_maskers'\?"):
        PluginManager(entry_points=False, extra=[Misspelled()])
    PluginManager(entry_points=False, extra=[Recorder()])  # correctly spelled hooks pass the check


def test_a_plugin_config_that_drops_the_shared_keys_is_refused_by_name():
    from dataclasses import dataclass

    @dataclass
    class LoneConfig:  # does not subclass MaskerConfig: coverage, granularity, ... would be missing
        offset: int = 0

    class Lone(CyclicMasker):
        Config = LoneConfig

    class Plugin:
        @hookimpl
        def subnetdp_register_maskers(self, registry):
            registry.add("lone", Lone)

    with pytest.raises(SubnetdpError) as e:
        PluginManager(extra=[Plugin()])
    msg = str(e.value)
    assert "masker 'lone'" in msg and "does not subclass MaskerConfig" in msg
    assert "class Config(MaskerConfig)" in msg

"""Composition and validation: bad input is a ConfigError naming key, value, choices and a fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from subnetdp.train.configure import load_config
from subnetdp.core.errors import ConfigError
from tests.helpers import plugin_manager


def cfg(*overrides: str, recipe: str | None = "resnet18_digits"):
    return load_config(recipe, list(overrides), plugin_manager().registries)


def test_layers_compose_in_order():
    c = cfg("masker.coverage=0.75", "train.steps=7", "optim.warmup_steps=7")
    assert c.masker.coverage == 0.75 and c.train.steps == 7  # command line wins
    assert c.optim.lr == 0.05  # from the recipe, over defaults.yaml's 0.1
    assert c.model.cifar_stem is True and c.model.variant == "resnet18"  # plugin schema mounted
    assert c.data.test_fraction == 0.2  # from configs/data/digits.yaml
    # Selecting another plugin mounts its schema and file instead.
    s = cfg("data.name=synthetic", "data.train_samples=64")
    assert s.data.train_samples == 64 and "test_fraction" not in s.data


@pytest.mark.parametrize("override,key,words", [
    ("masker.name=cylic", "masker.name", ["unknown masker", "available: balanced, cyclic, random", "did you mean 'cyclic'"]),
    ("model.name=resnt", "model.name", ["unknown model", "did you mean 'resnet'"]),
    ("masker.coverage=1.5", "masker.coverage", ["must be in (0.0, 1.0]", "0.5"]),
    ("masker.coverage=0", "masker.coverage", ["must be in (0.0, 1.0]"]),
    ("masker.coverag=0.5", "masker.coverag", ["unknown key", "did you mean 'coverage'"]),
    ("trian.steps=3", "trian", ["unknown top-level key", "did you mean 'train'"]),
    ("train.steps=abc", "train.steps", ["wrong type"]),
    ("optim.name=adamm", "optim.name", ["valid choices: sgd, adamw, adam", "did you mean 'adam"]),
    ("model.variant=resnet19", "model.variant", ["resnet18, resnet34, resnet50"]),
    ("masker.granularity=layer", "masker.granularity", ["valid choices: block"]),
    ("sync.mode=local_step", "sync.mode", ["valid choices: every_step, local_steps", "did you mean 'local_steps'"]),
    ("sync.every=0", "sync.every", ["must be >= 1"]),
    ("sync.outer_momentum=1", "sync.outer_momentum", ["must be in [0, 1)"]),
    ("sync.outer_lr=0", "sync.outer_lr", ["must be > 0"]),
])
def test_bad_values_name_the_key(override, key, words):
    with pytest.raises(ConfigError) as e:
        cfg(override)
    assert e.value.key == key
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("overrides,key,words", [
    (["fsdp.shard_size=2"], "fsdp.shard_size", ["sync.mode=local_steps needs fsdp.shard_size=1", "sync.mode=every_step"]),
    (["masker.resample_every=5"], "masker.resample_every", ["needs masker.resample_every=0"]),
    (["eval.every=10"], "eval.every", ["multiple of sync.every=4", "eval.every=12"]),
    (["sync.warmup_steps=6"], "sync.warmup_steps", ["multiple of sync.every=4", "use sync.warmup_steps=4"]),
    (["train.steps=8", "optim.warmup_steps=0", "eval.every=0", "sync.warmup_steps=12"], "sync.warmup_steps",
     ["at most train.steps=8", "use sync.warmup_steps=8"]),
])
def test_local_steps_refusals_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        cfg("sync.mode=local_steps", "sync.every=4", *overrides)
    assert e.value.key == key
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    cfg("sync.mode=local_steps", "sync.every=4", "eval.every=8", "sync.warmup_steps=8")  # multiples are fine


@pytest.mark.parametrize("override", ["sync.warmup_steps=4", "sync.stop_every_step=true"])
def test_local_steps_keys_without_local_steps_are_refused(override):
    with pytest.raises(ConfigError) as e:
        cfg(override)
    assert e.value.key == override.split("=")[0] and "set sync.mode=local_steps" in str(e.value)

def test_unknown_recipe_suggests_a_close_one():
    with pytest.raises(ConfigError, match="did you mean 'resnet18_digits'"):
        cfg(recipe="resnet18_digit")


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="not of the form key=value"):
        cfg("=3")


def test_cli_prints_one_line_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "subnetdp", "train", "resnet18_digits", "masker.name=cylic",
                           f"run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "masker.name='cylic': unknown masker; available: balanced, cyclic, random — did you mean 'cyclic'?" in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing was started or written
    # An impossible plan fails in the launching process, before any worker starts.
    proc = subprocess.run([sys.executable, "-m", "subnetdp", "train", "resnet18_digits", "launch.nproc=2",
                           "masker.coverage=0.25", "masker.group_by=model", f"run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "leaves 4 unit(s) with fewer than masker.min_owners=1" in proc.stderr
    assert "starting" not in proc.stdout


def test_local_communicator_with_several_workers_fails_before_any_worker_starts():
    from subnetdp.train.setup import preflight
    from tests.helpers import plugin_manager, small_config

    with pytest.raises(ConfigError, match=r"comm\.name='local': runs one process, but 2 were asked for.*launch\.nproc=1"):
        preflight(small_config("comm.name=local"), 2, plugin_manager())
    assert preflight(small_config("comm.name=local", "masker.coverage=1"), 1, plugin_manager()).world_size == 1

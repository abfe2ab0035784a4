"""The config is read once into typed settings, and what a run derives from it is never written back.

A composed config says what the user asked for, before and after set-up: the FLOP-matched step count
and the run name rank 0 makes live on the run context. :class:`~subnetdp.core.config.Settings` holds
the values as the schemas type them, and refuses a value of the wrong type in one line naming the key.
"""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from subnetdp.core.config import Settings, to_yaml
from subnetdp.core.config.schema import TrainConfig
from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import ConfigError
from subnetdp.plugins.maskers.cyclic import CyclicMasker
from subnetdp.train.setup import build_plan, count_flops, match_flops, setup
from tests.helpers import plugin_manager, small_config


def test_setup_writes_nothing_back_into_the_config(tmp_path):
    pm = plugin_manager()
    cfg = small_config("comm.name=local", "train.steps=7", "train.flop_matched=true", "masker.coverage=0.5",
                       run_dir=tmp_path / "runs")
    asked = to_yaml(cfg)
    # The FLOP match of a two-rank plan (a real ratio below 1): the steps it returns, the config untouched.
    data, spec, adapter, full, partition, plan = build_plan(cfg, 2, pm)
    matched = match_flops(cfg, count_flops(cfg, adapter, spec, full, partition, plan, data))
    assert matched is not None and matched["steps_requested"] == 7 and matched["steps"] > 7
    assert to_yaml(cfg) == asked
    # A whole set-up (one rank, so the whole model): no run.name given, rank 0 makes one; it is the
    # context's, not the config's.
    cfg = small_config("comm.name=local", "train.steps=7", "train.flop_matched=true", "masker.coverage=1",
                       run_dir=tmp_path / "runs")
    asked = to_yaml(cfg)
    ctx, _ = setup(cfg, LaunchEnv(0, 1, 0, 1, "test"), pm)
    try:
        assert to_yaml(cfg) == asked and to_yaml(ctx.cfg) == asked
        assert cfg.run.name == "" and ctx.run_name.startswith("resnet18-block-c1-w1-")
        assert ctx.run_dir == tmp_path / "runs" / ctx.run_name and ctx.run_dir.is_dir()
        # The whole model: the matched count is the count asked for, read from the context.
        assert ctx.steps == ctx.flop_match["steps"] == 7 and ctx.settings.train.steps == 7
        assert ctx.settings == Settings.from_config(cfg)
        # A context copied with another config reads that config's settings: the two never disagree.
        other = OmegaConf.merge(ctx.cfg, {"eval": {"block_union": "x1"}})
        assert dataclasses.replace(ctx, cfg=other).settings.eval.block_union == "x1" != ctx.settings.eval.block_union
    finally:
        ctx.comm.shutdown()
        if ctx.lock is not None:
            ctx.lock.release()


def test_settings_hold_the_schemas_types_and_leave_the_config_as_it_is():
    cfg = small_config("optim.lr=1", "masker.coverage=1", "train.steps=3")
    asked = to_yaml(cfg)
    s = Settings.from_config(cfg, plugin_manager().registries)
    assert to_yaml(cfg) == asked
    assert isinstance(s.train, TrainConfig) and s.train.steps == 3
    assert type(s.optim.lr) is float and s.optim.lr == 1.0 and type(s.masker.coverage) is float
    assert type(s.masker) is CyclicMasker.Config and s.data.name == "digits"
    # The same settings from the config written as plain data (a stored config.yaml) as from the composed one.
    plain = OmegaConf.create(to_yaml(cfg))
    assert Settings.from_config(plain, plugin_manager().registries) == s
    with pytest.raises(AttributeError):
        s.train = TrainConfig()  # type: ignore[misc]


@pytest.mark.parametrize("key, value, says, fix", [
    ("train.steps", "ten", "wrong type (the config): Value 'ten' of type 'str' could not be converted to Integer",
     "python -m subnetdp.core.config"),
    ("masker.coverage", "half", "could not be converted to Float", "python -m subnetdp.core.config"),
    ("checkpoint.enabled", "sometimes", "takes true or false", "write checkpoint.enabled=true"),
])
def test_a_wrongly_typed_value_is_refused_in_one_line_naming_the_key(key, value, says, fix):
    plain = OmegaConf.create(to_yaml(small_config()))
    OmegaConf.update(plain, key, value)
    with pytest.raises(ConfigError) as e:
        Settings.from_config(plain, plugin_manager().registries)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{key}={value!r}: ") and says in line
    assert line.split(" — ", 1)[1].count(fix) == 1  # and the fix, after the problem

"""Config keys of the variants, and `subnetdp plan` without a dry run."""

from __future__ import annotations

import json

import pytest

from subnetdp import cli
from subnetdp.core.errors import ConfigError
from subnetdp.sdp.variants import rescale_enabled
from tests.helpers import small_config


@pytest.mark.parametrize("override,key,words", [
    ("masker.regime=sideways", "masker.regime", ["valid choices: forward, backward"]),
    ("masker.granularity=layer", "masker.granularity", ["valid choices: block, neuron"]),
    ("masker.units_per_layer=0", "masker.units_per_layer", ["must be >= 1", "default is 8"]),
    ("masker.refresh_every=0", "masker.refresh_every", ["must be >= 1"]),
    ("masker.resample_every=-1", "masker.resample_every", ["must be >= 0", "0 keeps the plan fixed"]),
    ("masker.name=balanc", "masker.name", ["did you mean 'balanced'"]),
])
def test_bad_variant_keys_name_the_key(override, key, words):
    with pytest.raises(ConfigError) as e:
        small_config(override)
    assert e.value.key == key
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_rescale_defaults_by_granularity():
    assert rescale_enabled(small_config("masker.granularity=neuron").masker) is True
    assert rescale_enabled(small_config("masker.granularity=block").masker) is False
    assert rescale_enabled(small_config("masker.granularity=neuron", "masker.rescale=false").masker) is False
    cfg = small_config("masker.granularity=neuron", "masker.regime=backward", "masker.name=random")
    assert cfg.masker.units_per_layer == 8 and cfg.masker.refresh_every == 1 and cfg.masker.resample_every == 0


def test_plan_command_prints_table_json_and_png(tmp_path, capsys):
    png = tmp_path / "plan.png"
    args = ["plan", "resnet18_digits", "masker.name=balanced", "masker.coverage=0.5", "-n", "4", "--no-estimate"]
    assert cli.main(args + ["--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "rank   3 " in text and "spectral gap" in text and "owner counts: min 2, max 2" in text
    assert png.stat().st_size > 1000
    assert cli.main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 4 and len(report["ranks"]) == 4
    assert [len(u["owners"]) for u in report["units"]] == [2] * 8
    costs = report["cost_per_rank"]
    assert max(costs) - min(costs) <= max(u["cost"] for u in report["units"])
    # Many owner sets beyond sync.max_groups switch the plan to dense synchronisation.
    assert cli.main(["plan", "masker.name=random", "masker.granularity=neuron", "sync.max_groups=2",
                     "-n", "4", "--no-estimate"]) == 0
    assert "(dense sync, sync.max_groups=2)" in capsys.readouterr().out


def test_plan_command_with_clipping_and_fsdp(capsys, tmp_path):
    # Options may follow overrides; the LLaMA recipe clips gradients, which the dry run must survive.
    # The token cache goes to tmp_path: the suite writes nothing into the checkout.
    assert cli.main(["plan", "llama_tiny_stdlib", "-n", "2", "masker.coverage=0.5", "train.batch_size=2",
                     "data.seq_len=32", "data.stdlib_max_mb=0.5", f"data.cache_dir={tmp_path}/data", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["coverage"] == 0.5 and all(r["peak_memory_bytes"] > 0 for r in report["ranks"])
    # With FSDP the plan is the replicas' plan repeated per shard, and each rank's step is a dry run of
    # the real FSDP2 over torch's fake process group: the rank holds half of its replica's parameters.
    args = ["plan", "llama_tiny_stdlib", "-n", "4", "data.stdlib_max_mb=0.5", "train.batch_size=2", "data.seq_len=32",
            f"data.cache_dir={tmp_path}/data"]
    assert cli.main(args + ["fsdp.shard_size=2"]) == 0
    assert "fsdp.shard_size=2: ranks r*S..r*S+S-1 form replica r" in capsys.readouterr().out
    assert cli.main(args + ["fsdp.shard_size=2", "--json"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert sharded["owned"][0] == sharded["owned"][1] and sharded["owned"][2] == sharded["owned"][3]
    for s, p in zip(sharded["ranks"], plain["ranks"]):  # every rank holds 2 of the 4 blocks in both plans
        assert abs(s["params_held"] / p["params_held"] - 0.5) < 0.01, (s["params_held"], p["params_held"])
        assert 0 < s["peak_memory_bytes"] < p["peak_memory_bytes"] and s["fsdp_bytes_per_step"]["reduce_scatter"] > 0


def test_the_regime_is_one_object_that_answers_what_each_site_asks():
    from omegaconf import OmegaConf

    from subnetdp.sdp.variants import regime_of

    forward, backward = (regime_of(OmegaConf.create({"regime": r})) for r in ("forward", "backward"))
    assert regime_of(OmegaConf.create({"regime": "forward"})) is forward  # looked up, never rebuilt per site
    assert (forward.full_model, forward.drops_branches, forward.refreshes) == (False, True, False)
    assert (backward.full_model, backward.drops_branches, backward.refreshes) == (True, False, True)
    with pytest.raises(ConfigError) as e:
        regime_of(OmegaConf.create({"regime": "backwards"}))
    line = str(e.value)
    assert line.splitlines() == [line] and line.startswith("masker.regime='backwards': unknown masking regime")
    assert "forward, backward" in line and "did you mean 'backward'" in line

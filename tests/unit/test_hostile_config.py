"""Values the schema's types let through, refused up front: one line naming the key, exit code 2."""

from __future__ import annotations

import pytest

from subnetdp import cli
from subnetdp.train.configure import load_config
from subnetdp.core.errors import ConfigError
from subnetdp.train.loop import preflight
from tests.helpers import plugin_manager

CASES = {  # override -> the key its message must start with
    "masker.coverage=.nan": "masker.coverage", "optim.momentum=.nan": "optim.momentum", "optim.lr=.nan": "optim.lr",
    "sync.bucket_cap_mb=.inf": "sync.bucket_cap_mb", "comm.timeout_s=.nan": "comm.timeout_s",
    "optim.momentum=-1": "optim.momentum", "optim.weight_decay=-1": "optim.weight_decay", "optim.eps=-1": "optim.eps",
    "optim.betas=[0.9]": "optim.betas", "optim.betas=[2.0,0.999]": "optim.betas",
    "optim.warmup_steps=-5": "optim.warmup_steps", "optim.clip_grad_norm=-1": "optim.clip_grad_norm",
    "comm.timeout_s=0": "comm.timeout_s", "eval.batch_size=0": "eval.batch_size", "eval.batch_size=-4": "eval.batch_size",
    "eval.batches=-1": "eval.batches", "eval.bn_recalibrate_batches=100000": "eval.bn_recalibrate_batches",
    "seed=99999999999999999999999": "seed", "data.split_seed=99999999999999999999999": "data.split_seed",
    "data.image_size=1000000000": "data.image_size", "run.name=" + "x" * 300: "run.name",
    "model=[1,2]": "model", "train=5": "train", ".seed=1": ".seed", "masker=null": "masker",
    "data.name=tokens": "data.name", "comm.init_method=bogus://x": "comm.init_method",
    "comm.init_method=tcp://host": "comm.init_method", "resume=": "resume", "resume=/etc": "resume",
}


@pytest.mark.parametrize("override", list(CASES))
def test_bad_value_is_one_line_naming_its_key(override):
    pm = plugin_manager()
    with pytest.raises(ConfigError) as e:
        preflight(load_config("resnet18_digits", [override], pm.registries), 2, pm)
    msg = str(e.value)
    assert msg.startswith(CASES[override] + "=") and "\n" not in msg, msg


def test_recipe_group_given_a_list(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  name: resnet\nmasker: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"^masker=.*a list"):
        load_config(str(recipe), [], plugin_manager().registries)


def test_threads_above_the_cores_warn():
    with pytest.warns(UserWarning, match="launch.threads_per_rank"):
        load_config("resnet18_digits", ["launch.threads_per_rank=100000"], plugin_manager().registries)


@pytest.mark.parametrize("argv, key", [(["plan", "resnet18_digits", "-n", "0", "--no-estimate"], "--world-size=0"),
                                       (["launch", "--nproc", "0", "--dry-run", "resnet18_digits"], "--nproc=0"),
                                       (["launch", "--nproc", "-3", "--dry-run", "resnet18_digits"], "--nproc=-3")])
def test_world_sizes_below_one_are_refused(argv, key, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"subnetdp: error: {key}:") and err.count("\n") == 1, err


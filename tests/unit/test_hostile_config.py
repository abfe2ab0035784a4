"""Values the schema's types let through, refused up front: one line naming the key, exit code 2."""

from __future__ import annotations

import os

import pytest

from subnetdp import cli
from subnetdp.train.configure import load_config
from subnetdp.core.errors import ConfigError
from subnetdp.train.setup import preflight
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
    # plugin selectors are names, never interpolations (resolved against a config not built yet)
    "model.name=${nope}": "model.name", "masker.name=${oc.env:NOPE_X}": "masker.name",
    "comm.name=${train.steps}": "comm.name",
    "optim.lr=1" + "0" * 400: "optim.lr", "optim.lr=1e308": "optim.lr", "optim.lr=1e39": "optim.lr",
    # a bool key takes true or false: OmegaConf would turn these into true
    "masker.rescale=2": "masker.rescale", "eval.breakdown=7": "eval.breakdown",
    "sync.outer_on_host=2": "sync.outer_on_host", "model.cifar_stem=0x10": "model.cifar_stem",
    "train.progress=2": "train.progress",
    # the digits resized to 4096 pixels need hundreds of GiB: refused, not the allocator's traceback
    "data.image_size=4096": "data.image_size",
}

GROUP_AND_KEY = {  # a group given a value and one of its keys: the value would be dropped, or fail in the merge
    ("train=[1,2]", "train.grad_accum=2"): "train", ("optim=[1]", "optim.lr=0.1"): "optim",
    ("masker=5", "masker.coverage=0.5"): "masker",
}


@pytest.mark.parametrize("overrides", list(GROUP_AND_KEY), ids=lambda o: " ".join(o))
def test_a_group_given_a_value_and_a_key_is_one_line(overrides):
    with pytest.raises(ConfigError) as e:
        load_config("resnet18_digits", list(overrides), plugin_manager().registries)
    msg = str(e.value)
    assert msg.startswith(GROUP_AND_KEY[overrides] + "=") and "sub-key" in msg and "\n" not in msg, msg


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
    above = (os.cpu_count() or 1) + 1  # more than the cores, within launch.threads_per_rank's range
    with pytest.warns(UserWarning, match="launch.threads_per_rank"):
        load_config("resnet18_digits", [f"launch.threads_per_rank={above}"], plugin_manager().registries)


@pytest.mark.parametrize("argv, key", [(["plan", "resnet18_digits", "-n", "0", "--no-estimate"], "--world-size=0"),
                                       (["launch", "--nproc", "0", "--dry-run", "resnet18_digits"], "--nproc=0"),
                                       (["launch", "--nproc", "-3", "--dry-run", "resnet18_digits"], "--nproc=-3")])
def test_world_sizes_below_one_are_refused(argv, key, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"subnetdp: error: {key}:") and err.count("\n") == 1, err


CONTRADICTIONS = {  # overrides -> the one line that refuses them (each was accepted before)
    ("checkpoint.enabled=false", "checkpoint.final=always"):
        "checkpoint.final='always': asks for a final checkpoint, but checkpoint.enabled=false writes none — "
        "set checkpoint.enabled=true, or checkpoint.final=auto",
    ("checkpoint.enabled=false", "resume=auto", "run.name=x"):
        "resume='auto': finds the run's newest checkpoint, but checkpoint.enabled=false writes none, so every "
        "restart would start over — set checkpoint.enabled=true, or resume=never",
    ("optim.warmup_steps=300",):  # the recipe's train.steps is 200
        "optim.warmup_steps=300: must be in [0, train.steps=200]: a longer warm-up never reaches optim.lr — "
        "use optim.warmup_steps=200 or less (0 starts at the full learning rate), or train.steps=300 or more",
    ("optim.lr=0",): "optim.lr=0.0: must be > 0.0 — use e.g. 0.1 for SGD or 1e-3 for AdamW",
    ("optim.weight_decay=1e20",):
        "optim.weight_decay=1e+20: must be in [0.0, 1.0] — 0 turns weight decay off; 5e-4 (SGD) or 0.1 (AdamW) is usual",
    ("eval.task_limit=-1",): "eval.task_limit=-1.0: must be >= 0.0 — 0 evaluates every document",
    ("eval.num_fewshot=-1",): "eval.num_fewshot=-1: must be >= 0 — 0 asks for none; leave it empty for each task's own",
    ("train.memory_step=-1",): "train.memory_step=-1: must be >= 1 — 2 is the default (the first step warms up)",
    ("comm.timeout_s=0.001",): "comm.timeout_s=0.001: must be in [1.0, 604800.0] — 600 is the default",
    ("comm.timeout_s=1e308",): "comm.timeout_s=1e+308: must be in [1.0, 604800.0] — 600 is the default",
    ("launch.threads_per_rank=100000",):
        "launch.threads_per_rank=100000: must be in [0, 1024] — 0 shares the cores evenly among the local ranks",
    ("run.name=x", "run.overwrite=true", "resume=auto"):
        "run.overwrite=True: would delete the run that resume=auto continues from — drop run.overwrite to continue "
        "the run, or resume=never to start it again",
    ('run.name="exp\\n1"',):  # YAML's double quotes: a real newline inside the name
        "run.name='exp\\n1': holds the control character U+000A; a run name is one line of printable characters "
        "— use a plain folder name such as run.name=exp1 (put the parent folder in run.dir)",
}


@pytest.mark.parametrize("overrides", list(CONTRADICTIONS), ids=lambda o: " ".join(o))
def test_contradictions_and_values_out_of_range_are_refused_in_one_line(overrides):
    with pytest.raises(ConfigError) as e:
        load_config("resnet18_digits", list(overrides), plugin_manager().registries)
    assert str(e.value) == CONTRADICTIONS[overrides]


IGNORED = {  # a shared key the selected plugin does not read, set anyway -> its one line (each was accepted before)
    ("data.root=/nowhere",):
        "data.root='/nowhere': data.name=digits does not use it (its images ship with scikit-learn) — leave it at "
        "its default '' (~data.root drops a recipe's value); it is read by data.name=cifar10, cifar100, imagenet, tokens",
    ("data.name=synthetic", "data.root=data"):
        "data.root='data': data.name=synthetic does not use it (it makes its images from the seed; nothing is read "
        "from disk) — leave it at its default '' (~data.root drops a recipe's value); it is read by data.name=cifar10, "
        "cifar100, imagenet, tokens",
    ("comm.name=local", "comm.timeout_s=5"):
        "comm.timeout_s=5.0: comm.name=local does not use it (it runs one process: no collective ever waits) — leave "
        "it at its default 600.0 (~comm.timeout_s drops a recipe's value); it is read by comm.name=gloo, nccl",
    ("masker.name=balanced", "masker.capacity=[0.5,1.0]"):
        "masker.capacity=[0.5, 1.0]: masker.name=balanced does not use it (it sets owner counts from the units' "
        "costs, not per-rank coverages) — leave it at its default [] (~masker.capacity drops a recipe's value); it is "
        "read by masker.name=cyclic, random",
}


@pytest.mark.parametrize("overrides", list(IGNORED), ids=lambda o: " ".join(o))
def test_a_key_the_selected_plugin_ignores_cannot_be_set(overrides):
    with pytest.raises(ConfigError) as e:
        load_config("resnet18_digits", list(overrides), plugin_manager().registries)
    assert str(e.value) == IGNORED[overrides]
    load_config("resnet18_digits", list(overrides[:-1]), plugin_manager().registries)  # at its default, it is fine


def test_a_file_rendezvous_that_exists_already_is_refused_before_any_worker(tmp_path):
    """A FileStore file left by a killed run would make every rank wait comm.timeout_s for peers."""
    pm = plugin_manager()
    store = tmp_path / "store"
    cfg = load_config("resnet18_digits", [f"comm.init_method=file://{store}"], pm.registries)
    preflight(cfg, 2, pm)  # a file that does not exist yet is what a rendezvous wants
    store.write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError) as e:
        preflight(cfg, 2, pm)  # what the launcher runs before it starts any worker
    msg = str(e.value)
    assert msg.startswith(f"comm.init_method='file://{store}': ") and "already exists" in msg, msg
    assert f"delete {store}" in msg and "\n" not in msg

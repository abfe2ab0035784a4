"""The checks of a composed config: declared ranges and choices, finite numbers that fit, the run
name, what the selected plugins accept, data the model trains on (:func:`validate`)."""

from __future__ import annotations

import dataclasses
import math
import os
import unicodedata
from typing import Any, Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf

from subnetdp.core.config.schema import _SECTIONS, PLUGIN_GROUPS, RunConfig
from subnetdp.core.errors import ConfigError
from subnetdp.core.fields import check_declared


def _shown(layer: DictConfig, key: Any) -> Any:
    """A value for an error message, containers as plain dicts and lists."""
    node = layer._get_node(key)
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=False)
    return node._value() if node is not None else None



def _check_declared(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """Every range and choice that a field declares with it: the run's sections and each selected
    plugin's ``Config`` (whose shared fields come from the group's base schema)."""
    check_declared(cfg, RunConfig, "", _SECTIONS)
    for group in PLUGIN_GROUPS:
        schema = registries[group].get(cfg[group].name).Config
        if dataclasses.is_dataclass(schema):
            check_declared(cfg[group], schema, f"{group}.")


def validate(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """What the contracts say of a composed config: declared ranges and choices, finite numbers, a
    run name that is one folder, what the model adapter implements, each selected plugin's own
    ``validate_config``, and data the model can train on.

    Each subsystem's rules across keys (FSDP, local steps, checkpoints and resume, rendezvous,
    downstream tasks, the optimizer's) live beside that subsystem; ``subnetdp.train.configure``
    runs them after this.
    """
    _check_declared(cfg, registries)
    check_numbers(cfg)
    _check_run_name(cfg)
    adapter = registries["model"].get(cfg.model.name)
    _check_regularizers(cfg, adapter)
    if cfg.masker.granularity not in adapter.granularities:
        raise ConfigError("masker.granularity", cfg.masker.granularity,
                          f"model '{cfg.model.name}' supports: {', '.join(adapter.granularities)}")
    for group in PLUGIN_GROUPS:
        registries[group].get(cfg[group].name).validate_config(cfg[group], cfg)
    check_data_fits_model(cfg, registries)
    # After the checks of the choices themselves: a wrong data.name is the error, not the keys it ignores.
    check_ignored(cfg, registries)
    check_image_size(cfg)
    warn_threads(cfg)


def check_ignored(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """A shared key that the selected plugin does not read (its ``ignores``) keeps its default: a value
    set there would otherwise be accepted and do nothing (``data.root`` for ``digits``)."""
    for group in PLUGIN_GROUPS:
        name, registry = str(cfg[group].name), registries[group]
        cls = registry.get(name)
        if not cls.ignores:
            continue
        defaults = OmegaConf.structured(cls.Config)
        for key, why in cls.ignores.items():
            if key not in cfg[group]:
                continue
            value, default = _shown(cfg[group], key), _shown(defaults, key)
            if value == default:
                continue
            users = [n for n in registry.names() if key not in registry.get(n).ignores]
            raise ConfigError(f"{group}.{key}", value, f"{group}.name={name} does not use it ({why})",
                              f"leave it at its default {default!r} (~{group}.{key} drops a recipe's value)"
                              + (f"; it is read by {group}.name={', '.join(users)}" if users else ""))


def _check_regularizers(cfg: DictConfig, adapter: Any) -> None:
    """``model.stochastic_depth`` / ``model.hidden_dropout`` (ranges declared in ``ModelConfig``): set
    only where the model adapter implements them."""
    for key in ("stochastic_depth", "hidden_dropout"):
        value = OmegaConf.select(cfg, f"model.{key}", default=0.0) or 0.0
        if value and key not in adapter.regularizers:
            raise ConfigError(f"model.{key}", value, f"model '{cfg.model.name}' does not implement it",
                              f"set model.{key}=0")


NAME_MAX = 255  # bytes in one file name on Linux, macOS and Windows file systems


def _check_run_name(cfg: DictConfig) -> None:
    """``run.name`` is one folder inside ``run.dir``: no separators, no ``..``, not absolute, not too
    long, and no control characters (a newline would split every log line and shell command naming it)."""
    name = cfg.run.name
    if not name:
        return
    fix = "use a plain folder name such as run.name=exp1 (put the parent folder in run.dir)"
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        raise ConfigError("run.name", name, f"would put the run outside run.dir={cfg.run.dir}", fix)
    control = next((c for c in name if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        raise ConfigError("run.name", name[:80] + ("..." if len(name) > 80 else ""),
                          f"holds the control character U+{ord(control):04X}; a run name is one line of "
                          "printable characters", fix)
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise ConfigError("run.name", name[:40] + "...", f"is {len(name.encode('utf-8', 'surrogateescape'))} "
                          f"bytes long; a file name may have at most {NAME_MAX}", "use a shorter name")


def check_world(cfg: DictConfig, world_size: int) -> int:
    """The number of replicas R = W / S, or a ConfigError when ``fsdp.shard_size`` does not divide W."""
    size = cfg.fsdp.shard_size
    if world_size % size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError("fsdp.shard_size", size, f"must divide the world size {world_size} "
                          f"(world = replicas x shard_size)", f"use one of {divisors}, or change the number of ranks")
    return world_size // size


# --------------------------------------------------------------------------- values no schema type catches

INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38


def leaves(node: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a plain container (lists as ``key[i]``)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from leaves(v, f"{prefix.rstrip('.')}[{i}].")
    else:
        yield prefix.rstrip("."), node


def check_numbers(cfg: DictConfig) -> None:
    """No NaN or infinity anywhere, and no integer beyond 64 bits (torch, numpy and C take int64)."""
    for key, value in leaves(OmegaConf.to_container(cfg, resolve=True)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, value, "must be a finite number", "give a plain number such as 0.5")
        if isinstance(value, float) and abs(value) > FLOAT32_MAX:
            # Python keeps 1e308, but the training tensors are float32: optim.lr=1e308 is inf at step 1.
            raise ConfigError(key, value, f"is beyond float32's range (at most {FLOAT32_MAX:.3g}), which the "
                              "training tensors use", "give a number of ordinary size such as 0.1")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            raise ConfigError(key, value, f"does not fit in 64 bits (at most {INT64_MAX})", "use a smaller integer")


def check_data_fits_model(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """The data module yields the kind of data the model trains on (``data_kind``: image, tokens)."""
    model, data = registries["model"].get(cfg.model.name), registries["data"].get(cfg.data.name)
    consumes, produces = model.data_kind, data.data_kind
    if consumes != produces:
        fitting = [n for n in registries["data"].names() if registries["data"].get(n).data_kind == consumes]
        raise ConfigError("data.name", cfg.data.name, f"yields {produces} data, but model.name={cfg.model.name} "
                          f"trains on {consumes} data", f"use {consumes} data" + (f": {', '.join(fitting)}" if fitting else ""))


MAX_IMAGE_SIDE = 4096  # the FLOP count runs a real sample: far above 4096 it cannot allocate (or takes hours)


def check_image_size(cfg: DictConfig) -> None:
    """``data.image_size`` small enough that one sample (the FLOP measurement's) can be allocated."""
    size = OmegaConf.select(cfg, "data.image_size", default=0) or 0
    if isinstance(size, int) and size > MAX_IMAGE_SIDE:
        gib = 3 * 4 * size * size / 2**30
        raise ConfigError("data.image_size", size, f"one image is {gib:,.0f} GiB at this size (at most "
                          f"{MAX_IMAGE_SIDE} is accepted)", "use the model's native size, e.g. 32 or 224")


def warn_threads(cfg: DictConfig) -> None:
    """More threads per rank than cores for all local ranks: warn (it runs, slowly).

    The local ranks are ``launch.nproc``, or under a launcher the node's own (``LOCAL_WORLD_SIZE``, set by
    torchrun per node): on a node of a multi-node job the recipe's ``launch.nproc`` says nothing.
    """
    import warnings

    threads, cores = cfg.launch.threads_per_rank, os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks, what = (int(local), "local ranks") if local.isdigit() else (cfg.launch.nproc, "launch.nproc")
    if threads * max(1, ranks) > cores:
        warnings.warn(f"launch.threads_per_rank={threads} x {what}={ranks} is more threads than "
                      f"the {cores} cores: ranks will slow each other down; 0 shares the cores evenly", stacklevel=2)

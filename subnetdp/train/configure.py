"""The run's config, loaded and checked whole: composition, then every subsystem's own rules.

:func:`subnetdp.core.config.compose` builds the config and checks what the contracts say of it (types,
unknown keys, each field's declared range and choices, finite numbers, the run name, each plugin's
``validate_config``, data the model can train on). Rules across keys belong to the subsystem they
protect and live beside it, as a ``check_config``; :func:`check_config` here runs them all, in one
fixed order, so every command (``train``, ``plan``, ``launch``, ``eval``, ``export``) and every test
gets the same checks from :func:`load_config`. None of them creates a process group or touches a
device.
"""

from __future__ import annotations

from typing import Any, Sequence

from omegaconf import DictConfig

from subnetdp.core import config as core_config
from subnetdp.launchers import init_method, nodes
from subnetdp.parallel import fsdp
from subnetdp.sdp import local_steps
from subnetdp.train import downstream, optim, upfront
from subnetdp.train.checkpoints import checkpointer


def check_config(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """Each subsystem's rules across keys; raises the first :class:`~subnetdp.core.errors.ConfigError`."""
    optim.check_config(cfg)
    init_method.check_config(cfg)
    nodes.check_config(cfg)
    checkpointer.check_config(cfg)
    fsdp.check_config(cfg, registries)
    local_steps.check_config(cfg)
    downstream.check_config(cfg, registries)
    upfront.check_config(cfg, registries)


def validate(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """All of a composed config's checks again, e.g. after overrides applied in code (the budget search)."""
    core_config.validate(cfg, registries)
    check_config(cfg, registries)


def load_config(recipe: str | None = None, overrides: Sequence[str] = (),
                registries: dict[str, Any] | None = None) -> DictConfig:
    """The resolved run config, with every check passed.

    Args:
        recipe: a recipe file or built-in recipe name, or None.
        overrides: ``key=value`` strings (and ``~key`` deletions), applied last.
        registries: kind -> :class:`~subnetdp.core.plugins.Registry`; built from entry points if None.
    """
    if registries is None:
        from subnetdp.core.plugins import PluginManager

        registries = PluginManager().registries
    cfg = core_config.compose(recipe, overrides, registries)
    check_config(cfg, registries)
    return cfg

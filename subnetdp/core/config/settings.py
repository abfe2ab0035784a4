"""The composed config read once into typed settings: :class:`Settings`.

Composition (:func:`~subnetdp.core.config.composition.compose`) checks every value against the
structured schemas; :meth:`Settings.from_config` then turns the result into those same dataclasses
(``OmegaConf.to_object``), so code reads ``settings.train.batch_size`` as the ``int`` the schema
declares, without a cast at each use. It reads the config and never writes it: what a run derives
from its config (the FLOP-matched step count, the run's resolved name and directory) lives on the
:class:`~subnetdp.core.contracts.RunContext`, and the config a run stores says what its user asked for.

Plugins still receive their config section as OmegaConf gives it (``cfg.masker``, typed by the
plugin's ``Config``); the settings hold the same section as that ``Config`` dataclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from subnetdp.core.config.composition import _merge
from subnetdp.core.config.schema import (PLUGIN_GROUPS, SHARED_PLUGIN_SCHEMAS, CheckpointConfig, EvalConfig,
                                         FSDPConfig, LaunchConfig, OptimConfig, RecoveryConfig, RunConfig,
                                         RunDirConfig, SyncConfig, TrainConfig)
from subnetdp.core.contracts import CommConfig, DataConfig, MaskerConfig, ModelConfig
from subnetdp.core.errors import ConfigError


@dataclass(frozen=True)
class Settings:
    """The run's config as typed values, read once: one schema dataclass per section.

    The fields are those of :class:`~subnetdp.core.config.schema.RunConfig` plus the four plugin
    sections, each an instance of the selected plugin's ``Config`` (a subclass of the shared schema
    named here). No field can be reassigned; nothing in the project writes into a section either
    (the sections are plain dataclasses, as ``OmegaConf.to_object`` makes them).
    """

    seed: int
    sync: SyncConfig
    optim: OptimConfig
    train: TrainConfig
    eval: EvalConfig
    launch: LaunchConfig
    run: RunDirConfig
    checkpoint: CheckpointConfig
    fsdp: FSDPConfig
    recovery: RecoveryConfig
    resume: str
    model: ModelConfig
    masker: MaskerConfig
    comm: CommConfig
    data: DataConfig

    @classmethod
    def from_config(cls, cfg: DictConfig, registries: dict[str, Any] | None = None) -> "Settings":
        """Typed settings from a config, which is left as it is.

        A composed config (:func:`~subnetdp.train.configure.load_config`) is already typed and only
        converted. A config built another way (``OmegaConf.create``, a file) is first checked against
        the schemas: a value of the wrong type is a :class:`~subnetdp.core.errors.ConfigError` naming
        its key, and a missing key takes the schema's default. ``registries`` find the selected
        plugins' ``Config`` for such a config (built from entry points when None and needed).
        """
        if is_composed(cfg):  # every value already checked against its schema: convert only
            whole = OmegaConf.to_object(cfg)  # the plugin sections become attributes of the RunConfig
            return cls(**{f.name: getattr(whole, f.name) for f in dataclasses.fields(cls)})
        core = OmegaConf.to_object(_checked(OmegaConf.structured(RunConfig),
                                            OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k not in PLUGIN_GROUPS])))
        values = {f.name: getattr(core, f.name) for f in dataclasses.fields(RunConfig)}
        for group in PLUGIN_GROUPS:
            section = cfg.get(group)
            if not isinstance(section, DictConfig):
                raise ConfigError(group, section, "is not a group of keys", f"set {group}.name=NAME")
            schema = _plugin_schema(group, section, registries)
            values[group] = OmegaConf.to_object(_checked(OmegaConf.structured(schema), section, f"{group}."))
        return cls(**values)


def _checked(schema: DictConfig, values: DictConfig, prefix: str = "") -> DictConfig:
    """``values`` on their schema: a wrong type or an unknown key is one line that names the key and the fix."""
    try:
        return _merge(schema, values, "the config", prefix)
    except ConfigError as e:
        if e.fix:
            raise
        raise ConfigError(e.key, e.value, e.problem, f"give {e.key} a value of the type the key table declares "
                          "(python -m subnetdp.core.config), or leave it out for its default") from None


def is_composed(cfg: DictConfig) -> bool:
    """Whether ``cfg`` is typed by the schemas throughout (as composition builds it)."""
    if OmegaConf.get_type(cfg) is not RunConfig:
        return False
    for group in PLUGIN_GROUPS:
        section = cfg.get(group)
        schema = OmegaConf.get_type(section) if isinstance(section, DictConfig) else None
        if not (isinstance(schema, type) and issubclass(schema, SHARED_PLUGIN_SCHEMAS[group])):
            return False
    return True


def _plugin_schema(group: str, section: DictConfig, registries: dict[str, Any] | None) -> type:
    """The selected plugin's ``Config``; an unknown name is the registry's error (with close names)."""
    if registries is None:
        from subnetdp.core.plugins import PluginManager

        registries = PluginManager().registries
    return registries[group].get(str(section.get("name")), f"{group}.name").Config

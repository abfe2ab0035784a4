"""A config stored with a checkpoint (its ``config.yaml``), read back as data.

A run writes its config resolved (:func:`subnetdp.core.config.to_yaml`), so a stored config holds
values only. Reading one back, nothing in it is evaluated: :func:`load_stored` loads it without
resolving and refuses any interpolation (``${key}``, ``${oc.env:VAR}``), which an honest checkpoint
never holds and which would otherwise read the evaluating machine's environment or other keys.

Nor does a stored config choose where anything is written: :func:`invocation_keys` lists the keys
whose schema field is declared with ``doc(..., writes=True)`` (``run.dir``, ``data.cache_dir``,
``data.download``, and any plugin's own), and :func:`drop_keys` removes them, so the invocation
that reads the checkpoint supplies them (the default, resolved against its working directory, or
what its user gives on the command line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from subnetdp.core.config import PLUGIN_GROUPS, RunConfig, leaves
from subnetdp.core.contracts import writing_keys
from subnetdp.core.errors import CheckpointError, SubnetdpError
from subnetdp.core.records import shown


def load_stored(path: Path) -> DictConfig:
    """The config stored at ``path``, unresolved; a CheckpointError if it is not a mapping of values."""
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # a YAML syntax error: named in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable config ({first})") from None
    if not isinstance(cfg, DictConfig):
        raise CheckpointError(f"{path}: holds {shown(OmegaConf.to_container(cfg))}, not a mapping of config keys")
    # escaped or not: a stored config has no use for an interpolation
    for key, text in ((k, v) for k, v in leaves(OmegaConf.to_container(cfg, resolve=False))
                      if isinstance(v, str) and "${" in v):
        raise CheckpointError(f"{path}: {key} holds the interpolation {shown(text)}: a stored config is data and "
                              "is never resolved (a run writes its config resolved, so this one was edited) — "
                              "write the value itself there, or evaluate a checkpoint the run wrote")
    return cfg


def invocation_keys(cfg: DictConfig, registries: dict[str, Any]) -> list[str]:
    """The keys of ``cfg`` that choose where files are written (declared ``writes`` in their schema)."""
    keys = writing_keys(RunConfig)
    for group in PLUGIN_GROUPS:
        section = cfg.get(group)
        name = section.get("name") if isinstance(section, DictConfig) else None
        try:
            cls = registries[group].get(str(name))
        except SubnetdpError:  # an unknown plugin: composing the config names it
            continue
        keys += writing_keys(cls.Config, f"{group}.")
    return keys


def drop_keys(cfg: DictConfig, keys: list[str]) -> None:
    """Remove ``keys`` (dotted) from ``cfg`` where present, so composition fills them afresh."""
    for key in keys:
        parent_key, _, last = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key, default=None) if parent_key else cfg
        if isinstance(parent, DictConfig) and last in parent:
            del parent[last]

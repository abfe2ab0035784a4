"""The config keys as documentation: every key with its type, default and doc, and the README's table
(``python -m subnetdp.core.config``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from subnetdp.core.config.composition import config_root
from subnetdp.core.config.schema import _SECTIONS, SHARED_PLUGIN_SCHEMAS, RunConfig
from subnetdp.core.fields import Bounds, declared


def documented_keys() -> list[tuple[str, str, str, str]]:
    """Every key of the run schema and of the plugin groups' shared schemas: (key, type, default, doc).

    A field without a ``doc`` has an empty doc (the config-doc test refuses it).
    """
    def walk(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
        rows = []
        for f in dataclasses.fields(cls):
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            if dataclasses.is_dataclass(kind) or kind in _SECTIONS:
                rows += walk(_SECTIONS[kind], f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if f.name == "name" and prefix[:-1] in SHARED_PLUGIN_SCHEMAS:
                default = OmegaConf.load(config_root() / "defaults.yaml")[prefix[:-1]]["name"]  # the selection
            rows.append((prefix + f.name, kind.replace("Optional[bool]", "bool or empty"),
                         "" if default is None else json.dumps(default), f.metadata.get("doc", "")))
        return rows

    rows = walk(RunConfig, "")
    for group, cls in SHARED_PLUGIN_SCHEMAS.items():
        rows += walk(cls, f"{group}.")
    return sorted(rows, key=lambda r: (r[0].count(".") > 0, r[0]))


def declared_keys(cfg: DictConfig | None = None, registries: dict[str, Any] | None = None) -> dict[str, Bounds]:
    """Every key that declares a range or choices, with them: the run schema's, and for each plugin
    group the selected plugin's ``Config`` (given a composed ``cfg`` and the registries) or else the
    group's shared schema."""
    found = dict(declared(RunConfig, "", _SECTIONS))
    for group, cls in SHARED_PLUGIN_SCHEMAS.items():
        if cfg is not None and registries is not None:
            cls = registries[group].get(cfg[group].name).Config
        if dataclasses.is_dataclass(cls):
            found.update(declared(cls, f"{group}."))
    return found


def key_table() -> str:
    """The README's configuration table, generated from the schema (``python -m subnetdp.core.config``)."""
    valid = {key: bounds.text() for key, bounds in declared_keys().items()}
    lines = ["| key | type | default | valid | meaning |", "|---|---|---|---|---|"]
    for key, kind, default, text in documented_keys():
        shown = f"`{valid[key]}`" if key in valid else ""
        lines.append(f"| `{key}` | {kind} | {f'`{default}`' if default else ''} | {shown} | {text} |")
    return "\n".join(lines)

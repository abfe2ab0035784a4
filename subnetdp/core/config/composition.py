"""Configuration: OmegaConf structured schemas, composition and validation with clear errors.

Composition, lowest first: each selected plugin's ``Config`` defaults, its file
``configs/<group>/<name>.yaml``, ``configs/defaults.yaml``, the recipe, then ``key=value``
overrides. Everything here runs before any process group exists.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import BooleanNode, ValueNode

from subnetdp.core.config.checks import INT64_MAX, _shown, validate
from subnetdp.core.config.schema import PLUGIN_GROUPS, RunConfig
from subnetdp.core.errors import ConfigError, suggest


def config_root() -> Path:
    """The ``configs`` folder: inside an installed wheel, else at the repository root."""
    here = Path(__file__).resolve().parent.parent.parent  # subnetdp/
    packaged = here / "_configs"
    return packaged if packaged.is_dir() else here.parent / "configs"


def resolve_recipe(recipe: str) -> Path:
    """A recipe path, or a bare name looked up in ``configs/recipes``."""
    p = Path(recipe)
    if p.is_file():
        return p
    candidate = config_root() / "recipes" / (recipe if recipe.endswith(".yaml") else f"{recipe}.yaml")
    if candidate.is_file():
        return candidate
    known = sorted(f.stem for f in (config_root() / "recipes").glob("*.yaml"))
    raise ConfigError("recipe", recipe, f"no such file; built-in recipes: {', '.join(known)}"
                      + suggest(p.stem, known))


def first_lines(path: Path, lines: int = 3, width: int = 100) -> str:
    """The opening of a file for an error message: a few lines, each cut short, never the whole file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(lines * (width + 1) * 4)
    except OSError as e:
        return f"<unreadable: {e.strerror}>"
    if b"\0" in raw:
        return "<binary data>"
    head = ["".join(c if c.isprintable() else "?" for c in line)
            for line in raw.decode("utf-8", "replace").splitlines()[:lines]]
    return " | ".join(line[:width] + ("..." if len(line) > width else "") for line in head)


def clipped(value: Any, width: int = 80) -> Any:
    """A value for an error message: its first line, at most ``width`` characters (a short
    non-string value is kept as it is, so the message shows its type)."""
    text = str(value)
    if not isinstance(value, str) and len(text) <= width and "\n" not in text:
        return value
    first = text.splitlines()[0] if text.strip() else text
    return first[:width] + ("..." if len(first) > width or first != text else "")


def _load_yaml(path: Path, what: str) -> DictConfig:
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # a YAML syntax error, reported with the file's opening, never all of it
        raise ConfigError(what, str(path), f"cannot be parsed ({clipped(e)}); it begins: {first_lines(path)}",
                          "give a YAML file of config keys, e.g. a file from configs/recipes") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(what, str(path), f"must hold a mapping of config keys; it begins: {first_lines(path)}",
                          "give a YAML file of config keys, e.g. a file from configs/recipes")
    return cfg


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``key=value`` strings into a config; anything else is an error naming the bad item's key."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError("override", item, "is not of the form key=value",
                              "write e.g. masker.coverage=0.5")
        key, value = item.split("=", 1)
        if any(not part.strip() for part in key.split(".")):
            raise ConfigError(clipped(key), clipped(value), "has an empty part in its dotted key",
                              "write e.g. seed=1 or masker.coverage=0.5 (no leading, trailing or doubled dots)")
        try:  # one by one, so an error names the key whose value YAML cannot read
            OmegaConf.from_dotlist([item])
        except Exception as e:  # YAML scanner/parser/constructor errors and OmegaConf's own
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(key, value, f"cannot be parsed as a YAML value ({first})",
                              f"quote it, e.g. {key}='\"{value}\"'") from None
    given = {item.split("=", 1)[0]: item.split("=", 1)[1] for item in overrides}
    for key, value in given.items():
        # OmegaConf lets the later one win silently (`masker=5 masker.coverage=0.5` drops the 5) or
        # fails inside its merge (`train=[1,2] train.grad_accum=2`).
        sub = next((k for k in given if k.startswith(f"{key}.")), None)
        if sub is not None:
            raise ConfigError(key, clipped(value), f"is given a value and also the sub-key {sub}",
                              f"drop {key}={clipped(value)} and set its keys one by one, e.g. {sub}={clipped(given[sub])}")
    return OmegaConf.from_dotlist(list(overrides))


def delete_keys(layers: Sequence[tuple[DictConfig, str]], deletions: Sequence[str]) -> None:
    """``~key`` overrides: remove ``key`` from the defaults and the recipe, so the schema's default
    (or, for a whole plugin group like ``~data``, the new ``data.*`` overrides alone) applies."""
    for item in deletions:
        key = item[1:]
        found = False
        for layer, _ in layers:
            parent_key, _, last = key.rpartition(".")
            parent = OmegaConf.select(layer, parent_key) if parent_key else layer
            if isinstance(parent, DictConfig) and last in parent:
                del parent[last]
                found = True
        if not key or not found:
            raise ConfigError(key or "~", "~", "is deleted, but neither defaults.yaml nor the recipe sets it",
                              "write ~KEY for a key the recipe sets, e.g. ~data.image_size or ~data")


def _resolve(cfg: DictConfig) -> None:
    """Resolve ``${...}`` interpolations once, so a bad one is a ConfigError naming its key."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", "") or "config")
        msg = str(getattr(e, "msg", e)).splitlines()[0]
        raw: Any = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        raise ConfigError(key, raw, f"interpolation cannot be resolved: {msg}", "refer to an existing key, without cycles") from None



def _check_keys(layer: Any, schema: Any, prefix: str, source: str) -> None:
    """Every key in ``layer`` must exist in ``schema``: else a ConfigError with close matches."""
    if not isinstance(layer, DictConfig):
        return
    for key in layer.keys():
        full = f"{prefix}{key}"
        if not isinstance(schema, DictConfig) or key not in schema.keys():
            valid = sorted(schema.keys()) if isinstance(schema, DictConfig) else []
            raise ConfigError(full, _shown(layer, key),
                              f"unknown key (from {source}); valid keys here: {', '.join(map(str, valid))}"
                              + suggest(str(key), map(str, valid)))
        child = schema._get_node(key)
        sub = layer._get_node(key)
        _check_leaf(full, sub, child, source)
        if isinstance(sub, DictConfig) and isinstance(child, DictConfig):
            _check_keys(sub, child, f"{full}.", source)
        elif isinstance(sub, DictConfig) and isinstance(child, ListConfig):
            raise ConfigError(full, "{...}", f"takes a list, not sub-keys (from {source})", f"write {full}=[...]")


def _check_leaf(key: str, node: Any, schema_node: Any, source: str) -> None:
    """What OmegaConf's conversion accepts but changes: a bool key given ``2`` or ``"0x10"`` (it becomes
    ``true``), and an integer beyond 64 bits (an ``OverflowError`` inside the merge for a float key)."""
    if not isinstance(node, ValueNode) or node._is_interpolation() or node._is_none():
        return
    value = node._value()
    if isinstance(schema_node, BooleanNode) and not isinstance(value, bool):
        raise ConfigError(key, clipped(value), f"takes true or false (from {source}), not {type(value).__name__}",
                          f"write {key}=true or {key}=false")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        raise ConfigError(key, clipped(value), f"does not fit in 64 bits (from {source}; at most {INT64_MAX})",
                          "use a smaller number (1e6 or 1000000)")


def _merge(base: DictConfig, layer: Any, source: str, prefix: str = "") -> DictConfig:
    if layer is None:
        return base
    _check_keys(layer, base, prefix, source)
    try:
        return OmegaConf.merge(base, layer)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = f"{prefix}{e.full_key}" if getattr(e, "full_key", None) else prefix.rstrip(".")
        value = OmegaConf.select(layer, str(e.full_key)) if getattr(e, "full_key", None) else None
        msg = str(getattr(e, "msg", e)).splitlines()[0]
        if value is None and "None" in msg:  # `key=` with nothing after the '='
            raise ConfigError(key, "", f"is empty ({source})",
                              f"give it a value ({key}=...), or leave it out to keep the default") from None
        raise ConfigError(key, value, f"wrong type ({source}): {msg}") from None
    except (TypeError, ValueError) as e:  # OmegaConf lets a few container clashes through as these
        key = prefix.rstrip(".") or ", ".join(map(str, layer.keys()))
        raise ConfigError(key, None, f"cannot be merged ({source}): {e}") from None


def compose(recipe: str | None = None, overrides: Sequence[str] = (),
            registries: dict[str, Any] | None = None) -> DictConfig:
    """Build the resolved run config and check what the contracts say of it (:func:`validate`).

    Rules across keys that belong to a subsystem (FSDP, local steps, checkpoints, rendezvous,
    downstream tasks) are checked beside that subsystem: :func:`subnetdp.train.configure.load_config`
    composes and runs them all, and is what commands and tests call.

    Args:
        recipe: a recipe file or built-in recipe name, or None.
        overrides: ``key=value`` strings, applied last.
        registries: kind -> :class:`~subnetdp.core.plugins.Registry`; built from entry points if None.
    """
    if registries is None:
        from subnetdp.core.plugins import PluginManager
        registries = PluginManager().registries
    layers: list[tuple[DictConfig, str]] = [(_load_yaml(config_root() / "defaults.yaml", "defaults"), "defaults.yaml")]
    if recipe:
        path = resolve_recipe(recipe)
        layers.append((_load_yaml(path, "recipe"), f"recipe {path.name}"))
    deletions = [o for o in overrides if o.startswith("~")]
    layers.append((parse_overrides([o for o in overrides if not o.startswith("~")]), "command line"))
    delete_keys(layers[:-1], deletions)

    top = OmegaConf.structured(RunConfig)
    valid = sorted(list(top.keys()) + list(PLUGIN_GROUPS))
    if recipe and len(layers[1][0]) and not any(k in valid for k in layers[1][0].keys()):
        raise ConfigError("recipe", recipe, f"is not a subnetdp recipe: none of its top-level keys is a config "
                          f"key ({', '.join(valid)}); it begins: {first_lines(path)}",
                          "give a YAML file of config keys, e.g. a file from configs/recipes")
    for layer, source in layers:
        check_sections(layer, top, source)
        for key in layer.keys():
            if key not in top.keys() and key not in PLUGIN_GROUPS:
                raise ConfigError(clipped(key), clipped(_shown(layer, key)),
                                  f"unknown top-level key (from {source}); valid: {', '.join(valid)}"
                                  + suggest(str(key), valid))
    cfg = top
    for layer, source in layers:
        rest = OmegaConf.masked_copy(layer, [k for k in layer.keys() if k not in PLUGIN_GROUPS])
        cfg = _merge(cfg, rest, source)

    for group in PLUGIN_GROUPS:
        name = None
        for layer, source in layers:
            sel = _selector(layer, group, source)
            if sel is not None:
                name = sel
        if name is None:
            raise ConfigError(f"{group}.name", None, "no plugin selected", f"set {group}.name")
        cls = registries[group].get(str(name), f"{group}.name")
        node = OmegaConf.structured(cls.Config)
        plugin_file = cls.config_file or config_root() / group / f"{name}.yaml"
        if Path(plugin_file).is_file():
            node = _merge(node, _load_yaml(Path(plugin_file), f"{group}.name"), f"{Path(plugin_file).name}", f"{group}.")
        for layer, source in layers:
            sub = layer.get(group)
            if isinstance(sub, DictConfig):
                node = _merge(node, sub, source, f"{group}.")
            elif sub is not None:
                raise ConfigError(group, sub, f"must be a mapping (from {source})", f"write {group}.name=...")
        node.name = str(name)
        OmegaConf.set_struct(cfg, False)
        cfg[group] = node
        OmegaConf.set_struct(cfg, True)
    _resolve(cfg)
    validate(cfg, registries)
    return cfg


def _selector(layer: DictConfig, group: str, source: str) -> Any:
    """``{group}.name`` as ``layer`` gives it (None: not given). It picks the plugin whose schema the rest
    of the config is checked against, so it is chosen before the config it could refer to exists: a
    ``${...}`` there is refused, not resolved against a half-built config."""
    sub = layer._get_node(group) if group in layer else None
    if not isinstance(sub, DictConfig) or "name" not in sub:
        return None
    node = sub._get_node("name")
    if node._is_interpolation():
        raise ConfigError(f"{group}.name", clipped(node._value()), f"is an interpolation (from {source}); a plugin "
                          "is selected by its name, before the config it could refer to is built",
                          f"give the plugin's name, e.g. {group}.name=NAME (subnetdp plugins lists them)")
    return node._value()


def check_sections(layer: DictConfig, top: DictConfig, source: str) -> None:
    """A group of keys (``model``, ``train``, ...) given a scalar, list or null, or a scalar key given a
    group: one message naming the key and what was typed, before anything is merged."""
    for key in layer.keys():
        node = layer._get_node(key)
        typed = "null" if node is None or node._is_none() else (
            "a list" if isinstance(node, ListConfig) else "a group of keys" if isinstance(node, DictConfig)
            else f"the value {clipped(node._value())!r}")
        is_group = key in PLUGIN_GROUPS or (key in top.keys() and isinstance(top._get_node(key), DictConfig))
        if is_group and not isinstance(node, DictConfig):
            raise ConfigError(str(key), clipped(_shown(layer, key)), f"is a group of keys, but {source} gives it "
                              f"{typed}", f"set its keys one by one, e.g. {key}.{'name' if key in PLUGIN_GROUPS else 'KEY'}=VALUE"
                              + (" (a recipe writes them indented under it)" if source.startswith("recipe") else ""))
        if key in top.keys() and not is_group and isinstance(node, (DictConfig, ListConfig)):
            raise ConfigError(str(key), clipped(_shown(layer, key)), f"takes one value, but {source} gives it {typed}",
                              f"write e.g. {key}={OmegaConf.select(top, str(key))}")



def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def digest(cfg: DictConfig, ignore: Sequence[str] = ("launch", "run")) -> str:
    """Hash of the config without per-process keys, compared across ranks."""
    c = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(c, dict)
    for k in ignore:
        c.pop(k, None)
    return hashlib.sha256(OmegaConf.to_yaml(OmegaConf.create(c)).encode()).hexdigest()[:16]


def default_run_name(cfg: DictConfig, world_size: int) -> str:
    """A run name from what distinguishes runs; the caller adds a timestamp once, on rank 0."""
    variant = cfg.model.variant or cfg.model.name
    return f"{variant}-{cfg.masker.granularity}-c{cfg.masker.coverage:g}-w{world_size}"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")

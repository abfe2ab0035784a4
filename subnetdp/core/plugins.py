"""Plugin manager: entry-point discovery, per-kind registries and the ``subnetdp plugins`` listing.

Every plugin, built-in or third-party, is a module (or object) listed under the ``subnetdp``
entry-point group whose hook implementations add classes to the registries. Plugins are disabled by
entry-point name with ``SUBNETDP_DISABLE_PLUGINS=name1,name2``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import pluggy

from subnetdp.core import hookspecs
from subnetdp.core.contracts import Communicator, DataModule, Masker, ModelAdapter
from subnetdp.core.errors import ConfigError, SubnetdpError, suggest

KIND_BASES = {"masker": Masker, "comm": Communicator, "model": ModelAdapter, "data": DataModule}
KIND_WORDS = {"masker": "masker", "comm": "communicator", "model": "model", "data": "dataset"}
DISABLE_ENV = "SUBNETDP_DISABLE_PLUGINS"


@dataclass(frozen=True)
class Entry:
    """One registered class: its name, class and the plugin (entry point) that added it."""

    name: str
    cls: type
    plugin: str


class Registry:
    """Named classes of one kind (maskers, communicators, models or datasets)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entries: dict[str, Entry] = {}
        self._current = "<unknown>"

    def add(self, name: str, cls: type) -> None:
        """Register ``cls`` under ``name``; a name taken by another plugin is an error naming both."""
        base = KIND_BASES[self.kind]
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise SubnetdpError(f"plugin '{self._current}' registered {cls!r} as {KIND_WORDS[self.kind]} "
                                f"'{name}', but it is not a subclass of {base.__name__}")
        if name in self.entries:
            other = self.entries[name].plugin
            raise SubnetdpError(f"{KIND_WORDS[self.kind]} name '{name}' is registered twice: by plugin "
                                f"'{other}' and by plugin '{self._current}'; disable one with "
                                f"{DISABLE_ENV}={self._current}")
        cls.name = name
        self.entries[name] = Entry(name, cls, self._current)

    def get(self, name: str, key: str | None = None) -> type:
        """The class registered as ``name``; an unknown name is a :class:`ConfigError` with suggestions."""
        if name not in self.entries:
            key = key or f"{self.kind}.name"
            choices = ", ".join(sorted(self.entries)) or "(none registered)"
            raise ConfigError(key, name, f"unknown {KIND_WORDS[self.kind]}; available: {choices}"
                              + suggest(name, self.entries))
        return self.entries[name].cls

    def names(self) -> list[str]:
        return sorted(self.entries)


class PluginManager:
    """Loads plugins and fills one registry per kind."""

    def __init__(self, disable: Iterable[str] = (), entry_points: bool = True,
                 extra: Iterable[Any] = ()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        disabled = {d.strip() for d in os.environ.get(DISABLE_ENV, "").split(",") if d.strip()}
        disabled.update(disable)
        for name in disabled:
            self.pm.set_blocked(name)
        self.disabled = sorted(disabled)
        if entry_points:
            self.pm.load_setuptools_entrypoints(hookspecs.PROJECT)
        for obj in extra:
            self.pm.register(obj)
        self.registries = {kind: self._collect(kind) for kind in KIND_BASES}

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def _collect(self, kind: str) -> Registry:
        reg = Registry(kind)
        caller = getattr(self.pm.hook, hookspecs.REGISTRATION_HOOKS[kind])
        # Call implementations one by one so a duplicate name can be blamed on its plugin.
        for impl in reversed(caller.get_hookimpls()):
            reg._current = impl.plugin_name
            impl.function(registry=reg)
        reg._current = "<unknown>"
        return reg

    def get(self, kind: str, name: str) -> type:
        return self.registries[kind].get(name)

    def describe(self) -> list[dict[str, str]]:
        """One row per registered class: name, kind, plugin, package, version, hooks."""
        dists = {self.pm.get_name(p): d for p, d in self.pm.list_plugin_distinfo()}
        rows = []
        for kind, reg in self.registries.items():
            for e in reg.entries.values():
                dist = dists.get(e.plugin)
                plugin_obj = self.pm.get_plugin(e.plugin)
                hooks = sorted(h.name for h in (self.pm.get_hookcallers(plugin_obj) or [])) if plugin_obj else []
                rows.append({
                    "name": e.name, "kind": KIND_WORDS[kind], "plugin": e.plugin,
                    "package": dist.project_name if dist else "(registered directly)",
                    "version": dist.version if dist else "",
                    "class": f"{e.cls.__module__}.{e.cls.__qualname__}",
                    "hooks": ",".join(hooks),
                })
        return rows

    def versions(self) -> dict[str, str]:
        """Plugin name -> 'package==version', for comparing ranks."""
        return {self.pm.get_name(p): f"{d.project_name}=={d.version}" for p, d in self.pm.list_plugin_distinfo()}


def format_table(rows: list[dict[str, str]], columns: list[str]) -> str:
    """A plain fixed-width table."""
    widths = {c: max([len(c)] + [len(str(r[c])) for r in rows]) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    for r in rows:
        lines.append("  ".join(str(r[c]).ljust(widths[c]) for c in columns))
    return "\n".join(lines)

"""Plugin manager: entry-point discovery, per-kind registries and the ``subnetdp plugins`` listing.

Every plugin, built-in or third-party, is a module (or object) listed under the ``subnetdp``
entry-point group whose hook implementations add classes to the registries. Plugins are disabled by
entry-point name with ``SUBNETDP_DISABLE_PLUGINS=name1,name2``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pluggy

from subnetdp.core import hookspecs
from subnetdp.core.compat import IncompatiblePlugin, check_plugin
from subnetdp.core.contracts import Communicator, DataModule, Masker, ModelAdapter
from subnetdp.core.errors import ConfigError, SubnetdpError, suggest

KIND_BASES = {"masker": Masker, "comm": Communicator, "model": ModelAdapter, "data": DataModule}
KIND_WORDS = {"masker": "masker", "comm": "communicator", "model": "model", "data": "dataset"}
DISABLE_ENV = "SUBNETDP_DISABLE_PLUGINS"
_ANNOUNCED: set[str] = set()  # lines about broken plugins already printed by this process


def announce(line: str) -> None:
    """Print a line about a plugin to stderr once per process (every command builds a plugin manager).

    Of a node's workers only the first says it (the others load the same packages).
    """
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    if line not in _ANNOUNCED:
        _ANNOUNCED.add(line)
        print(f"subnetdp: {line}", file=sys.stderr, flush=True)


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
        #: name -> why it is missing, for a name that a disabled plugin would register (asked on a miss).
        self.disabled_reason: Callable[[str], str | None] = lambda name: None

    def add(self, name: str, cls: type) -> None:
        """Register ``cls`` under ``name``; a name taken by another plugin is an error naming both."""
        base = KIND_BASES[self.kind]
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise SubnetdpError(f"plugin '{self._current}' registered {cls!r} as {KIND_WORDS[self.kind]} "
                                f"'{name}', but it is not a subclass of {base.__name__}")
        shared = base.Config
        if not (isinstance(cls.Config, type) and issubclass(cls.Config, shared)):
            raise SubnetdpError(f"plugin '{self._current}' registered {KIND_WORDS[self.kind]} '{name}' with "
                                f"Config {cls.Config!r}, which does not subclass {shared.__name__} (the keys every "
                                f"{KIND_WORDS[self.kind]} shares) — declare `class Config({shared.__name__}): ...`")
        if name in self.entries:
            other = self.entries[name].plugin
            fix = (f"disable one with {DISABLE_ENV}={self._current}" if other != self._current else
                   "both packages use that entry-point name, so disabling it would switch off both: "
                   "uninstall one of them (pip uninstall ...)")
            raise SubnetdpError(f"{KIND_WORDS[self.kind]} name '{name}' is registered twice: by plugin "
                                f"'{other}' and by plugin '{self._current}'; {fix}")
        self.entries[name] = Entry(name, cls, self._current)

    def get(self, name: str, key: str | None = None) -> type:
        """The class registered as ``name``; an unknown name is a :class:`ConfigError` with suggestions."""
        if name not in self.entries:
            key = key or f"{self.kind}.name"
            choices = ", ".join(sorted(self.entries)) or "(none registered)"
            disabled = self.disabled_reason(name)
            if disabled:
                raise ConfigError(key, name, f"{KIND_WORDS[self.kind]} '{name}' is disabled: {disabled}",
                                  f"available: {choices}")
            raise ConfigError(key, name, f"unknown {KIND_WORDS[self.kind]}; available: {choices}"
                              + suggest(name, self.entries))
        return self.entries[name].cls

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """An instance of the class registered as ``name``, which knows the name it was chosen by."""
        obj = self.get(name)(*args, **kwargs)
        obj.name = name
        return obj

    def names(self) -> list[str]:
        return sorted(self.entries)


class PluginManager:
    """Loads plugins and fills one registry per kind."""

    def __init__(self, disable: Iterable[str] = (), entry_points: bool = True,
                 extra: Iterable[Any] = ()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        env = os.environ.get(DISABLE_ENV, "")
        # What disabled each plugin, and how to undo it, for the error that names one of its classes.
        self._disabled_by = {name: (f"{DISABLE_ENV}={env}", f"take '{name}' out of {DISABLE_ENV}")
                             for name in (d.strip() for d in env.split(",")) if name}
        for name in disable:
            self._disabled_by.setdefault(name, (f"PluginManager(disable=[{name!r}])", "do not pass it in disable"))
        self._blocked: dict[str, Any] = {}  # disabled entry point name -> its entry point (not loaded)
        #: entry point name -> why it was left out (an old hook signature, an import error); listed as broken.
        self.broken: dict[str, IncompatiblePlugin] = {}
        for name in self._disabled_by:
            self.pm.set_blocked(name)
        self.disabled = sorted(self._disabled_by)
        if entry_points:
            self._load_entry_points()
        for obj in extra:
            self.pm.register(obj)
        self.check_pending()
        self.registries = {kind: self._collect(kind) for kind in KIND_BASES}
        for kind, reg in self.registries.items():
            reg.disabled_reason = lambda name, kind=kind: self._why_disabled(kind, name)

    def check_pending(self) -> None:
        """Refuse a hook implementation whose name is no hook specification (a misspelled hook).

        pluggy would otherwise never call it, silently.
        """
        known = sorted(n for n in dir(hookspecs) if n.startswith(hookspecs.PROJECT + "_"))
        for name in dir(self.pm.hook):
            caller = getattr(self.pm.hook, name)
            if name.startswith("_") or not hasattr(caller, "get_hookimpls") or caller.spec is not None:
                continue
            for impl in caller.get_hookimpls():
                raise SubnetdpError(f"plugin '{impl.plugin_name}' implements '{name}', which is no subnetdp hook; "
                                    f"hooks: {', '.join(known)}" + suggest(name, known))

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Add a plugin object for this process only (the run's built-in reporter); its hook names are checked."""
        self.pm.register(plugin, name=name)
        self.check_pending()

    def unregister(self, plugin: Any) -> None:
        self.pm.unregister(plugin)

    def _load_entry_points(self) -> None:
        """Register every ``subnetdp`` entry point; two packages using one name is an error."""
        from importlib.metadata import distributions

        self._dists: dict[str, Any] = {}
        for dist in distributions():
            for ep in dist.entry_points:
                if ep.group != hookspecs.PROJECT:
                    continue
                owner = self._dists.get(ep.name)
                if owner is not None:
                    if owner.metadata["name"] == dist.metadata["name"]:
                        continue  # the same distribution seen twice on sys.path
                    raise SubnetdpError(
                        f"plugin name '{ep.name}' is claimed by two packages: {owner.metadata['name']} and "
                        f"{dist.metadata['name']}; uninstall one or disable it with {DISABLE_ENV}={ep.name}")
                if self.pm.is_blocked(ep.name):
                    self._blocked[ep.name] = ep
                    continue
                self._dists[ep.name] = dist
                self._register_entry_point(ep, dist)

    def _register_entry_point(self, ep: Any, dist: Any) -> None:
        """Load and register one entry point; one that cannot be registered is named in one line and left out."""
        package = dist.metadata["name"]
        try:
            obj = ep.load()
        except Exception as exc:  # noqa: BLE001 - any failure of a third-party import is reported the same way
            self._leave_out(IncompatiblePlugin(ep.name, package, "", (
                f"plugin '{ep.name}' (package {package}) is left out: importing {ep.value} failed: "
                f"{type(exc).__name__}: {exc}; fix or uninstall it, or disable it with {DISABLE_ENV}={ep.name}")))
            return
        checked = check_plugin(obj, ep.name, package, self.pm.parse_hookimpl_opts)
        if isinstance(checked, IncompatiblePlugin):
            self._leave_out(checked)
            return
        if checked is not obj:
            announce(f"plugin '{ep.name}' (package {package}) uses a 0.1.0 hook signature, adapted for this "
                     f"release (see its DeprecationWarning); update it before 0.3.0")
        try:
            self.pm.register(checked, name=ep.name)
        except pluggy.PluginValidationError as exc:  # what check_plugin does not foresee, still one line
            self._leave_out(IncompatiblePlugin(ep.name, package, "", (
                f"plugin '{ep.name}' (package {package}) is left out: {' '.join(str(exc).split())}")))

    def _leave_out(self, problem: IncompatiblePlugin) -> None:
        self.broken[problem.plugin] = problem
        self._dists.pop(problem.plugin, None)
        announce(problem.line)

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

    def _why_disabled(self, kind: str, name: str) -> str | None:
        """Which disabled plugin would register ``name`` as a ``kind``, and what disabled it.

        Asked only for a name that is not registered: the disabled plugins' modules are imported then
        (not before, since a plugin may be disabled because it does not load) and their registration
        hook called on a scratch registry. One that fails to load or register is passed over.
        """
        hook = hookspecs.REGISTRATION_HOOKS[kind]
        for plugin, ep in sorted(self._blocked.items()):
            scratch = Registry(kind)
            scratch._current = plugin
            try:
                register = getattr(ep.load(), hook, None)
                if register is not None:
                    register(registry=scratch)
            except Exception:  # noqa: BLE001 - a plugin that does not load tells nothing
                continue
            if name in scratch.entries:
                by, undo = self._disabled_by[plugin]
                return f"its plugin '{plugin}' is switched off by {by} ({undo} to use it)"
        return None

    def _package(self, plugin: str) -> tuple[str, str]:
        dist = getattr(self, "_dists", {}).get(plugin)
        return (dist.metadata["name"], dist.version) if dist else ("(registered directly)", "")

    def _hooks(self, plugin: str) -> str:
        obj = self.pm.get_plugin(plugin)
        return ",".join(sorted(h.name for h in (self.pm.get_hookcallers(obj) or []))) if obj is not None else ""

    def describe(self) -> list[dict[str, str]]:
        """One row per registered class (name, kind, plugin, package, version, hooks), then one per
        plugin that registers no class but implements lifecycle hooks (kind ``hooks``)."""
        rows = []
        used = set()
        for kind, reg in self.registries.items():
            for e in reg.entries.values():
                package, version = self._package(e.plugin)
                used.add(e.plugin)
                rows.append({"name": e.name, "kind": KIND_WORDS[kind], "plugin": e.plugin, "package": package,
                             "version": version, "class": f"{e.cls.__module__}.{e.cls.__qualname__}",
                             "hooks": self._hooks(e.plugin)})
        for obj in self.pm.get_plugins():
            plugin = self.pm.get_name(obj)
            if plugin in used or plugin is None or obj is hookspecs:
                continue
            package, version = self._package(plugin)
            rows.append({"name": plugin, "kind": "hooks", "plugin": plugin, "package": package, "version": version,
                         "class": "", "hooks": self._hooks(plugin)})
        for plugin, problem in self.broken.items():
            rows.append({"name": plugin, "kind": "broken", "plugin": plugin, "package": problem.package,
                         "version": self._broken_version(plugin), "class": "", "hooks": problem.hook,
                         "problem": problem.line})
        return sorted(rows, key=lambda r: (r["kind"], r["name"]))  # kind by kind, names alphabetical

    def _broken_version(self, plugin: str) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(self.broken[plugin].package)
        except PackageNotFoundError:
            return ""

    def versions(self) -> dict[str, str]:
        """Plugin name -> 'package==version', for comparing ranks."""
        return {name: f"{d.metadata['name']}=={d.version}" for name, d in getattr(self, "_dists", {}).items()}


def format_table(rows: list[dict[str, str]], columns: list[str]) -> str:
    """A plain fixed-width table."""
    widths = {c: max([len(c)] + [len(str(r[c])) for r in rows]) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    for r in rows:
        lines.append("  ".join(str(r[c]).ljust(widths[c]) for c in columns))
    return "\n".join(lines)

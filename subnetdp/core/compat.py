"""Plugins written against an older hook API: adapted for a release where possible, refused in one line otherwise.

pluggy refuses a hook implementation that declares an argument its specification lacks
(``PluginValidationError`` at register time), which would end every command in a traceback. The
plugin manager asks :func:`check_plugin` first:

- a lifecycle hook of 0.1.0, which took one ``run`` (``subnetdp_on_run_end(run)``), is wrapped: the
  wrapper takes the current arguments and hands the old function a :class:`LegacyRun` that answers
  the old ``Run``'s attribute names from the context, state and result (a DeprecationWarning says so);
- any other mismatch is an :class:`IncompatiblePlugin`: one line naming the package, the hook, the
  signature declared and the current one. That plugin is left out; the others load.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from subnetdp.core import hookspecs

#: Lifecycle hooks whose 0.1.0 form took ``run`` in place of ``context, state`` (and ``result``).
LEGACY_RUN_HOOKS = ("subnetdp_on_run_start", "subnetdp_on_step_end", "subnetdp_on_eval_end", "subnetdp_on_run_end")
ADAPTED_UNTIL = "0.3.0"


@dataclass(frozen=True)
class IncompatiblePlugin:
    """Why a plugin cannot be registered, in one line."""

    plugin: str
    package: str
    hook: str
    line: str


def argnames(func: Callable[..., Any]) -> tuple[str, ...]:
    """The arguments pluggy passes by name: positional ones without a default (as pluggy reads them)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
                 and p.name != "self")


def signature(hook: str, names: tuple[str, ...]) -> str:
    return f"{hook}({', '.join(names)})"


class LegacyRun:
    """What a 0.1.0 hook called ``run``: the old attribute names, read from the context, state and result.

    ``run.summary``, ``run.step``, ``run.model``, ``run.plan``, ``run.cfg``, ``run.rank``, ``run.run_dir``
    and the rest resolve to the result's, the state's or the context's field of that name, in that
    order. Read-only, like what the current hooks receive.
    """

    def __init__(self, context: Any, state: Any, result: Any = None) -> None:
        object.__setattr__(self, "_sources", tuple(s for s in (result, state, context) if s is not None))

    def __getattr__(self, name: str) -> Any:
        for source in object.__getattribute__(self, "_sources"):
            try:
                return getattr(source, name)
            except AttributeError:
                continue
        raise AttributeError(f"the 0.1.0 run view has no '{name}'; read it from the hook's context, state or "
                             f"result (hookspecs)")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"run.{name} is read-only")


# The current signatures, spelled out: pluggy reads the wrapper's argument names to know what to pass.
_WRAPPERS: dict[str, Callable[[Callable[..., Any], tuple[str, ...]], Callable[..., Any]]] = {
    "subnetdp_on_run_start": lambda old, want: (
        lambda context, state: old(**_pick(want, LegacyRun(context, state), {}))),
    "subnetdp_on_step_end": lambda old, want: (
        lambda context, state, step, metrics: old(**_pick(want, LegacyRun(context, state),
                                                          {"step": step, "metrics": metrics}))),
    "subnetdp_on_eval_end": lambda old, want: (
        lambda context, state, step, metrics, union, tasks: old(**_pick(
            want, LegacyRun(context, state), {"step": step, "metrics": metrics, "union": union, "tasks": tasks}))),
    "subnetdp_on_run_end": lambda old, want: (
        lambda context, state, result: old(**_pick(want, LegacyRun(context, state, result), {}))),
}


def _pick(want: tuple[str, ...], run: LegacyRun, others: dict[str, Any]) -> dict[str, Any]:
    values = dict(others, run=run)
    return {name: values[name] for name in want}


class AdaptedPlugin:
    """A plugin object whose hooks are the original's, with 0.1.0 lifecycle hooks wrapped.

    Attributes that are not hooks (a module's helpers) are read through from the original.
    """

    def __init__(self, original: Any, hooks: dict[str, Callable[..., Any]]) -> None:
        self._original = original
        for name, func in hooks.items():
            setattr(self, name, func)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)

    def __repr__(self) -> str:
        return f"<adapted {self._original!r}>"


def check_plugin(obj: Any, name: str, package: str, impl_opts: Callable[[Any, str], Any]) -> Any:
    """``obj`` itself, an :class:`AdaptedPlugin` for it, or an :class:`IncompatiblePlugin` saying why not.

    Args:
        obj: the loaded plugin (a module or object).
        name: its entry-point name; package: the distribution that installed it.
        impl_opts: pluggy's ``PluginManager.parse_hookimpl_opts`` (which attributes are hook implementations).
    """
    hooks: dict[str, Callable[..., Any]] = {}
    adapted = []
    for attr in dir(obj):
        if not attr.startswith(hookspecs.PROJECT + "_"):
            continue
        func = getattr(obj, attr, None)
        if func is None or impl_opts(obj, attr) is None:
            continue
        hooks[attr] = func
        spec = getattr(hookspecs, attr, None)
        if spec is None:
            continue  # a misspelled hook: the plugin manager's check_pending names it
        declared, current = argnames(func), argnames(spec)
        extra = [a for a in declared if a not in current]
        if not extra:
            continue
        if attr in LEGACY_RUN_HOOKS and extra == ["run"]:
            wrapper = _WRAPPERS[attr](func, declared)
            wrapper.__name__ = attr
            # Keep the implementation's options (tryfirst, hookwrapper ...): pluggy reads them off the function.
            setattr(wrapper, hookspecs.PROJECT + "_impl", getattr(func, hookspecs.PROJECT + "_impl"))
            hooks[attr] = wrapper
            adapted.append(f"{signature(attr, declared)} -> {signature(attr, current)}")
            continue
        return IncompatiblePlugin(name, package, attr, (
            f"plugin '{name}' (package {package}) is left out: it implements {signature(attr, declared)}, "
            f"but the hook is now {signature(attr, current)} (argument(s) {', '.join(extra)} unknown); "
            f"update the plugin, or disable it with SUBNETDP_DISABLE_PLUGINS={name}"))
    if not adapted:
        return obj
    warnings.warn(f"plugin '{name}' (package {package}) uses the 0.1.0 hook signature {'; '.join(adapted)}; "
                  f"adapted until {ADAPTED_UNTIL}: take the new arguments (context.rank, state.model, "
                  f"result.summary)", DeprecationWarning, stacklevel=3)
    return AdaptedPlugin(obj, hooks)

"""The floors of the package, enforced on every import, direct or transitive (function-level ones too).

Bottom up: ``core`` (the contracts) -> ``sdp`` (the method) -> ``parallel`` (the engine) -> ``train``
(step, meter, loop, checkpoints, the run lock and up-front checks) -> the command wings: ``plan``
(report, budget search, dry runs), ``evaluate`` (eval and export from a checkpoint's files) and
``tools`` (data preparation) -> ``cli``. ``launchers`` stands on ``core`` alone. A built-in plugin
imports what a third-party one can: ``subnetdp`` (the public API, which reaches only ``core``) and
helpers of its own under ``subnetdp/plugins/``; one plugin kind never imports another, and no wing
imports another. No import cycle joins two modules
unless both are in ``core``. Only ``plugins/comm/``, ``parallel/`` and ``launchers/`` import
``torch.distributed`` or ``mpi4py``.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import subnetdp

ROOT = Path(subnetdp.__file__).parent
DIST_ALLOWED = ("plugins/comm/", "parallel/", "launchers/")
BACKENDS = ("torch.distributed", "mpi4py")
WINGS = ("plan", "evaluate", "tools")  # the commands' rooms: each stands on the floors it needs

#: ``subnetdp.parallelize`` (``parallel/wrapper.py``) is reached through the api's module ``__getattr__``
#: only, on first use: a plugin importing the contracts from ``subnetdp`` never loads it (checked below).
LAZY_ENTRANCE = "subnetdp.parallel.wrapper"

# floor -> the floors its modules may import (itself included)
MAY_IMPORT = {
    "api": {"api", "core"},
    "core": {"core"},
    "launchers": {"core", "launchers"},
    "sdp": {"core", "sdp"},
    "parallel": {"core", "sdp", "parallel"},
    "train": {"core", "sdp", "parallel", "train", "launchers"},
    "plugins": {"api"},  # and their own kind (checked separately); see plugin_may_import
    "plan": {"core", "sdp", "parallel", "train", "launchers", "plan"},
    "evaluate": {"core", "sdp", "parallel", "train", "launchers", "evaluate"},
    "tools": {"api", "core", "plugins", "tools"},
    "top": {"api", "core", "sdp", "parallel", "train", "launchers", "plugins", *WINGS, "top"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def floor(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return "api"
    return parts[1] if parts[1] in MAY_IMPORT else "top"


def plugin_kind(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "plugins" else None


@lru_cache(maxsize=None)
def direct_imports(mod: str) -> frozenset[str]:
    """Every module ``mod`` imports anywhere in its source, resolved to package modules where possible."""
    out = set()
    tree = ast.parse(MODULES[mod].read_text())
    lazy = {id(n) for f in ast.walk(tree) if mod == "subnetdp" and isinstance(f, ast.FunctionDef)
            and f.name == "__getattr__" for n in ast.walk(f)}  # see LAZY_ENTRANCE
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)
    resolved = set()
    for name in out:
        if name.startswith("subnetdp"):
            while name not in MODULES:  # `from subnetdp.x import Name`: the module is subnetdp.x
                name = name.rpartition(".")[0]
        resolved.add(name)
    resolved.discard("subnetdp")  # a parent package's __init__ runs first; the api is checked on its own
    resolved.discard(mod)
    return frozenset(resolved)


@lru_cache(maxsize=None)
def reached(mod: str) -> frozenset[str]:
    """Every module imported by ``mod`` transitively through the package (externals included, not followed)."""
    seen: set[str] = set()
    todo = [mod]
    while todo:
        for name in direct_imports(todo.pop()):
            if name not in seen:
                seen.add(name)
                if name in MODULES:
                    todo.append(name)
    return frozenset(seen)


def violations(mod: str) -> list[str]:
    """What ``mod`` reaches that its floor forbids."""
    own, kind, out = floor(mod), plugin_kind(mod), []
    for name in sorted(reached(mod)):
        if name in MODULES:
            if floor(name) not in MAY_IMPORT[own] and not (kind and plugin_kind(name) == kind):
                out.append(f"{mod} ({own}) reaches {name} ({floor(name)})")
            elif kind and plugin_kind(name) not in (None, kind):
                out.append(f"{mod} (plugins/{kind}) reaches {name} (plugins/{plugin_kind(name)})")
        elif name.startswith(BACKENDS) and own in ("api", "core", "sdp"):
            out.append(f"{mod} ({own}) reaches {name}")
    return out


def test_the_walk_sees_the_package():
    assert set(MAY_IMPORT) == {floor(m) for m in MODULES}  # every floor has modules, every module a floor
    # a transitive edge the walk must see: the loop reaches torch.distributed through parallel/
    assert any(n.startswith("torch.distributed") for n in reached("subnetdp.train.loop"))


def test_every_import_points_down():
    found = [v for mod in MODULES for v in violations(mod)]
    assert found == [], "\n".join(found)


def test_core_imports_no_backend_and_no_plugin():
    files = [m for m in MODULES if floor(m) == "core"]
    assert len(files) >= 6
    for mod in files:
        for name in reached(mod):
            assert not name.startswith((*BACKENDS, "subnetdp.plugins")), f"{mod} reaches {name}"


def test_only_backend_packages_import_torch_distributed():
    offenders = []
    for mod, f in MODULES.items():
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith(DIST_ALLOWED):
            continue
        if any(m.startswith(BACKENDS) for m in direct_imports(mod)):
            offenders.append(rel)
    assert offenders == []


def absolute_imports(mod: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``mod``'s source (function-level ones too), relative ones
    resolved, as written: ``from subnetdp.core.plan import MaskPlan`` gives ``subnetdp.core.plan``."""
    package = mod if MODULES[mod].name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(MODULES[mod].read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            out += [(node.lineno, base)]
    return out


def plugin_may_import(name: str) -> bool:
    """What a module under ``subnetdp/plugins/`` may import of the package: ``subnetdp`` itself (the
    public API) and the plugins' own modules. No exception: what a built-in needs and a third party's
    plugin of its kind would need too is in the public API; what only the built-ins use lives beside
    them (the communicators' rendezvous in ``plugins/comm/_rendezvous.py``)."""
    return name == "subnetdp" or name == "subnetdp.plugins" or name.startswith("subnetdp.plugins.")


def plugin_import_violations() -> list[str]:
    """``path:line imports module`` for every import of a built-in plugin that :func:`plugin_may_import` refuses."""
    return [f"{MODULES[mod].relative_to(ROOT.parent)}:{line} imports {name}"
            for mod in MODULES if floor(mod) == "plugins"
            for line, name in absolute_imports(mod)
            if name.split(".")[0] == "subnetdp" and not plugin_may_import(name)]


def test_built_in_plugins_import_only_the_public_api():
    # A built-in plugin is written as a third party's is: if it needs something the public API lacks,
    # either a third party would need it too (add it to subnetdp.__all__) or it is the plugin's own.
    plugins = [m for m in MODULES if floor(m) == "plugins"]
    assert len(plugins) >= 30 and any(n == "subnetdp" for m in plugins for _, n in absolute_imports(m))
    found = plugin_import_violations()
    assert found == [], "import these from `subnetdp` (the public API) instead:\n" + "\n".join(found)


def test_the_floors_form_a_ladder_and_no_wing_imports_another():
    for wing in WINGS:
        assert not MAY_IMPORT[wing] & (set(WINGS) - {wing}), wing
    # No circle between floors: each floor's allowed set, itself left out, leads only downwards.
    order: list[str] = []
    while len(order) < len(MAY_IMPORT):
        ready = [f for f in MAY_IMPORT if f not in order and MAY_IMPORT[f] - {f} <= set(order)]
        assert ready, f"the floors {sorted(set(MAY_IMPORT) - set(order))} import each other in a circle"
        order += sorted(ready)


def import_cycles() -> list[list[str]]:
    """The package's import cycles: strongly connected groups of more than one module."""
    graph = {m: sorted(n for n in direct_imports(m) if n in MODULES) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for root in graph:  # Tarjan's algorithm, iteratively (the graph is deep enough for recursion limits)
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
            if i < len(graph[node]):
                work.append((node, i + 1))
                nxt = graph[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                group = []
                while True:
                    m = stack.pop()
                    group.append(m)
                    if m == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return cycles


def test_no_import_cycle_outside_core():
    # core's own contracts refer to each other's types; anywhere else a cycle means two modules
    # that cannot be read (or moved) one without the other, as export and hf once were.
    cycles = [c for c in import_cycles() if any(floor(m) != "core" for m in c)]
    assert cycles == [], cycles


def test_the_public_wrapper_is_loaded_on_first_use_only():
    import subprocess
    import sys

    code = ("import sys, subnetdp; assert 'subnetdp.parallel' not in sys.modules; "
            "f = subnetdp.parallelize; assert f.__module__ == %r and 'subnetdp.parallel' in sys.modules" % LAZY_ENTRANCE)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_training_state_knows_no_checkpoint_files():
    # The state is saved and loaded by the checkpointer, which stands above it: the state is handed
    # what it needs of the checkpoints (the last good one, for the non-finite guard's message).
    assert not [m for m in reached("subnetdp.train.state") if m.startswith("subnetdp.train.checkpoints")], \
        sorted(m for m in reached("subnetdp.train.state") if m.startswith("subnetdp.train.checkpoints"))

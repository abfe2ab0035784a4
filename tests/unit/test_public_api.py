"""The public surface is frozen: ``import subnetdp`` (what a plugin author uses) and the CLI's commands.

A change to either must be deliberate: update ``FROZEN_API`` / ``FROZEN_CLI`` below in the same
commit, and say why. ``python -m tests.unit.test_public_api`` prints the current surface.
"""

from __future__ import annotations

import argparse
import inspect
import json

import subnetdp
from subnetdp.cli import build_parser


def api_surface() -> dict[str, list[str]]:
    """Each public name: for a class, its public methods and properties with their signatures."""
    out: dict[str, list[str]] = {}
    for name in sorted(subnetdp.__all__):
        obj = getattr(subnetdp, name)
        if inspect.isclass(obj):
            members = []
            for attr, value in sorted(vars(obj).items()):
                if attr.startswith("_") and attr != "__init__":
                    continue
                fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
                if isinstance(value, property):
                    members.append(f"{attr}: property")
                elif inspect.isfunction(fn):
                    members.append(f"{attr}{inspect.signature(fn)}")
            out[name] = members
        elif callable(obj):
            out[name] = [f"{name}{inspect.signature(obj)}"]
        else:
            out[name] = [type(obj).__name__]
    return out


def cli_surface() -> dict[str, list[str]]:
    """Each command: its positional arguments and option strings."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for command, p in sorted(sub.choices.items()):
        args = []
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            args.append("/".join(a.option_strings) if a.option_strings else f"<{a.metavar or a.dest}>")
        out[command] = sorted(args)
    return out


FROZEN_API: dict[str, list[str]] = {}
FROZEN_CLI: dict[str, list[str]] = {}


def test_the_public_api_is_the_frozen_one():
    assert api_surface() == FROZEN_API


def test_the_cli_is_the_frozen_one():
    assert cli_surface() == FROZEN_CLI


def test_the_plugin_template_imports_only_the_public_api():
    import ast
    from pathlib import Path

    template = Path(__file__).parents[2] / "examples" / "plugin-template" / "src"
    files = sorted(template.rglob("*.py"))
    assert files
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("subnetdp."):
                raise AssertionError(f"{f.name} imports {node.module}: the template uses `from subnetdp import ...`")
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("subnetdp.") for a in node.names), f.name


if __name__ == "__main__":
    print(json.dumps({"api": api_surface(), "cli": cli_surface()}, indent=1))

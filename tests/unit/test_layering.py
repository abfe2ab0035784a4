"""core/ imports neither torch.distributed, mpi4py nor plugins; only comm/, parallel/ and launchers/ reach torch.distributed."""

from __future__ import annotations

import ast
from pathlib import Path

import subnetdp

ROOT = Path(subnetdp.__file__).parent
DIST_ALLOWED = ("plugins/comm/", "parallel/", "launchers/")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_core_imports_no_backend_and_no_plugin():
    files = sorted((ROOT / "core").rglob("*.py"))
    assert len(files) >= 8
    for f in files:
        for mod in _imports(f):
            assert not mod.startswith(("torch.distributed", "mpi4py", "subnetdp.plugins")), f"{f.name} imports {mod}"


def test_only_backend_packages_import_torch_distributed():
    offenders = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith(DIST_ALLOWED):
            continue
        if any(m.startswith(("torch.distributed", "mpi4py")) for m in _imports(f)):
            offenders.append(rel)
    assert offenders == []

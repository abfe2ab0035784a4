"""Files a reader can hold: no module of the package over 500 lines (a longer one splits by concept)."""

from pathlib import Path

import subnetdp

LIMIT = 500


def test_no_module_is_over_500_lines():
    root = Path(subnetdp.__file__).parent
    sizes = {str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines()) for p in root.rglob("*.py")}
    assert len(sizes) > 100  # the whole package was read
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"split these modules by concept (at most {LIMIT} lines each): {over}"

"""One source of truth for configuration: the schemas hold every default and its doc; the README's table is theirs."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from subnetdp.core.config import config_root, documented_keys, key_table

README = Path(__file__).parents[2] / "README.md"


def test_every_key_has_a_one_line_doc():
    rows = documented_keys()
    assert len(rows) > 50
    undocumented = [key for key, _, _, text in rows if not text.strip() or "\n" in text]
    assert undocumented == [], f"give these fields a doc(...) in their schema: {undocumented}"


def test_the_readme_key_table_is_the_generated_one():
    text = README.read_text()
    found = re.search(r"<!-- config-keys:start -->\n(.*?)\n<!-- config-keys:end -->", text, re.S)
    assert found, "README.md lost its <!-- config-keys:start/end --> block"
    assert found.group(1) == key_table(), "README.md's key table is stale: paste `python -m subnetdp.core.config`"


def test_defaults_yaml_only_selects_plugins():
    defaults = OmegaConf.to_container(OmegaConf.load(config_root() / "defaults.yaml"))
    assert defaults == {group: {"name": defaults[group]["name"]} for group in ("model", "masker", "comm", "data")}

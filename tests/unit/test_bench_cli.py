"""Benchmark scripts refuse a bad invocation in one line, before any rank is spawned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ddp_vs_sdp_refuses_steps_shorter_than_the_warm_up(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ddp_vs_sdp.py"), "--steps", "5",
                        "--out", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert "optim.warmup_steps=10" in last and "train.steps=10 or more" in last
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "bench-results").exists()

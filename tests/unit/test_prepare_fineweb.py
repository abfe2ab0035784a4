"""``prepare-text --fineweb`` through huggingface_hub, without a network: one clear line, or the files
an earlier run downloaded.

In subprocesses, since huggingface_hub reads ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` when imported. The
unreachable hub is a loopback port that nothing listens on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from subnetdp.tools.prepare_text import FINEWEB_DIR

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _prepare(out, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "subnetdp", "prepare-text", "--fineweb", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **env})


def test_fineweb_without_a_network_is_one_line_or_uses_what_was_downloaded(tmp_path):
    with socket.socket() as s:  # a free loopback port, closed again: connecting to it is refused
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    for env, reason in (({"HF_ENDPOINT": endpoint}, ""), ({"HF_HUB_OFFLINE": "1"}, "OfflineModeIsEnabled")):
        job = _prepare(tmp_path / "out", **env)
        assert job.returncode == 2, job.stderr[-3000:]
        err = job.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("subnetdp: error: prepare-text --fineweb: cannot list "), err
        assert "datasets/HuggingFaceFW/fineweb" in err[0] and "HF_ENDPOINT pointing at a mirror" in err[0]
        assert reason in err[0] and "Traceback" not in job.stderr
    # A file already where a download puts it (OUT/raw/sample/10BT/) serves when the hub is out of reach.
    raw = tmp_path / "out" / "raw" / FINEWEB_DIR
    raw.mkdir(parents=True)
    pq.write_table(pa.table({"text": [f"document {i}: " + "the quick brown fox " * 20 for i in range(40)]}),
                   raw / "000_00000.parquet")
    job = _prepare(tmp_path / "out", HF_HUB_OFFLINE="1")
    assert job.returncode == 0, job.stderr[-3000:]
    assert "wrote " in job.stdout and (tmp_path / "out" / "meta.json").is_file()

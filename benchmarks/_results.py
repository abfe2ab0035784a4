"""Where benchmarks write their JSON and figures.

By default ``./bench-results`` (or ``$SUBNETDP_BENCH_RESULTS``), never over the results committed in
``benchmarks/results/``: refresh those on purpose with ``SUBNETDP_BENCH_RESULTS=benchmarks/results``.
"""

from __future__ import annotations

import os
from pathlib import Path


def results_dir() -> Path:
    out = Path(os.environ.get("SUBNETDP_BENCH_RESULTS", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    return out

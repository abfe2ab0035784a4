"""Checks that run in the launching process, before any worker or process group exists.

Each turns a problem that would otherwise surface as one traceback per rank into one
:class:`~subnetdp.core.errors.ConfigError` naming the key, the value and the fix:

- :func:`check_run_dir`: ``run.dir`` can be created and written;
- :func:`check_batch_fits`: a batch fits into every rank's data shard;
- :func:`check_backend`: the communicator can run on this machine (``comm.name=nccl`` without CUDA).

:func:`finished_run` tells ``resume=auto`` that the run already did all its steps.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from subnetdp.core.errors import ConfigError

def check_run_dir(cfg: DictConfig) -> None:
    """``run.dir`` is (or can be made) a folder this process can write into."""
    raw = str(cfg.run.dir)
    where = Path(raw)
    fix = "choose a folder you can write to, e.g. run.dir=runs"
    if where.exists() and not where.is_dir():
        raise ConfigError("run.dir", raw, "is a file, not a folder", fix)
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".subnetdp-write-check-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError("run.dir", raw, f"cannot be written ({e.strerror or e})", fix) from None


def check_batch_fits(cfg: DictConfig, data: Any, world_size: int) -> None:
    """Every rank's shard holds at least one batch of ``train.batch_size``."""
    batch = int(cfg.train.batch_size)
    for rank in sorted({0, world_size - 1}):
        try:
            data.train_loader(rank, world_size, batch)
        except ValueError as e:
            raise ConfigError("train.batch_size", batch, f"too large for {world_size} rank(s) on data.name="
                              f"{cfg.data.name}: {e}",
                              "lower train.batch_size (it is per rank), or use fewer ranks") from None


def check_backend(cfg: DictConfig, registries: dict[str, Any], world_size: int) -> None:
    """The communicator can run ``world_size`` ranks here (e.g. CUDA and NCCL for ``comm.name=nccl``).

    A communicator declares what it needs of the launching machine with a ``check_machine(name)``
    class method (skipped for srun, whose workers run on other nodes than the launching one).
    """
    cls = registries["comm"].get(cfg.comm.name)
    cls.check_world_size(world_size)
    cls.check_machine(str(cfg.comm.name))


def finished_run(cfg: DictConfig) -> str | None:
    """With ``resume=auto``: a message when the run already finished ``train.steps`` (else None).

    Finished means its summary records ``train.steps`` steps; the run directory is left as it is.
    """
    if str(cfg.resume) != "auto" or not cfg.run.name:
        return None
    summary = Path(str(cfg.run.dir)) / str(cfg.run.name) / "summary.json"
    try:
        done = json.loads(summary.read_text())
    except (OSError, ValueError):
        return None
    steps = int(cfg.train.steps)
    if not isinstance(done, dict) or int(done.get("steps") or 0) < steps:
        return None
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in (done.get("eval") or {}).items())
    return (f"run {summary.parent} already finished its {done['steps']} steps ({summary}"
            + (f": {metrics}" if metrics else "") + "); nothing to do — raise train.steps to train further")

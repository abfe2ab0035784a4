"""Checks that run in the launching process, before any worker or process group exists.

Each turns a problem that would otherwise surface as one traceback per rank into one
:class:`~subnetdp.core.errors.ConfigError` naming the key, the value and the fix:

- :func:`check_run_dir`: ``run.dir`` can be created and written;
- :func:`check_batch_fits`: a batch fits into every rank's data shard;
- :func:`check_backend`: the communicator can run on this machine (``comm.name=nccl`` without CUDA,
  ``comm.device=cuda`` without a GPU);
- :func:`check_launcher`: the communicator can be started by the launcher (``comm.name=mpi`` needs
  mpirun, not ``launch.nproc=N``);
- :func:`check_new_run`: a new run does not start into a run directory that holds another run (its
  metrics, TensorBoard curves and summary would mix with the old ones); ``run.overwrite=true``
  deletes the old run first.

:func:`check_config` holds the rules across keys that belong here (``train.device`` against the
communicator's device, ``run.overwrite`` against ``resume``); :func:`~subnetdp.train.configure.load_config`
runs it for every command.

:func:`finished_run` tells ``resume=auto`` that the run already did all its steps; a ``summary.json``
that is not what a run writes (checked against :data:`SUMMARY`) is refused in one line.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from subnetdp.core import records
from subnetdp.core.errors import CheckpointError, ConfigError
from subnetdp.train import runlock

#: What :func:`finished_run` reads of a run's ``summary.json`` (the rest is for people and tools).
SUMMARY = records.Record({"steps": records.Int(0)},
                         optional={"eval": records.Nullable(records.MapOf(records.Str(), records.Number())),
                                   "flop_matched": records.Record({"steps_requested": records.Int(0),
                                                                   "steps": records.Int(0)})})


def check_run_dir(cfg: DictConfig) -> None:
    """``run.dir`` is (or can be made) a folder this process can write into."""
    raw = cfg.run.dir
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
    batch = cfg.train.batch_size
    for rank in sorted({0, world_size - 1}):
        try:
            data.train_loader(rank, world_size, batch)
        except ValueError as e:
            raise ConfigError("train.batch_size", batch, f"too large for {world_size} rank(s) on data.name="
                              f"{cfg.data.name}: {e}",
                              "lower train.batch_size (it is per rank), or use fewer ranks") from None


def check_config(cfg: DictConfig, registries: dict[str, Any]) -> None:
    """``train.device`` agrees with the communicator's device; ``run.overwrite`` deletes nothing that
    ``resume`` would continue from."""
    comm = registries["comm"].get(cfg.comm.name)
    device, kind = cfg.train.device, comm.device_type(cfg.comm)
    if device != "auto" and device != kind:
        fix = ("use comm.name=nccl for GPUs (comm.device=cuda with comm.name=mpi), or train.device=auto"
               if device == "cuda" else f"use train.device=auto, or a communicator that computes on {device}")
        raise ConfigError("train.device", device, f"comm.name={cfg.comm.name} computes on {kind}", fix)
    if not cfg.run.overwrite:
        return
    resume = cfg.resume
    if resume == "auto" or (resume != "never" and _inside(Path(resume), run_dir_of(cfg))):
        raise ConfigError("run.overwrite", True, f"would delete the run that resume={resume} continues from",
                          "drop run.overwrite to continue the run, or resume=never to start it again")


def check_backend(cfg: DictConfig, registries: dict[str, Any], world_size: int) -> None:
    """The communicator can run ``world_size`` ranks here (e.g. CUDA and NCCL for ``comm.name=nccl``).

    A communicator declares what it needs of the launching machine with a ``check_machine(name)``
    class method (skipped for srun, whose workers run on other nodes than the launching one); a
    communicator that computes on ``cuda`` needs a GPU whichever it is.
    """
    cls = registries["comm"].get(cfg.comm.name)
    cls.check_world_size(world_size)
    cls.check_machine(cfg.comm.name)
    if cls.device_type(cfg.comm) == "cuda":
        import torch

        if not torch.cuda.is_available():
            key, value = ("comm.device", "cuda") if "device" in cfg.comm else ("comm.name", cfg.comm.name)
            raise ConfigError(key, value, "computes on a CUDA GPU, but this machine has none visible "
                              "(torch.cuda.is_available() is False)", "train on CPUs with comm.name=gloo")


def check_launcher(cfg: DictConfig, registries: dict[str, Any], launcher: str, nproc: int) -> None:
    """The communicator's ranks can be started by ``launcher`` (``local``: ``launch.nproc=N``)."""
    registries["comm"].get(cfg.comm.name).check_launcher(launcher, nproc)


# --------------------------------------------------------------------------- the run directory

#: What a run writes into its directory; any of them means the directory holds a run.
RUN_FILES = ("config.yaml", "plan.json", "metrics.jsonl", "summary.json", "tensorboard", "checkpoints")


def run_dir_of(cfg: DictConfig) -> Path:
    return Path(cfg.run.dir) / cfg.run.name


def _inside(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def check_new_run(cfg: DictConfig, remove: bool = True) -> None:
    """Refuse to start a new run where another run's files are; with ``run.overwrite``, delete them.

    A directory is another run's when it holds any of :data:`RUN_FILES` and this run does not
    continue it: ``resume=never`` (or a checkpoint outside it), and not a restarted group of the job
    that wrote it (same torchrun run id). Call it before any worker starts, and where the workers of
    a launcher that checked already run, not at all (:func:`subnetdp.train.runlock.launcher_holds`).

    Args:
        cfg: the run config; does nothing without ``run.name`` (a made name is new).
        remove: whether this process deletes the old run for ``run.overwrite`` (rank 0 of a job, or
            its launcher; other ranks only refrain from refusing).
    """
    if not cfg.run.name:
        return
    run_dir = run_dir_of(cfg)
    found = [name for name in RUN_FILES if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    resume = cfg.resume
    if not found or resume == "auto" or (resume != "never" and _inside(Path(resume), run_dir)):
        return
    job = runlock.job_id()
    if job and runlock.lock_info(run_dir).get("job") == job:
        return  # torchrun restarted this job's group: its own first group wrote these files
    if not cfg.run.overwrite:
        raise ConfigError("run.name", cfg.run.name, f"{run_dir} already holds a run ({', '.join(found)}): a new "
                          "run there would mix its metrics, TensorBoard curves and summary with the old ones",
                          "continue it with resume=auto, choose another run.name, or set run.overwrite=true to "
                          "delete the old run first")
    if not remove:
        return
    runlock.check_free(run_dir)  # never delete the files of a live job
    for entry in sorted(run_dir.iterdir()):
        if entry.name == runlock.LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    print(f"subnetdp: run.overwrite=true: deleted the old run in {run_dir} ({', '.join(found)})", flush=True)


def finished_run(cfg: DictConfig) -> str | None:
    """With ``resume=auto``: a message when the run already finished its steps (else None).

    Finished means its summary records the steps this config trains: ``train.steps``, or with
    ``train.flop_matched`` the matched count the summary records for the same ``train.steps`` (the
    count is the plan's, known before set-up only from a run that asked for the same; a run that asked
    for other steps is not finished). The run directory is left as it is.
    """
    if cfg.resume != "auto" or not cfg.run.name:
        return None
    summary = Path(cfg.run.dir) / cfg.run.name / "summary.json"
    fix = f"the run's summary is damaged: delete {summary} (resume=auto then continues from the newest checkpoint)"
    try:
        done = records.read_json(summary)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # written atomically by the run: anything else is damage
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"{summary}: cannot be read as JSON ({first}): {fix}") from None
    records.check(SUMMARY, done, summary, fix)
    target = cfg.train.steps
    if cfg.train.flop_matched:
        matched = done.get("flop_matched")
        if matched is None or matched["steps_requested"] != cfg.train.steps:
            return None
        target = matched["steps"]
    if done["steps"] < target:
        return None
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in (done.get("eval") or {}).items())
    return (f"run {summary.parent} already finished its {done['steps']} steps ({summary}"
            + (f": {metrics}" if metrics else "") + "); nothing to do — raise train.steps to train further")

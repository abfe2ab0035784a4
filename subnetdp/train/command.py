"""``subnetdp train`` and ``subnetdp launch``: what each does once the command line is parsed.

Both make every check a job can fail before any worker or process group exists, then claim the run
directory (:func:`subnetdp.train.runlock.claim`: writable, no live job, no old run; held for the
workers where this process starts them), then train or start the workers. ``cli.py`` only parses.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Callable, Sequence

from omegaconf import DictConfig, OmegaConf

from subnetdp.core.config import Settings
from subnetdp.core.errors import ConfigError, PeerLost, SubnetdpError
from subnetdp.core.plugins import PluginManager
from subnetdp.train import runlock, upfront
from subnetdp.train.configure import load_config


def train_command(recipe: str | None, overrides: list[str], print_config: bool = False,
                  plugins_loaded: Callable[[], None] | None = None) -> int:
    """One training run in this process, or ``launch.nproc`` local workers when no launcher started it.
    ``plugins_loaded`` is called once the plugins are (the program's start-up imports are done)."""
    from subnetdp.launchers import detect

    pm = PluginManager()
    if plugins_loaded is not None:
        plugins_loaded()
    cfg = load_config(recipe, overrides, pm.registries)
    if print_config:
        from subnetdp.core.config import to_yaml

        print(to_yaml(cfg), end="")
        return 0
    env = detect()
    settings = Settings.from_config(cfg)  # the launching process reads its keys typed, from here on
    nproc = settings.launch.nproc
    if _already_finished(cfg, env):
        return 0
    if env.launcher == "none" and (nproc > 1 or settings.launch.nodes > 1):
        return _start_local_workers(cfg, settings, recipe, overrides, pm)
    if env.launcher != "none":
        from subnetdp.launchers.supervisor import check_supervised

        check_supervised(settings.launch.on_failure, env.launcher)  # every rank alike, before any process group
        from subnetdp.launchers.lifetime import worker_dies_with_launcher

        worker_dies_with_launcher()  # a killed launcher takes its workers with it
        if cfg.run.name and not runlock.launcher_holds(upfront.run_dir_of(cfg)):
            # Every rank sees the same files before any of them writes: all refuse alike (no process
            # group exists yet); only rank 0 deletes for run.overwrite.
            upfront.check_new_run(cfg, remove=env.rank == 0)
    else:
        upfront.check_run_dir(cfg)
        cfg = _named(cfg, 1)
        _claim(cfg)  # rank 0 takes the lock itself once its process group exists
    from subnetdp.train.failures import FailureLog
    from subnetdp.train.loop import train

    failures = FailureLog()
    try:
        train(cfg, env, pm, failures)
    except Exception as e:
        if failures.failure is None:  # before the run directory was this job's: as it is
            raise
        # One line; the traceback is in the run directory's log, which the line names.
        if isinstance(e, PeerLost):
            raise PeerLost(failures.failure.line, e.lost) from e
        raise SubnetdpError(failures.failure.line) from e
    return 0


def _claim(cfg, hold: bool = False):
    """:func:`runlock.claim` on this config's run directory."""
    return runlock.claim(upfront.run_dir_of(cfg), partial(upfront.check_new_run, cfg), cfg.run.dir, hold)


def _named(cfg: DictConfig, world_size: int) -> DictConfig:
    """``cfg`` with a ``run.name``: when it has none, a new config with the name made now from the config
    and the time (once, in the launching process), as if given on the command line, which is how the
    local workers receive it. ``cfg`` itself is not written."""
    from subnetdp.core.config import default_run_name

    if cfg.run.name:
        return cfg
    name = f"{default_run_name(cfg, world_size)}{time.strftime('-%Y%m%d-%H%M%S')}"
    return OmegaConf.merge(cfg, {"run": {"name": name}})  # type: ignore[return-value]


def _start_local_workers(cfg: DictConfig, settings: Settings, recipe: str | None, overrides: list[str], pm) -> int:
    """``subnetdp train launch.nproc=N``: every check, then the run directory's lock, then the workers."""
    from subnetdp.launchers.invocation import record_invocation
    from subnetdp.launchers.local import launch_local
    from subnetdp.train.setup import preflight

    launch, nproc = settings.launch, settings.launch.nproc
    if launch.replace and launch.on_failure != "continue":
        raise ConfigError("launch.replace", launch.replace,
                          "replaces dead workers of a job whose survivors go on in-process, but launch.on_failure="
                          f"{launch.on_failure}", "set launch.on_failure=continue, or launch.replace=0")
    continuing = launch.on_failure == "continue"
    if continuing and (launch.max_restarts or settings.comm.name != "gloo"):  # before the machine's checks: a
        # config that cannot go on in-process is refused as such on any machine (nccl with or without GPUs)
        wrong = [f"launch.max_restarts={launch.max_restarts}"] * bool(launch.max_restarts) + \
                [f"comm.name={settings.comm.name}"] * (settings.comm.name != "gloo")
        raise ConfigError("launch.on_failure", "continue", f"restarts nobody and re-forms gloo groups, but "
                          f"{' and '.join(wrong)}", "set launch.max_restarts=0 and comm.name=gloo, or "
                          "launch.on_failure=restart")
    upfront.check_launcher(cfg, pm.registries, "local", nproc)
    place = None
    if launch.nodes > 1 or launch.node_rank:
        from subnetdp.launchers.supervisor import place_of

        place = place_of(cfg)  # every refusal of a supervised job over several nodes, in one line each
    # Fail on a bad plan or machine here, before any worker or process group exists.
    preflight(cfg, nproc * launch.nodes, pm)
    given = bool(cfg.run.name)
    cfg = _named(cfg, nproc)
    argv = ["train"] + ([recipe] if recipe else []) + overrides + ([] if given else [f"run.name={cfg.run.name}"])
    # The lock is taken here, before any worker exists, and handed to the workers' rank 0: a second job
    # on this run directory stops at this line however soon after this one it was started.
    if place is not None and place.node > 0:
        # The lock is the job's, held by node 0's supervisor for its rank 0: the other nodes' workers
        # recognise the run directory as their job's by the run id the lock records (runlock.job_id).
        from contextlib import nullcontext

        runlock.check_writable(upfront.run_dir_of(cfg), cfg.run.dir)
        claimed = nullcontext()
    else:
        if place is not None:
            os.environ["TORCHELASTIC_RUN_ID"] = place.run_id  # recorded in the lock: the job every node's workers belong to
        claimed = _claim(cfg, hold=True)
    with claimed:
        record_invocation()  # the workers' resume commands name the program as it was started here
        if continuing:
            from subnetdp.launchers.supervisor import Place, launch_supervised
            from subnetdp.train.failures import LOGS, NATIVE_ENV

            where = "" if place is None else (f" of node {place.node} of {place.nodes}, ranks {place.node * nproc}-"
                                              f"{place.node * nproc + nproc - 1} (job store at {place.host}:{place.port})")
            print(f"starting {nproc} local workers{where} (subnetdp supervisor: a dead worker is not restarted, "
                  "the others go on)", flush=True)
            node = place.node if place is not None else 0  # its C++ side's warnings go to the run's logs/
            native = (None if os.environ.get(NATIVE_ENV) == "console" else
                      upfront.run_dir_of(cfg) / LOGS / f"supervisor_node{node}.stderr")
            return launch_supervised(nproc, argv, timeout_s=settings.comm.timeout_s, replacements=launch.replace,
                                     place=place or Place(), native_log=native)
        restarts = launch.max_restarts
        again = f", restarted up to {restarts} time(s) after a failure" if restarts else ""
        print(f"starting {nproc} local workers (torch elastic launcher, standalone rendezvous{again})", flush=True)
        return launch_local(nproc, argv, max_restarts=restarts, stop_timeout_s=launch.stop_timeout_s)


def _already_finished(cfg, env) -> bool:
    """``resume=auto`` on a run that did all its steps: say so (rank 0) and touch nothing."""
    message = upfront.finished_run(cfg)
    if message and env.rank == 0:
        print(f"subnetdp: {message}", flush=True)
    return message is not None


def launch_command(recipe: str | None, overrides: list[str], launcher: str, nproc: int, *, mpirun: str | None = None,
                   launcher_args: Sequence[str] = (), dry_run: bool = False, node_rank: int | None = None) -> int:
    """``subnetdp launch``: check the job at every world size it can take, claim the run directory, start it.

    ``overrides`` include the ``launch.*`` keys of the command line's node options (``--nnodes`` ...).
    """
    from subnetdp.launchers.command import run_launch
    from subnetdp.launchers.invocation import record_invocation
    from subnetdp.launchers.kinds import launcher_named
    from subnetdp.launchers.nodes import nodes_of
    from subnetdp.train.setup import preflight

    from subnetdp.launchers.supervisor import check_supervised

    kind = launcher_named(launcher)  # chosen once: what it decides is asked of it below
    pm = PluginManager()
    # launch.nproc of this launch: the local workers (the recipe's value would steer the thread checks)
    cfg = load_config(recipe, overrides + [f"launch.nproc={nproc}"], pm.registries)
    check_supervised(cfg.launch.on_failure, launcher)
    upfront.check_launcher(cfg, pm.registries, launcher, nproc)
    nodes = nodes_of(cfg, launcher, node_rank)
    # a bad config or plan fails here, before any worker starts (srun's workers run on other machines),
    # at every world size the job can take: an elastic job may shrink to its fewest nodes
    for world in nodes.worlds(nproc):
        try:
            preflight(cfg, world, pm, machine=kind.workers_here)
        except SubnetdpError as e:
            if not nodes.elastic:
                raise
            raise SubnetdpError(f"--nnodes {nodes.spec} x --nproc {nproc}: at {world} rank(s): {e}") from None
    args = ([recipe] if recipe else []) + overrides

    def start() -> int:
        record_invocation()  # the workers' resume commands name the program as it was started here
        return run_launch(launcher, nproc, args, mpirun, list(launcher_args), dry_run, nodes)

    if not cfg.run.name or dry_run:  # a made name is new; a dry run only prints
        return start()
    if nodes.several:
        # The lock is the job's: its rank 0 takes it wherever it runs. Only the first node checks
        # (another node starts while the job may already hold the directory).
        if not node_rank:
            _claim(cfg)
        return start()
    # torchrun on this node (--standalone): its workers descend from this process, which holds the lock;
    # mpirun's and srun's rank 0 may run on another node: the job's rank 0 takes the lock there.
    with _claim(cfg, hold=kind.workers_descend):
        return start()

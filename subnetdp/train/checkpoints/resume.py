"""Saving a running job's checkpoints and resuming from one.

The loop uses one :class:`Checkpointer`::

    ckpt = Checkpointer(run, optimizer, scheduler, loader)
    first = ckpt.start() + 1           # collective: resume (cfg.resume) or start fresh
    for step in range(first, steps + 1):
        ...the training step...
        ckpt.after_step(step)          # collective on save steps (checkpoint.every, the last step)

The inf/NaN guard that stops a run (leaving the last good checkpoint untouched) is the
synchroniser's: :class:`subnetdp.sdp.sync.NonFiniteGuard`.

Resuming restores parameters, buffers, optimizer and scheduler state, the data-loader position and
the RNG states, so a resumed run with the checkpoint's plan and world size is bit-identical to one
that was never interrupted. Checkpoints are keyed by unit (:mod:`subnetdp.train.checkpoints.units`),
so a run may also resume on another world size (``launch.nproc``, torchrun's ``--nproc-per-node``),
``masker.coverage``, ``masker.name``, seed or ``fsdp.shard_size``: the new plan is made and validated
as for a fresh run (a plan that leaves a unit unowned is refused before any process group exists,
naming the smallest coverage or world size that works), and each rank loads exactly its new units'
values and optimizer state. The data position carries over by samples seen:
:func:`~subnetdp.train.checkpoints.units.carry_position`. A checkpoint of another model or partition
(``masker.granularity``, ``masker.units_per_layer``) is refused.
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints import units
from subnetdp.core import config as config_mod
from subnetdp.core.errors import CheckpointError, ConfigError, SubnetdpError
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.local_steps import LocalStepsSynchronizer
from subnetdp.sdp.pieces import LocalIndex


def rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), numpy and Python RNG states, as tensors and ints."""
    _, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": torch.tensor(words, dtype=torch.int64),
             "python_gauss": gauss, "numpy": torch.from_numpy(keys.astype(np.int64)), "numpy_pos": int(pos),
             "numpy_gauss": [int(has_gauss), float(cached)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(int(x) for x in state["python"].tolist()), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_gauss"][0], state["numpy_gauss"][1]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def check_config(cfg: Any) -> None:
    """``resume`` and ``checkpoint.*`` across keys: ``resume`` is never, auto (with a fixed
    ``run.name``) or a checkpoint or run directory; a re-drawn plan is not resumable; and neither a
    final checkpoint nor a resume is asked of a run that writes no checkpoints."""
    resume = str(cfg.resume)
    if resume not in ("never", "auto"):
        p = Path(resume)
        if not resume.strip() or not ((p / ck.MANIFEST).is_file() or (p / "checkpoints").is_dir()):
            raise ConfigError("resume", resume, "is neither never, auto, a checkpoint (a folder holding MANIFEST.json) "
                              "nor a run directory (holding checkpoints/)",
                              "use resume=auto, or the path of a checkpoints/step_XXXXXXXX directory")
    if resume != "never" and int(cfg.masker.resample_every) > 0:
        raise ConfigError("resume", resume, f"runs whose plan is re-drawn (masker.resample_every="
                          f"{cfg.masker.resample_every}) cannot be resumed in this release",
                          "use resume=never, or masker.resample_every=0")
    if resume == "auto" and not cfg.run.name:
        raise ConfigError("resume", "auto", "needs a fixed run.name, so a restarted job finds its run directory",
                          "add run.name=NAME (the same on every start)")
    if cfg.checkpoint.enabled:
        return
    if resume == "auto":  # it would find no checkpoint of its own, and so start over on every restart
        raise ConfigError("resume", "auto", "finds the run's newest checkpoint, but checkpoint.enabled=false writes "
                          "none, so every restart would start over", "set checkpoint.enabled=true, or resume=never")
    if str(cfg.checkpoint.final) == "always":
        raise ConfigError("checkpoint.final", "always", "asks for a final checkpoint, but checkpoint.enabled=false "
                          "writes none", "set checkpoint.enabled=true, or checkpoint.final=auto")


AUTO_FINAL_MIN_STEPS = 1000  # checkpoint.final=auto: runs this long keep their final checkpoint


def final_wanted(cfg: Any) -> bool:
    """Whether the checkpoint after the last step is written (``checkpoint.final``).

    ``auto`` writes it when the run asked for checkpoints (``checkpoint.every > 0``), can be
    resumed (``resume`` is not ``never``) or is long (``train.steps >= AUTO_FINAL_MIN_STEPS``):
    a short trial keeps its summary and metrics but not a full copy of its weights and optimizer
    state, so 25 short trials do not fill a disk. ``always`` / ``never`` decide it outright.
    """
    final = str(cfg.checkpoint.final)
    if final != "auto":
        return final == "always"
    return (int(cfg.checkpoint.every) > 0 or str(cfg.resume) != "never"
            or int(cfg.train.steps) >= AUTO_FINAL_MIN_STEPS)


class Checkpointer:
    """Saves this rank's part of every checkpoint and restores it on resume, under any plan.

    Args:
        run: the :class:`~subnetdp.core.contracts.Run` (model, plan, partition, comm, config, run_dir).
        optimizer, scheduler, loader: the state that is saved besides the tensors.
    """

    def __init__(self, run: Any, optimizer: torch.optim.Optimizer, scheduler: Any, loader: Any) -> None:
        self.run, self.optimizer, self.scheduler, self.loader = run, optimizer, scheduler, loader
        self.cfg, self.comm, self.rank = run.cfg, run.comm, run.rank
        self.run_id = ""
        self.last_saved: Path | None = None

    # ------------------------------------------------------------------ local tensors
    def _outer(self) -> dict[str, dict[str, torch.Tensor]]:
        """Local-steps outer state: prefix -> local parameter name -> tensor of its local shape."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        if isinstance(self.run.averager, LocalStepsSynchronizer):
            for prefix, name, t in self.run.averager.outer_tensors():
                out.setdefault(prefix, {})[name] = t
        return out

    def _per_owner(self) -> bool:
        """Whether owners' copies of a piece differ, so every owner writes its own (local steps)."""
        return isinstance(self.run.averager, LocalStepsSynchronizer)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _local_names(self) -> list[str]:
        """The local name of every optimizer parameter, in the optimizer's order (outside gathered())."""
        names = {id(t): n for n, t in self.run.model.named_parameters()}
        return [names[id(p)] for p in self._params()]

    # ------------------------------------------------------------------ saving
    def after_step(self, step: int) -> None:
        """Save when ``checkpoint.every`` divides ``step`` and after the last step. Collective then."""
        every, last = int(self.cfg.checkpoint.every), int(self.cfg.train.steps)
        if self.cfg.checkpoint.enabled and ((step == last and final_wanted(self.cfg)) or (every and step % every == 0)):
            self.save(step)
        ck.fault_point(ck.KILL_AT_STEP, step, self.rank, self.run.run_dir)

    def save(self, step: int) -> Path:
        """Write checkpoint ``step``: every rank its pieces and own files, then rank 0 the plan,
        config and manifest (with the index of every piece)."""
        run, comm = self.run, self.comm
        final = ck.step_dir(run.run_dir, step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if tmp.exists() or tmp.is_symlink():  # a link is unlinked, never followed
                ck.remove_checkpoint(tmp)
            tmp.mkdir(parents=True)
        comm.barrier()  # collective: the temporary directory exists before anyone writes into it
        names = self._local_names()
        # collective when sharded: the optimizer state of each parameter is gathered over its shard group.
        full_state = run.parallel.optimizer_state_full(self.optimizer)
        optim_state = dict(zip(names, full_state))
        with run.parallel.gathered():  # collective when sharded: each rank writes from its replica's full tensors
            index = LocalIndex(run.model, run.pmap)
            pieces = units.pieces_to_write(self.rank, run.partition, run.plan, index, self._outer(), optim_state,
                                           per_owner=self._per_owner())
            buffers = units.buffers_to_write(self.rank, run.partition, run.plan, index)
            files = self._write_rank_files(tmp, step, pieces, buffers)
        del full_state, optim_state, pieces
        # collective: every rank's files are on disk (fsynced) before the manifest names them.
        everyone = comm.all_gather_object(files)
        if self.rank == 0:
            for f in everyone:
                files.update(f)
            files["plan.json"] = ck.write_text_atomic(tmp / "plan.json", run.plan.to_json(run.partition))
            files["config.yaml"] = ck.write_text_atomic(tmp / "config.yaml", config_mod.to_yaml(self.cfg))
            spec = run.spec
            manifest = {"format": ck.FORMAT, "run_id": self.run_id, "step": step, "world_size": comm.world_size,
                        "plan_digest": run.plan.digest(), "fsdp_shard_size": int(self.cfg.fsdp.shard_size),
                        "partition_digest": units.partition_digest(run.partition),
                        "partition": {"granularity": run.partition.granularity, "units": len(run.partition.units),
                                      "units_per_layer": int(self.cfg.masker.units_per_layer)},
                        "config_digest": config_mod.digest(self.cfg),
                        "model": OmegaConf.to_container(self.cfg.model, resolve=True),
                        "data_spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
                        "reference": run.adapter.reference_options(spec),
                        "files": dict(sorted(files.items())),
                        "pieces": units.piece_index(run.partition, run.plan, self._per_owner())}
            ck.finish_directory(tmp, final, manifest)
            ck.prune(run.run_dir, int(self.cfg.checkpoint.keep), final)
        comm.barrier()  # collective: no rank runs ahead of a checkpoint that is not complete yet
        self.last_saved = final
        return final

    def _write_rank_files(self, tmp: Path, step: int, pieces: dict[str, torch.Tensor],
                          buffers: dict[str, torch.Tensor]) -> dict[str, Any]:
        meta = {"format": ck.FORMAT, "run_id": self.run_id, "step": str(step),
                "world_size": str(self.comm.world_size), "plan_digest": self.run.plan.digest()}
        out = {}
        if pieces:  # a rank may own nothing another owner does not write
            name = ck.pieces_file(self.rank)
            out[name] = ck.write_atomic(tmp / name, lambda p: ck.save_safetensors(
                p, pieces, {**meta, "writer": str(self.rank)}))
        st_name, state_name = ck.rank_files(self.rank)
        out[st_name] = ck.write_atomic(tmp / st_name, lambda p: ck.save_safetensors(
            p, buffers, {**meta, "rank": str(self.rank)}))
        optim = self.optimizer.state_dict()
        state = {"format": ck.FORMAT, "step": step, "run_id": self.run_id, "rank": self.rank,
                 "world_size": self.comm.world_size, "batch_size": int(self.cfg.train.batch_size),
                 "optimizer": {"class": type(self.optimizer).__name__,
                               "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                for g in optim["param_groups"]]},
                 "scheduler": self.scheduler.state_dict(), "loader": self.loader.state_dict(), "rng": rng_state()}
        if isinstance(self.run.averager, LocalStepsSynchronizer):  # inner steps skipped in this cycle so far
            state["local_steps_nonfinite"] = self.run.averager.nonfinite.clone()
        out[state_name] = ck.write_atomic(tmp / state_name, lambda p: torch.save(state, str(p)),
                                          fault=(step, self.rank))
        return out

    # ------------------------------------------------------------------ resuming
    def start(self) -> int:
        """Resume per ``cfg.resume`` (``never``, ``auto``, a path); returns the step to continue after.

        Collective: rank 0 chooses the checkpoint and the run id, every rank loads its own pieces,
        and any rank's failure stops every rank with that rank's message.
        """
        choice: dict[str, Any] = {"path": None, "run_id": uuid.uuid4().hex, "error": None}
        if self.rank == 0:
            try:
                ck.checkpoints_dir(self.run.run_dir)  # a link there is refused before any step is trained
                path = self._choose()
                if path is not None:
                    choice.update(path=str(path), run_id=ck.read_manifest(path)["run_id"])
            except SubnetdpError as e:
                choice["error"] = str(e)
        choice = self.comm.all_gather_object(choice)[0]  # collective: rank 0's choice wins
        if choice["error"]:
            raise CheckpointError(choice["error"])
        self.run_id = choice["run_id"]
        if choice["path"] is None:
            return 0
        error, step, replanned = None, 0, False
        try:
            step, replanned = self._load(Path(choice["path"]))
        except SubnetdpError as e:
            error = f"rank {self.rank}: {e}"
        errors = [e for e in self.comm.all_gather_object(error) if e]  # collective: all load or none goes on
        if errors:
            raise CheckpointError("; ".join(errors))
        if self.rank == 0:
            how = " on a new plan (re-planned: each rank loaded its new units)" if replanned else ""
            print(f"resumed from {choice['path']} (step {step}){how}", flush=True)
        return step

    def _choose(self) -> Path | None:
        resume = str(self.cfg.resume)
        if resume == "never":
            return None
        if resume == "auto":
            return ck.latest_checkpoint(self.run.run_dir)
        return ck.resolve_checkpoint(Path(resume))

    def _load(self, path: Path) -> tuple[int, bool]:
        """Load this rank's pieces; returns the checkpoint's step and whether the plan changed."""
        run, world = self.run, self.comm.world_size
        manifest = ck.read_manifest(path)
        self._check_compatible(path, manifest)
        old_plan = read_plan(path, manifest)
        old_world = int(manifest["world_size"])
        same_plan = old_world == world and manifest["plan_digest"] == run.plan.digest()
        state_name = ck.rank_files(self.rank if old_world == world else 0)[1]
        state = ck.read_state(ck.verify_file(path, state_name, manifest))
        reader = units.PieceReader(path, manifest)
        names = self._local_names()
        # collective when sharded: full tensors in, cut back into this rank's shards on exit.
        with torch.no_grad(), run.parallel.gathered(writeback=True):
            index = LocalIndex(run.model, run.pmap)
            outer = self._outer()
            optim_state, found_outer = units.load_pieces(reader, self.rank, run.partition, run.plan, index, outer,
                                                         own=same_plan)
            units.load_buffers(reader, self.rank, run.partition, run.plan, index, old_plan, own=same_plan)
            # A checkpoint written with per-step synchronisation has no outer state (a cycle starts here),
            # one written with sync.outer_momentum=0 no outer momentum (it starts at zero).
            local = run.averager if isinstance(run.averager, LocalStepsSynchronizer) else None
            if local is not None and "outer_anchor/" not in found_outer:
                local.restart_cycle()
        if local is not None and "local_steps_nonfinite" in state:
            if tuple(state["local_steps_nonfinite"].shape) == tuple(local.nonfinite.shape):
                local.nonfinite.copy_(state["local_steps_nonfinite"])
        self._load_optimizer(path / state_name, state, names, optim_state)
        where = path / state_name
        try:
            self.scheduler.load_state_dict(state["scheduler"])
            batch = int(self.cfg.train.batch_size)
            if old_world == world and int(state.get("batch_size", batch)) == batch:
                self.loader.load_state_dict(state["loader"])
                set_rng_state(state["rng"])
            else:
                self.loader.load_state_dict(units.carry_position(
                    state["loader"], (old_world, int(state.get("batch_size", batch))), (world, batch),
                    self.loader.batches_per_epoch))
                reseed(int(self.cfg.seed) + int(manifest["step"]))
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"{where}: its state does not fit this run ({e})") from None
        return int(manifest["step"]), not same_plan

    def _load_optimizer(self, where: Path, state: dict[str, Any], names: list[str],
                        optim_state: dict[str, dict[str, torch.Tensor]]) -> None:
        saved = state.get("optimizer")
        if not isinstance(saved, dict) or saved.get("class") != type(self.optimizer).__name__:
            found = saved.get("class") if isinstance(saved, dict) else None
            raise CheckpointError(f"{where}: optimizer {found}, this run uses {type(self.optimizer).__name__}: "
                                  "use the same optim.name or start a new run")
        groups = saved["param_groups"]
        mine = self.optimizer.state_dict()["param_groups"]
        if len(groups) != len(mine):
            raise CheckpointError(f"{where}: {len(groups)} optimizer parameter groups, this run has {len(mine)}")
        sd = {"state": {i: optim_state[n] for i, n in enumerate(names) if n in optim_state},
              "param_groups": [{**g, "params": m["params"]} for g, m in zip(groups, mine)]}
        try:
            self.optimizer.load_state_dict(sd)
            self.run.parallel.optimizer_state_from_full(self.optimizer)
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"{where}: its optimizer state does not fit this run ({e})") from None

    def _check_compatible(self, path: Path, manifest: dict[str, Any]) -> None:
        """What a resume must keep: the model and its partition. World size, plan (coverage, masker,
        seed) and fsdp.shard_size may change: every piece is keyed by the partition alone."""
        run = self.run
        where = path / ck.MANIFEST
        model = OmegaConf.to_container(self.cfg.model, resolve=True)
        if manifest["model"] != model:
            raise CheckpointError(f"{where}: written for model {manifest['model']}, this run trains {model}: "
                                  "use the same model.* settings or start a new run")
        if manifest.get("partition_digest") != units.partition_digest(run.partition):
            part = manifest.get("partition", {})
            raise CheckpointError(
                f"{where}: written for a partition of {part.get('units')} {part.get('granularity')}-level units "
                f"(masker.units_per_layer={part.get('units_per_layer')}), this run cuts the model into "
                f"{len(run.partition.units)} {run.partition.granularity}-level units: a resume may change the "
                "world size, coverage, masker and seed, not the units; use the checkpoint's masker.granularity "
                "and masker.units_per_layer, or start a new run")
        resample = int(self.cfg.masker.get("resample_every", 0) or 0)
        if resample > 0 and (manifest["plan_digest"] != run.plan.digest() or manifest["world_size"] != run.plan.world_size):
            # The run's plan at set-up is the family's base plan, not the one re-drawn by the step saved.
            raise CheckpointError(f"{where}: written under mask plan {manifest['plan_digest']} (re-drawn by "
                                  f"masker.resample_every={resample}), this run starts from plan {run.plan.digest()}: "
                                  "a run with re-drawn plans resumes only from a checkpoint of its base plan; "
                                  "resume with masker.resample_every=0 to re-plan from this checkpoint")


def check_resume_source(cfg: Any) -> None:
    """Read and check the manifest of the checkpoint ``resume`` would load, if any.

    Runs before any process group exists (in the launching process and on every rank before it
    meets the others), so a damaged or crafted manifest stops the job in one line there, not after
    the world has assembled. Rank 0 still chooses the checkpoint inside the job
    (:meth:`Checkpointer.start`); this only reads what it would find.
    """
    resume = str(cfg.resume)
    if resume == "never":
        return
    if resume == "auto":
        path = ck.latest_checkpoint(Path(str(cfg.run.dir)) / str(cfg.run.name)) if cfg.run.name else None
    else:
        path = ck.resolve_checkpoint(Path(resume))
    if path is not None:
        ck.read_manifest(path)


def read_plan(path: Path, manifest: dict[str, Any]) -> MaskPlan:
    """The checkpoint's ``plan.json``, checked against the manifest."""
    f = ck.verify_file(path, "plan.json", manifest)
    try:
        plan = MaskPlan.from_dict(json.loads(f.read_text(encoding="utf-8")))
    except (SubnetdpError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f}: not a valid mask plan ({e})") from None
    if plan.digest() != manifest["plan_digest"] or plan.world_size != manifest["world_size"]:
        raise CheckpointError(f"{f}: does not match {ck.MANIFEST} (plan digest or world size)")
    return plan


def seed_host_rngs(seed: int) -> None:
    """Python's and numpy's global random states from ``seed`` (saved in checkpoints, so they must agree
    between two runs of the same seed)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)


def reseed(seed: int) -> None:
    """Host RNGs of a rank whose old stream has no counterpart (a resume on another world size)."""
    seed_host_rngs(seed)
    torch.manual_seed(seed)


def json_dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"))

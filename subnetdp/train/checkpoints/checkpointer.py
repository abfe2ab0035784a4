"""Saving a running job's checkpoints and resuming from one.

The loop uses one :class:`Checkpointer`::

    ckpt = Checkpointer(context, state, loader)
    first = ckpt.start() + 1           # collective: resume (cfg.resume) or start fresh
    for step in range(first, steps + 1):
        ...the training step...
        ckpt.after_step(step)          # collective on save steps (checkpoint.every, the last step)

It holds no model: what it saves is read from the training state at the time, so a re-planned
state needs nothing patched here: the model's pieces under the plan, and a mapping of Stateful
components (:func:`~subnetdp.train.checkpoints.source.checkpoint_states`: optimizer, schedule,
synchroniser, loader, host RNGs), each asked for its ``state_dict()`` and handed it back on a resume,
as torchtitan's ``CheckpointManager(states={...})`` does.
Resuming is a re-plan of the state from the checkpoint
(:class:`~subnetdp.train.checkpoints.source.CheckpointPieces`).

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

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from subnetdp.core import config as config_mod
from subnetdp.core.contracts import RunContext
from subnetdp.core.errors import CheckpointError, ConfigError, PeerLost, SubnetdpError
from subnetdp.sdp.pieces import LocalIndex, global_items
from subnetdp.train import faults
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints import lineage, survivors, units
from subnetdp.train.checkpoints.unlogged import Carried, Unlogged, carried
from subnetdp.train.checkpoints.source import (RANK_FILE_KEYS, CheckpointPieces, checkpoint_states, local_names,
                                               rng_state)

if TYPE_CHECKING:
    from subnetdp.train.state import TrainState

def check_config(cfg: Any) -> None:
    """``resume`` and ``checkpoint.*`` across keys: ``resume`` is never, auto (with a fixed
    ``run.name``) or a checkpoint or run directory; a re-drawn plan is not resumable; and neither a
    final checkpoint nor a resume is asked of a run that writes no checkpoints."""
    resume = cfg.resume
    if resume not in ("never", "auto"):
        p = Path(resume)
        if not resume.strip() or not ((p / ck.MANIFEST).is_file() or (p / "checkpoints").is_dir()):
            raise ConfigError("resume", resume, "is neither never, auto, a checkpoint (a folder holding MANIFEST.json) "
                              "nor a run directory (holding checkpoints/)",
                              "use resume=auto, or the path of a checkpoints/step_XXXXXXXX directory")
    if resume != "never" and cfg.masker.resample_every > 0:
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
    if cfg.checkpoint.final == "always":
        raise ConfigError("checkpoint.final", "always", "asks for a final checkpoint, but checkpoint.enabled=false "
                          "writes none", "set checkpoint.enabled=true, or checkpoint.final=auto")


AUTO_FINAL_MIN_STEPS = 1000  # checkpoint.final=auto: runs this long keep their final checkpoint


def final_wanted(cfg: Any, steps: int | None = None) -> bool:
    """Whether the checkpoint after the last step is written (``checkpoint.final``).

    ``auto`` writes it when the run asked for checkpoints (``checkpoint.every > 0``), can be
    resumed (``resume`` is not ``never``) or is long (``steps``, the steps trained, else ``train.steps``,
    ``>= AUTO_FINAL_MIN_STEPS``): a short trial keeps its summary and metrics but not a full copy of its
    weights and optimizer state, so 25 short trials do not fill a disk. ``always`` / ``never`` decide it.
    """
    final = cfg.checkpoint.final
    if final != "auto":
        return final == "always"
    return (cfg.checkpoint.every > 0 or cfg.resume != "never"
            or (cfg.train.steps if steps is None else steps) >= AUTO_FINAL_MIN_STEPS)


class Checkpointer:
    """Saves this rank's part of every checkpoint and resumes from one, under any plan.

    It holds no model: the model, plan, optimizer, schedule and synchroniser are read from the
    training state when a checkpoint is written, so a re-planned state needs nothing patched here.

    Args:
        ctx: the run context (config, communicator, run directory).
        state: the training state.
        loader: the training loader, whose position is saved and restored.
    """

    def __init__(self, ctx: RunContext, state: "TrainState", loader: Any) -> None:
        self.ctx, self.state, self.loader = ctx, state, loader
        self.cfg, self.comm, self.rank = ctx.cfg, ctx.comm, ctx.rank
        # The world this rank's files describe: a survivor that takes today's path after a re-formation
        # failed still writes its fragment under the numbering its units were trained in.
        self.world_size = ctx.comm.world_size
        self.run_id = ""
        self.lineage: list[dict[str, Any]] = []
        self.last_saved: Path | None = None
        self._boundary: tuple[int, Any, Any, dict[str, torch.Tensor]] | None = None
        self._persistent: tuple[Any, set[str]] = (None, set())
        self.unlogged = Unlogged()  # this rank's losses no log row holds yet (a survivor keeps them)
        self.carried: Carried | None = None  # rank 0, resumed from survivors: the losses its log owes
        self.resumed: Path | None = None  # the checkpoint the run resumed from (every rank)
        self.consumed: Any = None  # the reporter's: step -> [step, samples or tokens seen, FLOPs], into each manifest

    def _local_names(self) -> list[str]:
        """The local name of every optimizer parameter, in the optimizer's order (outside gathered())."""
        return local_names(self.state.model, self.state.optimizer)

    def _state_dicts(self, position: tuple[Any, Any] | None = None) -> dict[str, dict[str, Any]]:
        """Every component's ``state_dict()`` (:func:`~subnetdp.train.checkpoints.source.checkpoint_states`),
        the loader's and RNGs' ``position`` instead when given (a survivor's, of the last finished step).
        Collective when sharded: the optimizer's state is gathered over each shard group (outside gathered())."""
        out = {name: component.state_dict() for name, component in checkpoint_states(self.state, self.loader).items()
               if not (position and name in ("loader", "rng")) and name != "model"}  # its views: inside gathered()
        if position:
            out["loader"], out["rng"] = position
        return out

    # ------------------------------------------------------------------ saving
    def after_step(self, step: int) -> None:
        """Save when ``checkpoint.every`` divides ``step`` and after the last step. Collective then."""
        every, last = self.cfg.checkpoint.every, self.ctx.steps
        if self.cfg.checkpoint.enabled and ((step == last and final_wanted(self.cfg, last)) or (every and step % every == 0)):
            self.save(step)
        faults.fault_point(faults.KILL_AT_STEP, step, self.rank, self.ctx.run_dir)

    def save(self, step: int) -> Path:
        """Write checkpoint ``step``: every rank its pieces and own files, then rank 0 the plan,
        config and manifest (with the index of every piece)."""
        ctx, state, comm = self.ctx, self.state, self.comm
        plan, partition, sync = state.plan, state.partition, state.synchronizer
        final = ck.step_dir(ctx.run_dir, step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if tmp.exists() or tmp.is_symlink():  # a link is unlinked, never followed
                ck.remove_checkpoint(tmp)
            tmp.mkdir(parents=True)
        comm.barrier()  # collective: the temporary directory exists before anyone writes into it
        # collective when sharded: the optimizer state of each parameter is gathered over its shard group.
        states = self._state_dicts()
        with state.parallel.gathered(state.model):  # collective when sharded: each rank writes from its replica's full tensors
            index, model = LocalIndex(state.model, state.pmap), state.stateful()["model"].state_dict()
            pieces = units.pieces_to_write(self.rank, partition, plan, index, states["sync"]["pieces"],
                                           states["optimizer"]["params"], sync.owners_diverge, model["params"])
            buffers = units.buffers_to_write(self.rank, partition, plan, index, model["buffers"])
            files = self._write_rank_files(tmp, step, pieces, buffers, states)
        del states, pieces
        # collective: every rank's files are on disk (fsynced) before the manifest names them.
        everyone = comm.all_gather_object(files)
        if self.rank == 0:
            for f in everyone:
                files.update(f)
            files["plan.json"] = ck.write_text_atomic(tmp / "plan.json", plan.to_json(partition))
            files["config.yaml"] = ck.write_text_atomic(tmp / "config.yaml", config_mod.to_yaml(self.cfg))
            manifest = {**self._header(step), "files": dict(sorted(files.items())),
                        "pieces": units.piece_index(partition, plan, sync.owners_diverge)}
            ck.finish_directory(tmp, final, manifest)
            ck.prune(ctx.run_dir, self.cfg.checkpoint.keep, final)
            survivors.prune_superseded(ctx.run_dir)  # a survivor's files older than this step are of no use
        comm.barrier()  # collective: no rank runs ahead of a checkpoint that is not complete yet
        self.last_saved = final
        return final

    def _header(self, step: int) -> dict[str, Any]:
        """What a manifest says besides its files and pieces (a survivor's fragment carries it too)."""
        ctx, state, cfg = self.ctx, self.state, self.cfg
        plan, partition, spec = state.plan, state.partition, ctx.spec
        return {"format": ck.FORMAT, "run_id": self.run_id, "lineage": self.lineage, "step": step,
                "world_size": self.world_size, "plan_digest": plan.digest(), "fsdp_shard_size": cfg.fsdp.shard_size,
                "partition_digest": units.partition_digest(partition),
                "partition": {"granularity": partition.granularity, "units": len(partition.units),
                              "units_per_layer": cfg.masker.units_per_layer}, "config_digest": config_mod.digest(cfg),
                "model": OmegaConf.to_container(cfg.model, resolve=True),
                "data_spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
                "reference": ctx.adapter.reference_options(spec), "consumed": self.consumed and self.consumed(step)}

    def _write_rank_files(self, tmp: Path, step: int, pieces: dict[str, torch.Tensor],
                          buffers: dict[str, torch.Tensor], states: dict[str, dict[str, Any]]) -> dict[str, Any]:
        state = self.state
        meta = {"format": ck.FORMAT, "run_id": self.run_id, "step": str(step),
                "world_size": str(self.world_size), "plan_digest": state.plan.digest()}
        out = {}
        if pieces:  # a rank may own nothing another owner does not write
            name = ck.pieces_file(self.rank)
            out[name] = ck.write_atomic(tmp / name, lambda p: ck.save_safetensors(
                p, pieces, {**meta, "writer": str(self.rank)}))
        st_name, state_name = ck.rank_files(self.rank)
        out[st_name] = ck.write_atomic(tmp / st_name, lambda p: ck.save_safetensors(
            p, buffers, {**meta, "rank": str(self.rank)}))
        saved = {"format": ck.FORMAT, "step": step, "run_id": self.run_id, "rank": self.rank,
                 "world_size": self.world_size, "batch_size": self.cfg.train.batch_size, **rank_file_entries(states)}
        out[state_name] = ck.write_atomic(tmp / state_name, lambda p: torch.save(saved, str(p)),
                                          fault=(step, self.rank))
        return out

    # ------------------------------------------------------------------ recovery from the survivors
    def recoverable(self) -> str | None:
        """Why this run cannot write survivors' files, or None when it can."""
        cfg = self.cfg
        if not cfg.checkpoint.enabled:
            return "checkpoint.enabled=false"
        if not cfg.checkpoint.survivors:
            return "checkpoint.survivors=false"
        if cfg.masker.resample_every > 0:
            return f"masker.resample_every={cfg.masker.resample_every} (re-drawn plans are not resumable)"
        if self.state.parallel.sharded:
            return "fsdp.shard_size > 1 (a shard's optimizer state is gathered by a collective)"
        return None

    def mark_finished(self, step: int, loss: float | None = None) -> None:
        """Remember what a survivor's files need of ``step``, the last step this rank finished: the data
        position, the RNG states and the buffers (the next step's forward changes them before any of
        its collectives can fail), and this rank's ``loss`` until a log row holds it (:meth:`mark_logged`).
        Cheap: two integers, the RNG states and the buffers' values. Kept too when the survivors can
        go on in-process (the communicator can re-form the world), whatever the checkpoint settings."""
        if self.recoverable() is not None and not getattr(self.comm, "can_regroup", False):
            return
        self.unlogged.note(step, loss)
        persistent = self._persistent_buffers()
        buffers = {n: b.detach().clone() for n, b in self.state.model.named_buffers() if n in persistent}
        self._boundary = (step, self.loader.state_dict(), rng_state(), buffers)

    def mark_logged(self, step: int) -> None:
        """A log row holds the losses of every step up to ``step`` (after the reporter's log step)."""
        self.unlogged.logged(step)

    def _persistent_buffers(self) -> set[str]:
        model = self.state.model
        if self._persistent[0] is not model:
            self._persistent = (model, set(model.state_dict()))
        return self._persistent[1]

    def survive(self, error: PeerLost) -> PeerLost:
        """A peer is gone: write this rank's units as of the last step it finished, without any
        collective, and return the error to leave with (what was lost, what was kept); the console
        line adds the rank, the step and what to do (:mod:`subnetdp.train.failures`)."""
        reason = self.recoverable()
        progress, boundary = self.state.progress, self._boundary
        if reason is None and progress.updated and not progress.settled:
            reason = f"its values were between step {progress.step}'s update and its local-steps synchronisation"
        if reason is None and not progress.updated and boundary is None:
            reason = "no step had finished yet"
        if reason is not None:
            return PeerLost(f"{error}; it kept no units ({reason}), so the run resumes from its newest checkpoint",
                            error.lost)
        step, position = self.rewind()
        try:
            path = self._write_fragment(step, position, set(error.lost))
        except (OSError, SubnetdpError) as e:
            return PeerLost(f"{error}; it could not keep its units ({e}), so the run resumes from its newest "
                            "checkpoint", error.lost)
        return PeerLost(f"{error}; it kept its units as of step {step} in {path}", error.lost)

    @torch.no_grad()
    def rewind(self) -> tuple[int, tuple[Any, Any] | None]:
        """The last step this rank finished, and the loader position and RNG states as it ended (None:
        as they stand). A step in progress that passed its update is that step, as the state stands;
        otherwise the last boundary (:meth:`mark_finished`), with the buffers put back as it ended (the
        next step's forward moved them). Needs a finished step: one updated, or a boundary."""
        progress, boundary = self.state.progress, self._boundary
        if progress.updated and (boundary is None or boundary[0] != progress.step):
            return progress.step, None
        assert boundary is not None
        for name, b in self.state.model.named_buffers():
            if name in boundary[3]:
                b.copy_(boundary[3][name])
        return boundary[0], boundary[1:3]

    @torch.no_grad()
    def _write_fragment(self, step: int, position: tuple[Any, Any] | None, lost: set[int]) -> Path:
        """This rank's fragment of ``step``: of every piece it owns, those no lower-ranked owner outside
        ``lost`` (the ranks this rank knows to be dead) writes, so each surviving unit is written about
        once, with no collective to agree who writes (a co-owner that died unnoticed costs that unit's
        recovery: the run falls back to its newest checkpoint). When no dead rank is known (the store
        went with the job), or under local steps (owners' copies differ), every piece it owns. Its
        buffers, state, plan and config in any case."""
        state, ctx = self.state, self.ctx
        plan, partition, sync, model = state.plan, state.partition, state.synchronizer, state.model
        tmp = survivors.fragment_tmp(ctx.run_dir, step, self.rank)
        states = self._state_dicts(position)
        index, values = LocalIndex(model, state.pmap), state.stateful()["model"].state_dict()
        # Not the pieces it writes in a regular checkpoint: their writer may be the dead rank.
        held = {units.item_key(it) for it in global_items(partition, plan) if self.rank in it.owners
                and (sync.owners_diverge or not lost or self.rank == min(set(it.owners) - lost))}
        pieces = units.pieces_to_write(self.rank, partition, plan, index, states["sync"]["pieces"],
                                       states["optimizer"]["params"], True, values["params"])
        pieces = {k: v for k, v in pieces.items() if k.split("/", 1)[-1] in held}
        buffers = units.buffers_to_write(self.rank, partition, plan, index, values["buffers"])
        files = self._write_rank_files(tmp, step, pieces, buffers, states)
        files["plan.json"] = ck.write_text_atomic(tmp / "plan.json", plan.to_json(partition))
        files["config.yaml"] = ck.write_text_atomic(tmp / "config.yaml", config_mod.to_yaml(self.cfg))
        return survivors.write_fragment(ctx.run_dir, self._header(step), self.rank, files, sorted(held),
                                        units.piece_index(partition, plan, sync.owners_diverge),
                                        self.unlogged.upto(step, state.progress))

    # ------------------------------------------------------------------ resuming
    def start(self) -> int:
        """Resume per ``cfg.resume`` (``never``, ``auto``, a path); returns the step to continue after.

        Resuming re-plans the state from the checkpoint (:class:`~subnetdp.train.checkpoints.source.CheckpointPieces`),
        on the run's own plan. Collective: rank 0 chooses the checkpoint, the run id and the lineage,
        every rank loads its own pieces, and any rank's failure stops every rank with that rank's
        message, except when the checkpoint was assembled from survivors' files: then rank 0 sets
        it and its fragments aside and every rank tries the next choice (the fragments were removed
        only once an assembled checkpoint has loaded, so nothing is lost by trying).
        """
        failed: str | None = None  # rank 0: setting a step that did not load aside failed
        while True:
            choice: dict[str, Any] = {"path": None, "run_id": uuid.uuid4().hex, "lineage": [lineage.new_entry(0)],
                                      "assembled": False, "error": failed}
            if self.rank == 0 and failed is None:
                try:
                    choice.update(self._choose())
                except SubnetdpError as e:
                    choice["error"] = str(e)
            choice = self.comm.all_gather_object(choice)[0]  # collective: rank 0's choice wins
            if choice["error"]:
                raise CheckpointError(choice["error"])
            self.run_id, self.lineage = choice["run_id"], choice["lineage"]
            if choice["path"] is None:
                return 0
            source, error = CheckpointPieces(Path(choice["path"]), self.loader), None
            try:
                self.state.replan(survivors.resume_plan(Path(choice["path"]), self.state, self.cfg,
                                                        self.comm.world_size), source)
            except SubnetdpError as e:
                error = f"rank {self.rank}: {e}"
            errors = [e for e in self.comm.all_gather_object(error) if e]  # collective: all load or none goes on
            if errors and choice["assembled"]:
                if self.rank == 0:
                    try:
                        self._set_aside_assembled(Path(choice["path"]), "; ".join(errors))
                    except (OSError, SubnetdpError) as e:  # told to every rank by the next choice
                        failed = f"{'; '.join(errors)}; setting {choice['path']} aside failed too ({e})"
                continue  # collective: every rank chooses again, as rank 0 now does
            if errors:
                raise CheckpointError("; ".join(errors))
            self.resumed = Path(choice["path"])
            break
        if self.rank == 0:
            manifest = ck.read_manifest(Path(choice["path"]))
            self.carried = carried(manifest, self.ctx.run_dir / "metrics.jsonl")  # the reporter writes them
            if choice["assembled"]:  # it loaded: the survivors' files it came from are of no more use
                survivors.prune_superseded(self.ctx.run_dir)
            how = " on a new plan (re-planned: each rank loaded its new units)" if source.replanned else ""
            print(f"resumed from {choice['path']} (step {self.state.step}){how}", flush=True)
        return self.state.step

    def adopt(self, previous: Any) -> None:
        """Go on with the run id, lineage and unlogged losses of ``previous`` (the last world's
        ``continuation.Handover``): an in-process continuation reads nothing from disk."""
        self.run_id, self.lineage, self.unlogged = previous.run_id, previous.lineage, previous.unlogged
        self.last_saved = previous.last_saved

    @property
    def boundary(self) -> tuple[int, Any, Any, dict[str, torch.Tensor]] | None:
        """(step, loader position, RNG states, buffers) as the last finished step ended (:meth:`mark_finished`)."""
        return self._boundary

    def _set_aside_assembled(self, path: Path, why: str) -> None:
        step = int(ck.STEP_DIR.match(path.name).group(1))
        frags = [f.path for f in survivors.read_fragments(self.ctx.run_dir, []) if f.step == step]
        dest = survivors.set_aside(self.ctx.run_dir, [path, *frags], f"step_{step:08d}-did-not-load")
        print(f"subnetdp: the step recovered from the survivors did not load ({why}); it and its files are set "
              f"aside in {dest}; choosing again", flush=True)

    def _expected(self, current: dict[str, Any] | None) -> survivors.Expected:
        partition = self.state.partition
        return survivors.Expected(current, OmegaConf.to_container(self.cfg.model, resolve=True), partition,
                                  {u.id: u.name for u in partition.units})

    def _choose(self) -> dict[str, Any]:
        """Rank 0: the checkpoint to load (None: start), its run id and lineage, whether it was
        assembled; records the lineage in the run directory and sets aside survivors' files of others."""
        run_dir, resume = self.ctx.run_dir, self.cfg.resume
        ck.checkpoints_dir(run_dir)  # a link there is refused before any step is trained
        survivors.survivors_dir(run_dir)  # so is one there
        survivors.clean_leftovers(run_dir)
        out: dict[str, Any] = {}
        current, done = None, None
        if resume == "auto":
            current = lineage.read(run_dir)
            path = self._newest_of(current)
            done = survivors.assemble(run_dir, self._expected(current), path)
            if done is not None:
                for line in done.skipped:
                    print(f"subnetdp: {line}", flush=True)
                print(f"subnetdp: {done.message}", flush=True)
                if done.checkpoint is not None:
                    path, out["assembled"] = done.checkpoint, True
            if path is not None:
                manifest = ck.read_manifest(path)
                out.update(path=str(path), run_id=manifest["run_id"],
                           lineage=(current or {}).get("lineage") or manifest.get("lineage") or [lineage.new_entry(0)])
        elif resume != "never":
            path = ck.resolve_checkpoint(Path(resume))
            manifest = ck.read_manifest(path)
            # An explicit resume starts a new lineage: survivors' files of the state it leaves are not its past.
            out.update(path=str(path), run_id=manifest["run_id"],
                       lineage=[*manifest.get("lineage", []), lineage.new_entry(int(manifest["step"]))])
        run_id = out.get("run_id", uuid.uuid4().hex)
        chain = out.get("lineage", [lineage.new_entry(0)])
        out.update(run_id=run_id, lineage=chain)
        moved, frags = survivors.set_aside_fragments(run_dir, self._expected({"run_id": run_id, "lineage": chain}))
        if moved is not None:
            for line in _set_aside_lines(frags, current, done.lacking if done else {}, resume):
                print(f"subnetdp: set aside {line} in {moved}", flush=True)
        lineage.write(run_dir, run_id, chain)
        return out

    def _newest_of(self, current: dict[str, Any] | None) -> Path | None:
        """The newest complete checkpoint of the run and lineage ``current`` (any, when None); newer ones
        of another run or of a left branch are named, one line each."""
        for path in reversed(ck.complete_checkpoints(self.ctx.run_dir)):
            problem = lineage.descends(current, ck.read_manifest(path))
            if problem is None:
                return path
            print(f"subnetdp: not resuming from {path}: {problem}", flush=True)
        return None


def rank_file_entries(states: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a rank's state file holds of the components' state dicts (the per-parameter state goes to
    the pieces), in the file's format since format 1: the optimizer's class and groups, the schedule,
    loader and RNGs under their names, and the synchroniser's per-rank values at the top level (local
    steps: ``local_steps_nonfinite``, the inner steps skipped in this cycle so far)."""
    optim = states["optimizer"]
    sync = dict(states["sync"].get("rank") or {})
    clash = RANK_FILE_KEYS & set(sync)
    if clash:  # it would overwrite what the file holds of its own
        raise CheckpointError(f"the synchroniser's state_dict()['rank'] uses the reserved key(s) {sorted(clash)}")
    return {"optimizer": {"class": optim["class"], "param_groups": optim["param_groups"]},
            "scheduler": states["scheduler"], "loader": states["loader"], "rng": states["rng"], **sync}


def _set_aside_lines(frags: list[survivors.Fragment], current: dict[str, Any] | None, lacking: dict[int, str],
                     resume: str) -> list[str]:
    """What the fragments set aside were: this run's own (of its recorded lineage; a step that cannot
    be made whole, or one a restart from the start no longer continues) or another run's or branch's."""
    own = [f for f in frags if current is not None and lineage.descends(current, f.header) is None]
    lines = []
    for step in sorted({f.step for f in own}):
        mine = [f for f in own if f.step == step]
        why = (f"which lack {lacking[step]} (no surviving owner)" if step in lacking
               else "which this restart does not continue from")
        lines.append(f"this run's {len(mine)} survivors' fragment(s) of step {step} (ranks "
                     f"{sorted(f.rank for f in mine)}), {why}")
    if len(own) < len(frags):
        lines.append(f"{len(frags) - len(own)} survivors' file(s) of another run or of a branch this run does not "
                     f"continue (resume={resume})")
    return lines


def check_resume_source(cfg: Any) -> None:
    """Read and check the manifest of the checkpoint ``resume`` would load, if any.

    Runs before any process group exists (in the launching process and on every rank before it
    meets the others), so a damaged or crafted manifest stops the job in one line there, not after
    the world has assembled. Rank 0 still chooses the checkpoint inside the job
    (:meth:`Checkpointer.start`); this only reads what it would find.
    """
    resume = cfg.resume
    if resume == "never":
        return
    if resume == "auto":
        run_dir = Path(cfg.run.dir) / cfg.run.name
        if cfg.run.name:
            survivors.survivors_dir(run_dir)  # a link there is refused before any process group exists
            lineage.read(run_dir)  # so is a damaged lineage record
        path = ck.latest_checkpoint(run_dir) if cfg.run.name else None
    else:
        path = ck.resolve_checkpoint(Path(resume))
    if path is not None:
        ck.read_manifest(path)

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
the RNG states, so a resumed run is bit-identical to one that was never interrupted. A checkpoint
from another model, plan or world size is refused (re-planning for a new world size is not built).
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from subnetdp.train.checkpoints import files as ck
from subnetdp.core import config as config_mod
from subnetdp.core.errors import CheckpointError, SubnetdpError
from subnetdp.sdp.local_steps import LocalStepsSynchronizer


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


AUTO_FINAL_MIN_STEPS = 1000  # checkpoint.final=auto: runs this long keep their final checkpoint


def final_wanted(cfg: Any) -> bool:
    """Whether the checkpoint after the last step is written (``checkpoint.final``).

    ``auto`` writes it when the run asked for checkpoints (``checkpoint.every > 0``), can be
    resumed (``resume`` is not ``never``) or is long (``train.steps >= AUTO_FINAL_MIN_STEPS``):
    a short trial keeps its summary and metrics but not a full copy of its weights and optimizer
    state, so 25 short trials do not fill a disk. ``always`` / ``never`` decide it outright.
    """
    final = str(cfg.checkpoint.get("final", "auto"))
    if final != "auto":
        return final == "always"
    return (int(cfg.checkpoint.every) > 0 or str(cfg.resume) != "never"
            or int(cfg.train.steps) >= AUTO_FINAL_MIN_STEPS)


def _piece_key(p: Any) -> str:
    return p.global_name if p.dim is None else f"{p.global_name}@{p.dim}:{p.global_start}:{p.global_stop}"


class Checkpointer:
    """Saves this rank's part of every checkpoint and restores it on resume.

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
    def _local(self) -> dict[str, torch.Tensor]:
        local = dict(self.run.model.named_parameters())
        local.update(dict(self.run.model.named_buffers()))
        return {n: local[n] for n in self.run.pmap.pieces if n in local}

    def _stored(self) -> list[tuple[str, str, torch.Tensor]]:
        """``(key prefix, local name, tensor)``: parameters and buffers, then any local-steps outer state.

        The outer state has its parameter's local shape, so it is cut and keyed by unit the same way.
        """
        out = [("", n, t) for n, t in self._local().items()]
        if isinstance(self.run.averager, LocalStepsSynchronizer):
            out += self.run.averager.outer_tensors()
        return out

    def _tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
        tensors, slices = {}, {}
        for prefix, name, t in self._stored():
            for p in self.run.pmap.pieces[name]:
                key = prefix + _piece_key(p)
                if p.dim is None:
                    tensors[key] = t.detach().cpu().contiguous()
                else:
                    tensors[key] = t.detach().narrow(p.dim, p.local_start, p.local_stop - p.local_start).cpu().clone()
                slices[key] = [prefix + p.global_name, p.dim, p.global_start, p.global_stop]
        return tensors, slices

    def _param_names(self) -> list[str]:
        names = {id(t): n for n, t in self.run.model.named_parameters()}
        return [_piece_key(self.run.pmap.pieces[names[id(p)]][0]) for g in self.optimizer.param_groups
                for p in g["params"]]

    # ------------------------------------------------------------------ saving
    def after_step(self, step: int) -> None:
        """Save when ``checkpoint.every`` divides ``step`` and after the last step. Collective then."""
        every, last = int(self.cfg.checkpoint.every), int(self.cfg.train.steps)
        if self.cfg.checkpoint.enabled and ((step == last and final_wanted(self.cfg)) or (every and step % every == 0)):
            self.save(step)
        ck.fault_point(ck.KILL_AT_STEP, step, self.rank, self.run.run_dir)

    def save(self, step: int) -> Path:
        """Write checkpoint ``step``: every rank its files, then rank 0 the plan, config and manifest."""
        run, comm = self.run, self.comm
        final = ck.step_dir(run.run_dir, step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if tmp.exists() or tmp.is_symlink():  # a link is unlinked, never followed
                ck.remove_checkpoint(tmp)
            tmp.mkdir(parents=True)
        comm.barrier()  # collective: the temporary directory exists before anyone writes into it
        with run.parallel.gathered():  # collective when sharded: each rank writes its replica's full tensors
            tensors, slices = self._tensors()
        files = self._write_rank_files(tmp, step, tensors, slices)
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
                        "config_digest": config_mod.digest(self.cfg),
                        "model": OmegaConf.to_container(self.cfg.model, resolve=True),
                        "data_spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
                        "reference": run.adapter.reference_options(spec),
                        "files": dict(sorted(files.items()))}
            ck.finish_directory(tmp, final, manifest)
            ck.prune(run.run_dir, int(self.cfg.checkpoint.keep), final)
        comm.barrier()  # collective: no rank runs ahead of a checkpoint that is not complete yet
        self.last_saved = final
        return final

    def _write_rank_files(self, tmp: Path, step: int, tensors: dict[str, torch.Tensor],
                          slices: dict[str, list]) -> dict[str, Any]:
        from safetensors.torch import save_file

        meta = {"format": ck.FORMAT, "run_id": self.run_id, "step": str(step), "rank": str(self.rank),
                "world_size": str(self.comm.world_size), "plan_digest": self.run.plan.digest(),
                "slices": json_dumps(slices)}
        st_name, state_name = ck.rank_files(self.rank)
        out = {st_name: ck.write_atomic(tmp / st_name, lambda p: save_file(tensors, str(p), metadata=meta))}
        state = {"format": ck.FORMAT, "step": step, "run_id": self.run_id, "rank": self.rank,
                 "optimizer": self.run.parallel.optimizer_state_out(self.optimizer.state_dict()), "param_names": self._param_names(),
                 "scheduler": self.scheduler.state_dict(), "loader": self.loader.state_dict(), "rng": rng_state()}
        if isinstance(self.run.averager, LocalStepsSynchronizer):  # inner steps skipped in this cycle so far
            state["local_steps_nonfinite"] = self.run.averager.nonfinite.clone()
        out[state_name] = ck.write_atomic(tmp / state_name, lambda p: torch.save(state, str(p)),
                                          fault=(step, self.rank))
        return out

    # ------------------------------------------------------------------ resuming
    def start(self) -> int:
        """Resume per ``cfg.resume`` (``never``, ``auto``, a path); returns the step to continue after.

        Collective: rank 0 chooses the checkpoint and the run id, every rank loads its own files,
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
        error, step = None, 0
        try:
            step = self._load(Path(choice["path"]))
        except SubnetdpError as e:
            error = f"rank {self.rank}: {e}"
        errors = [e for e in self.comm.all_gather_object(error) if e]  # collective: all load or none goes on
        if errors:
            raise CheckpointError("; ".join(errors))
        if self.rank == 0:
            print(f"resumed from {choice['path']} (step {step})", flush=True)
        return step

    def _choose(self) -> Path | None:
        resume = str(self.cfg.resume)
        if resume == "never":
            return None
        if resume == "auto":
            return ck.latest_checkpoint(self.run.run_dir)
        return ck.resolve_checkpoint(Path(resume))

    def _load(self, path: Path) -> int:
        run = self.run
        manifest = ck.read_manifest(path)
        self._check_compatible(path, manifest)
        st_name, state_name = ck.rank_files(self.rank)
        tensors, slices = ck.read_tensors(ck.verify_file(path, st_name, manifest), manifest, self.rank)
        state = ck.read_state(ck.verify_file(path, state_name, manifest))
        # collective when sharded: full tensors in, cut back into this rank's shards on exit.
        # A checkpoint written with per-step synchronisation has no outer state (a cycle starts here),
        # one written with sync.outer_momentum=0 no outer momentum (it starts at zero).
        present = {k.split("/", 1)[0] + "/" for k in tensors if "/" in k}
        with torch.no_grad(), run.parallel.gathered(writeback=True):
            for prefix, name, t in self._stored():
                if prefix and prefix not in present:
                    continue
                for p in run.pmap.pieces[name]:
                    key = prefix + _piece_key(p)
                    src = tensors.get(key)
                    dst = t if p.dim is None else t.narrow(p.dim, p.local_start, p.local_stop - p.local_start)
                    if src is None or tuple(src.shape) != tuple(dst.shape):
                        found = "missing" if src is None else f"shape {tuple(src.shape)}"
                        raise CheckpointError(f"{path / st_name}: tensor {key} is {found}, this model needs "
                                              f"{tuple(dst.shape)}: the checkpoint is from a different model")
                    dst.copy_(src)
            local = run.averager if isinstance(run.averager, LocalStepsSynchronizer) else None
            if local is not None and "outer_anchor/" not in present:
                local.restart_cycle()
        if local is not None and "local_steps_nonfinite" in state:
            local.nonfinite.copy_(state["local_steps_nonfinite"])
        if state["param_names"] != self._param_names():
            raise CheckpointError(f"{path / state_name}: its optimizer state is for other parameters: "
                                  "the checkpoint is from a different model or plan")
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.run.parallel.optimizer_state_in(self.optimizer)
            self.scheduler.load_state_dict(state["scheduler"])
            self.loader.load_state_dict(state["loader"])
            set_rng_state(state["rng"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"{path / state_name}: its state does not fit this run ({e})") from None
        return int(manifest["step"])

    def _check_compatible(self, path: Path, manifest: dict[str, Any]) -> None:
        run, world = self.run, self.comm.world_size
        where = path / ck.MANIFEST
        if manifest["world_size"] != world:
            raise CheckpointError(f"{where}: written by {manifest['world_size']} rank(s), this run has {world}: "
                                  f"resume with {manifest['world_size']} ranks or start a new run (resuming on "
                                  "a different world size is refused, not re-planned)")
        shard = int(self.cfg.fsdp.shard_size)
        if int(manifest.get("fsdp_shard_size", 1)) != shard:
            raise CheckpointError(f"{where}: written with fsdp.shard_size={manifest.get('fsdp_shard_size', 1)}, this "
                                  f"run has fsdp.shard_size={shard}: its optimizer state is sharded that way; "
                                  f"resume with fsdp.shard_size={manifest.get('fsdp_shard_size', 1)} or start a new run")
        model = OmegaConf.to_container(self.cfg.model, resolve=True)
        if manifest["model"] != model:
            raise CheckpointError(f"{where}: written for model {manifest['model']}, this run trains {model}: "
                                  "use the same model.* settings or start a new run")
        if manifest["plan_digest"] != run.plan.digest():
            raise CheckpointError(f"{where}: written under mask plan {manifest['plan_digest']}, this run's plan is "
                                  f"{run.plan.digest()}: use the same masker.* settings and seed, or start a new run")


def json_dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"))

"""A checkpoint directory as the source of a re-plan: :class:`CheckpointPieces`.

Resuming is ``state.replan(plan, CheckpointPieces(path, loader))`` (:meth:`subnetdp.train.state.TrainState.replan`):
each rank loads exactly the pieces it holds under its plan (the checkpoint's plan or a new one: pieces
are keyed by unit), their optimizer state, the schedule, the synchroniser's own state, the data
position and the RNG states. On the checkpoint's plan and world size this is bit-identical to a run
that was never interrupted. Also here: what saving and loading share (RNG states, the optimizer's
parameter names, the checkpoint's plan).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from subnetdp.core import records
from subnetdp.core.contracts import ResumableLoader
from subnetdp.core.errors import CheckpointError, SubnetdpError
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.keep_rates import forward_keep_rates
from subnetdp.sdp.pieces import LocalIndex
from subnetdp.train.checkpoints import files as ck
from subnetdp.train.checkpoints import units

if TYPE_CHECKING:
    from subnetdp.train.state import Holding, TrainState


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


def seed_host_rngs(seed: int) -> None:
    """Python's and numpy's global random states from ``seed`` (saved in checkpoints, so they must agree
    between two runs of the same seed)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)


def reseed(seed: int) -> None:
    """Host RNGs of a rank whose old stream has no counterpart (a resume on another world size)."""
    seed_host_rngs(seed)
    torch.manual_seed(seed)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def local_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The local name of every optimizer parameter, in the optimizer's order (outside ``gathered()``)."""
    names = {id(t): n for n, t in model.named_parameters()}
    return [names[id(p)] for p in optimizer_params(optimizer)]


#: What a rank's state file holds of its own (``Checkpointer._write_rank_files``); any other key is
#: the synchroniser's per-rank state (its ``state_dict()["rank"]``, written at the top level).
RANK_FILE_KEYS = frozenset({"format", "step", "run_id", "rank", "world_size", "batch_size", "optimizer", "scheduler",
                            "loader", "rng"})


def sync_rank_state(saved: dict[str, Any]) -> dict[str, Any]:
    """The synchroniser's per-rank values in a rank's state file."""
    return {k: v for k, v in saved.items() if k not in RANK_FILE_KEYS}


def extra_by_prefix(state: "TrainState") -> dict[str, dict[str, torch.Tensor]]:
    """The synchroniser's own per-piece state: key prefix -> local parameter name -> tensor of its local shape."""
    return dict(state.synchronizer.state_dict().get("pieces") or {})


def read_plan(path: Path, manifest: dict[str, Any]) -> MaskPlan:
    """The checkpoint's ``plan.json``, checked against the manifest."""
    f = ck.verify_file(path, "plan.json", manifest)
    try:
        plan = MaskPlan.from_dict(records.read_json(f))
    except (SubnetdpError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f}: not a valid mask plan ({e})") from None
    if plan.digest() != manifest["plan_digest"] or plan.world_size != manifest["world_size"]:
        raise CheckpointError(f"{f}: does not match {ck.MANIFEST} (plan digest or world size)")
    return plan


class CheckpointPieces:
    """A checkpoint directory as a :class:`~subnetdp.train.state.PieceSource`.

    Args:
        path: the checkpoint (``RUN_DIR/checkpoints/step_XXXXXXXX``).
        loader: the run's training loader, whose position is restored (carried over by samples seen
            when the world size or batch size changed: :func:`~subnetdp.train.checkpoints.units.carry_position`).

    After :meth:`load`, :attr:`replanned` says whether the checkpoint was written under another plan
    or world size (each rank then loaded its new units), and :attr:`trained_rates` how often each
    residual branch ran in the forwards that trained it (the checkpoint's plan and masking regime).
    """

    def __init__(self, path: Path, loader: ResumableLoader) -> None:
        self.path, self.loader = Path(path), loader
        self.replanned = False
        self.trained_rates: Optional[dict[str, float]] = None

    def load(self, state: "TrainState", previous: Optional["Holding"]) -> int:
        """Load this rank's pieces, state and position; returns the checkpoint's step. Collective when sharded."""
        path, ctx = self.path, state.context
        rank, world = ctx.rank, ctx.comm.world_size
        manifest = ck.read_manifest(path)
        check_compatible(path, manifest, state)
        old_plan = read_plan(path, manifest)
        old_world = int(manifest["world_size"])
        same_plan = old_world == world and manifest["plan_digest"] == state.plan.digest()
        # Assembled from the survivors of a lost worker: the dead ranks wrote no files of their own.
        absent = set(manifest.get("absent_ranks", ()))
        present = [r for r in range(old_world) if r not in absent]
        own = same_plan and rank not in absent
        state_name = ck.rank_files(rank if old_world == world and rank not in absent else present[0])[1]
        saved = ck.read_state(ck.verify_file(path, state_name, manifest))
        reader = units.PieceReader(path, manifest)
        names = local_names(state.model, state.optimizer)
        # collective when sharded: full tensors in, cut back into this rank's shards on exit.
        with torch.no_grad(), state.parallel.gathered(state.model, writeback=True):
            index = LocalIndex(state.model, state.pmap)
            optim_state, outer = units.load_pieces(reader, rank, state.partition, state.plan, index, own=own)
            units.load_buffers(reader, rank, state.partition, state.plan, index, old_plan, own=own,
                               present=present)
            # The step gives local steps' phase (sync.warmup_steps). A checkpoint written with per-step
            # synchronisation has no outer state (local steps start a cycle here), one written with
            # sync.outer_momentum=0 no outer momentum (it starts at zero).
            state.synchronizer.load_state_dict({"step": int(manifest["step"]), "pieces": outer,
                                                "rank": sync_rank_state(saved)})
        where = path / state_name
        load_optimizer(where, saved, state, names, optim_state)
        try:
            state.scheduler.load_state_dict(saved["scheduler"])
            batch = int(ctx.cfg.train.batch_size)
            if old_world == world and int(saved.get("batch_size", batch)) == batch:
                self.loader.load_state_dict(saved["loader"])  # every rank of one world is at the same position
                if rank in absent:  # a dead rank's own streams died with it
                    reseed(int(ctx.cfg.seed) + int(manifest["step"]) + rank)
                else:
                    set_rng_state(saved["rng"])
            else:
                self.loader.load_state_dict(units.carry_position(
                    saved["loader"], (old_world, int(saved.get("batch_size", batch))), (world, batch),
                    self.loader.batches_per_epoch))
                reseed(int(ctx.cfg.seed) + int(manifest["step"]))
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"{where}: its state does not fit this run ({e})") from None
        self.replanned = not same_plan
        self.trained_rates = forward_keep_rates(trained_masker(path, manifest, ctx.cfg.masker), state.partition,
                                                old_plan)
        return int(manifest["step"])


def trained_masker(path: Path, manifest: dict[str, Any], masker: Any) -> Any:
    """The ``masker`` section the checkpoint was trained with (its ``config.yaml``): its regime says
    whether every branch ran in every forward. ``masker`` (this run's) when the file holds none."""
    from subnetdp.core.stored import load_stored

    stored = load_stored(ck.verify_file(path, "config.yaml", manifest))
    found = stored.get("masker")
    return found if isinstance(found, DictConfig) and "regime" in found else masker


def load_optimizer(where: Path, saved: dict[str, Any], state: "TrainState", names: list[str],
                   optim_state: dict[str, dict[str, torch.Tensor]]) -> None:
    """The optimizer's state from a rank's state file and the pieces' optimizer tensors."""
    optimizer = state.optimizer
    found = saved.get("optimizer")
    if not isinstance(found, dict) or found.get("class") != type(optimizer).__name__:
        kind = found.get("class") if isinstance(found, dict) else None
        raise CheckpointError(f"{where}: optimizer {kind}, this run uses {type(optimizer).__name__}: "
                              "use the same optim.name or start a new run")
    groups = found["param_groups"]
    mine = optimizer.state_dict()["param_groups"]
    if len(groups) != len(mine):
        raise CheckpointError(f"{where}: {len(groups)} optimizer parameter groups, this run has {len(mine)}")
    sd = {"state": {i: optim_state[n] for i, n in enumerate(names) if n in optim_state},
          "param_groups": [{**g, "params": m["params"]} for g, m in zip(groups, mine)]}
    try:
        optimizer.load_state_dict(sd)
        state.parallel.optimizer_state_from_full(optimizer)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{where}: its optimizer state does not fit this run ({e})") from None


def check_compatible(path: Path, manifest: dict[str, Any], state: "TrainState") -> None:
    """What a resume must keep: the model and its partition. World size, plan (coverage, masker,
    seed) and fsdp.shard_size may change: every piece is keyed by the partition alone."""
    cfg, partition, plan = state.context.cfg, state.partition, state.plan
    where = path / ck.MANIFEST
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if manifest["model"] != model:
        raise CheckpointError(f"{where}: written for model {manifest['model']}, this run trains {model}: "
                              "use the same model.* settings or start a new run")
    if manifest.get("partition_digest") != units.partition_digest(partition):
        part = manifest.get("partition", {})
        raise CheckpointError(
            f"{where}: written for a partition of {part.get('units')} {part.get('granularity')}-level units "
            f"(masker.units_per_layer={part.get('units_per_layer')}), this run cuts the model into "
            f"{len(partition.units)} {partition.granularity}-level units: a resume may change the "
            "world size, coverage, masker and seed, not the units; use the checkpoint's masker.granularity "
            "and masker.units_per_layer, or start a new run")
    resample = int(cfg.masker.get("resample_every", 0) or 0)
    if resample > 0 and (manifest["plan_digest"] != plan.digest() or manifest["world_size"] != plan.world_size):
        # The run's plan at set-up is the family's base plan, not the one re-drawn by the step saved.
        raise CheckpointError(f"{where}: written under mask plan {manifest['plan_digest']} (re-drawn by "
                              f"masker.resample_every={resample}), this run starts from plan {plan.digest()}: "
                              "a run with re-drawn plans resumes only from a checkpoint of its base plan; "
                              "resume with masker.resample_every=0 to re-plan from this checkpoint")

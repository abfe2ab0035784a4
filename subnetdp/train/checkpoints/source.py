"""A checkpoint directory as the source of a re-plan: :class:`CheckpointPieces`.

Resuming is ``state.replan(plan, CheckpointPieces(path, loader))`` (:meth:`subnetdp.train.state.TrainState.replan`):
each rank loads exactly the pieces it holds under its plan (the checkpoint's plan or a new one: pieces
are keyed by unit), their optimizer state, the schedule, the synchroniser's own state, the data
position and the RNG states. On the checkpoint's plan and world size this is bit-identical to a run
that was never interrupted. Also here: what saving and loading share (the mapping of Stateful
components a checkpoint holds, the keys a rank's state file keeps for itself, the checkpoint's plan).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

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
# The host RNGs and the optimizer's names moved to train/stateful.py; their old home keeps them.
from subnetdp.train.stateful import (HostRng, Stateful, local_names, optimizer_params, reseed, rng_state,  # noqa: F401
                                     seed_host_rngs, set_rng_state)

if TYPE_CHECKING:
    from subnetdp.train.state import Holding, TrainState


#: What a rank's state file holds of its own (``Checkpointer._write_rank_files``); any other key is
#: the synchroniser's per-rank state (its ``state_dict()["rank"]``, written at the top level).
RANK_FILE_KEYS = frozenset({"format", "step", "run_id", "rank", "world_size", "batch_size", "optimizer", "scheduler",
                            "loader", "rng"})


def sync_rank_state(saved: dict[str, Any]) -> dict[str, Any]:
    """The synchroniser's per-rank values in a rank's state file."""
    return {k: v for k, v in saved.items() if k not in RANK_FILE_KEYS}


def checkpoint_states(state: "TrainState", loader: ResumableLoader) -> dict[str, Stateful]:
    """What a checkpoint holds, one Stateful per component (:mod:`subnetdp.train.stateful`): the
    training state's (model, optimizer, schedule, synchroniser; rebuilt by a re-plan, so asked at the
    time), the loader's position and the host RNGs. The model's views are taken inside ``gathered()``."""
    return {**state.stateful(), "loader": loader, "rng": HostRng()}


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
        states = checkpoint_states(state, self.loader)
        # collective when sharded: full tensors in, cut back into this rank's shards on exit.
        with torch.no_grad(), state.parallel.gathered(state.model, writeback=True):
            index = LocalIndex(state.model, state.pmap)
            optim_state, outer = units.load_pieces(reader, rank, state.partition, state.plan, index, own=own,
                                                   fill=False)
            # The model takes its pieces through its Stateful, each read from disk when it asks.
            expect = states["model"].state_dict()["params"]
            states["model"].load_state_dict({
                "params": units.PieceValues(reader, expect, rank if own else None),
                "buffers": units.buffer_values(reader, rank, state.partition, state.plan, index, old_plan, own=own,
                                               present=present)})
            # The step gives local steps' phase (sync.warmup_steps). A checkpoint written with per-step
            # synchronisation has no outer state (local steps start a cycle here), one written with
            # sync.outer_momentum=0 no outer momentum (it starts at zero).
            states["sync"].load_state_dict({"step": int(manifest["step"]), "pieces": outer,
                                            "rank": sync_rank_state(saved)})
        where = path / state_name
        try:
            batch = ctx.cfg.train.batch_size
            if old_world == world and int(saved.get("batch_size", batch)) == batch:
                position = saved["loader"]  # every rank of one world is at the same position
                # A dead rank's own streams died with it.
                rng = {"seed": ctx.cfg.seed + int(manifest["step"]) + rank} if rank in absent else saved["rng"]
            else:
                position = units.carry_position(saved["loader"], (old_world, int(saved.get("batch_size", batch))),
                                                (world, batch), self.loader.batches_per_epoch)
                rng = {"seed": ctx.cfg.seed + int(manifest["step"])}
            optim = saved.get("optimizer")
            found = {"optimizer": {**optim, "params": optim_state} if isinstance(optim, dict) else {"class": None},
                     "scheduler": saved["scheduler"], "loader": position, "rng": rng}
            for name, component in states.items():
                if name in found:  # the model and the synchroniser took their own above, with the pieces
                    component.load_state_dict(found[name])
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
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

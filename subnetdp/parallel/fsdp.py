"""FSDP2 inside each replica, owner-group averaging across replicas (``fsdp.shard_size = S``).

The world is an R x S grid: rank ``r * S + s`` is shard ``s`` of replica ``r``. The mask plan is made
over the R replicas, so the S ranks of a replica hold the same subnetwork; each materialised block
and the shared parts are wrapped with ``fully_shard`` over the replica's shard group, whose
reduce-scatter averages the gradients of those S ranks. Shard ``s`` of every replica then holds the
same slice of every parameter it owns, and :class:`ShardedOwnerAverager` averages unit ``u``'s
slice over ``{(r, s) : r in owners(u)}``: the unit's gradient becomes the mean over the k * S ranks
that train it, exactly as without FSDP.

FSDP2 requires every rank of a shard group to run every sharded module (a rank that skipped a
block's forward would hang the others' all-gather). Sharding only within a replica guarantees it.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from subnetdp.core.contracts import Communicator, Handle, ParamMap, Partition
from subnetdp.core.errors import ConfigError
from subnetdp.parallel.memory import TensorMemoryTracker
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.sync import EveryStepSync, SyncSettings, clip_to, world_norm


def check_config(cfg: Any, registries: dict[str, Any]) -> None:
    """``fsdp.shard_size > 1`` composes with forward, block-level masking over torch.distributed only,
    and leaves no whole gradient for ``train.grad_alignment_every``. Reads the config; creates nothing."""
    size = cfg.fsdp.shard_size
    if size > 1:
        needs = (("masker.granularity", "block", "FSDP shards whole blocks; neuron-level units would cut its shards"),
                 ("masker.regime", "forward", "backward masking broadcasts whole units, which FSDP holds in shards"),
                 ("masker.resample_every", 0, "a re-drawn plan would have to re-shard the blocks"))
        for key, want, why in needs:
            value = OmegaConf.select(cfg, key)
            if value != want:
                raise ConfigError(key, value, f"fsdp.shard_size={size} needs {key}={want}: {why}",
                                  f"set {key}={want}, or fsdp.shard_size=1")
        if not registries["comm"].get(cfg.comm.name).supports_fsdp:
            raise ConfigError("comm.name", cfg.comm.name, f"fsdp.shard_size={size} needs torch.distributed process "
                              "groups (FSDP2 all-gathers and reduce-scatters through them)",
                              "use comm.name=gloo (CPU) or comm.name=nccl (GPU)")
    if cfg.train.grad_alignment_every and size > 1:
        raise ConfigError("train.grad_alignment_every", cfg.train.grad_alignment_every,
                          f"the probe needs whole gradients, and fsdp.shard_size={size} shards them",
                          "use fsdp.shard_size=1 for the probe, or train.grad_alignment_every=0")


def replica_mesh(comm: Communicator, shard_size: int) -> DeviceMesh:
    """The 2-D ``("replica", "shard")`` mesh over the world. Collective: every rank calls it once."""
    replicas = comm.world_size // shard_size
    # collective: init_device_mesh creates the row (shard) and column (replica) groups on every rank.
    return init_device_mesh(comm.device.type, (replicas, shard_size), mesh_dim_names=("replica", "shard"))


def mixed_precision(precision: str) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 gradient reduction (sharded parameters stay fp32), or None for fp32."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_fsdp(model: nn.Module, blocks: Sequence[nn.Module], mesh: DeviceMesh,
               mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True) -> int:
    """``fully_shard`` each block, then the root (the shared parts), over the 1-D shard mesh.

    Parameter names do not change, so the parameter map, checkpoints and the averager still apply.
    Returns the number of FSDP units (blocks + root).
    """
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in blocks:
        fully_shard(block, **kwargs)
    # The root's parameters are used last in backward and first in forward: keep them gathered
    # between the two (as torchtitan does), which saves one all-gather per step.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    return len(blocks) + 1


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a sharded tensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def gathered(model: nn.Module, writeback: bool = False) -> Iterator[None]:
    """Swap every sharded parameter for a plain full copy (fp32, gathered over the shard group).

    Inside, the model looks unsharded to code that reads or writes tensors by name: the union
    model's assembly, checkpoints, digests. With ``writeback`` the full values are cut back into
    the shards on exit (resuming from a checkpoint). Collective over each shard group; the full
    copies exist only inside the block.
    """
    swapped: list[tuple[nn.Module, str, DTensor]] = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                # collective: every rank of the shard group gathers the same parameters in the same order.
                full = p.full_tensor().detach()
                module._parameters[name] = nn.Parameter(full, requires_grad=p.requires_grad)
                swapped.append((module, name, p))
    try:
        yield
    finally:
        for module, name, p in swapped:
            if writeback:
                with torch.no_grad():
                    mine = distribute_tensor(module._parameters[name].detach(), p.device_mesh, p.placements,
                                             src_data_rank=None)  # each rank cuts its own copy: no traffic
                    p.to_local().copy_(mine.to_local())
            module._parameters[name] = p


def state_full(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every parameter's optimizer state with sharded tensors gathered (in the optimizer's order).

    Collective: the ranks of a shard group hold the same parameters in the same order.
    """
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append({k: v.full_tensor() if isinstance(v, DTensor) else v
                        for k, v in optimizer.state.get(p, {}).items()})
    return out


def state_from_full(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of full-shaped state: each rank cuts its own shards (no traffic)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0:
                    optimizer.state[p][k] = distribute_tensor(v.to(p.device), p.device_mesh, p.placements,
                                                              src_data_rank=None)


class CollectiveBytes(TorchDispatchMode):
    """Counts the payload of FSDP's all-gathers and reduce-scatters as they are dispatched.

    Payload is what this rank hands to the collective (its shard for an all-gather, the full
    gradient for a reduce-scatter); ``wire`` is the ring estimate of what it sends, ``(S-1)/S`` of
    the gathered or scattered size. The owner-group all-reduces are counted by the communicator.
    """

    GATHER = ("_allgather_base_", "allgather_into_tensor_coalesced_")
    SCATTER = ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_")

    def __init__(self) -> None:
        super().__init__()
        self.payload = 0
        self.wire = 0.0
        self.by_kind: dict[str, int] = {"all_gather": 0, "reduce_scatter": 0}

    @staticmethod
    def _nbytes(t: object) -> int:
        items = t if isinstance(t, (list, tuple)) else [t]
        return sum(x.numel() * x.element_size() for x in items if isinstance(x, torch.Tensor))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__ if func.namespace == "c10d" else ""
        if name in self.GATHER or name in self.SCATTER:
            out, inp = self._nbytes(args[0]), self._nbytes(args[1])
            big, small = max(out, inp), min(out, inp)
            kind = "all_gather" if name in self.GATHER else "reduce_scatter"
            self.payload += inp
            self.by_kind[kind] += inp
            self.wire += big - small  # ring: (S-1) shards of size big / S
        return func(*args, **(kwargs or {}))


class ShardedMemoryTracker(TensorMemoryTracker):
    """``TensorMemoryTracker`` that counts DTensors with their local shard and sees ``resize_``.

    FSDP2 keeps each unsharded parameter's storage alive across steps at size 0 and grows it to
    the full size for the all-gather copy-out (``alloc_storage``), shrinking it back after use
    (``free_storage``); ``resize_`` of a storage is not a dispatched op, so it is wrapped here for
    the duration of the block (and only then: the loop uses this tracker on its one measured step).
    ``gathered``/``gathered_at_peak`` are those bytes. A DTensor's storage reports the full size;
    its local shard (what ``to_local()`` views) is what this rank holds.
    """

    def __init__(self, baseline: int = 0) -> None:
        super().__init__(baseline)
        self.gathered = self.gathered_peak = self.gathered_at_peak = 0
        self._orig_resize = None

    @staticmethod
    def _local(t: Any) -> Any:
        return t._local_tensor if isinstance(t, DTensor) else t  # the shard (what .to_local() views)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {self._local(t).untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                t = self._local(t)
                if t.untyped_storage()._cdata not in inputs:
                    self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        super()._track(t)
        self._note_peak()

    def _note_peak(self) -> None:
        if self.current >= self.peak:
            self.gathered_at_peak = self.gathered

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        key, delta = storage._cdata, storage.nbytes() - before
        if key not in self._live:  # a storage created before the block (FSDP's unsharded parameters)
            self._live[key] = 0
            weakref.finalize(storage, self._free, key)
        self._live[key] += delta
        self.current += delta
        self.gathered += delta
        self.gathered_peak = max(self.gathered_peak, self.gathered)
        self.peak = max(self.peak, self.current)
        self._note_peak()

    def __enter__(self) -> "ShardedMemoryTracker":
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            out = orig(storage, size)
            self._resized(storage, before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)


@dataclass(frozen=True)
class Sharding:
    """What :func:`~subnetdp.sdp.sync.make_synchronizer` is given for a sharded model: it builds the
    :class:`ShardedOwnerAverager` (``sdp/`` stands below ``parallel/`` and does not know it).

    Attributes:
        shard_size: S, the ranks of one replica (``fsdp.shard_size``).
        reduce_each_micro_batch: FSDP reduce-scatters every micro-batch (``fsdp.reduce_each_micro_batch``).
    """

    shard_size: int
    reduce_each_micro_batch: bool = True

    def __call__(self, settings: SyncSettings, model: nn.Module, pmap: ParamMap, plan: MaskPlan, partition: Partition,
                 comm: Communicator) -> "ShardedOwnerAverager":
        # The plan is over the W ranks (MaskPlan.replicated); the averager works over the R replicas.
        return ShardedOwnerAverager(model, pmap, plan.replicas(self.shard_size), partition, comm, self.shard_size,
                                    settings.bucket_cap_mb, self.reduce_each_micro_batch)


@dataclass(eq=False)
class _Bucket:
    group: tuple[int, ...]  # world ranks: shard s of every owner replica
    names: list[str]
    numel: int
    handle: Handle | None = None
    buffer: torch.Tensor | None = None
    offsets: list[int] = field(default_factory=list)


class ShardedOwnerAverager(EveryStepSync):
    """Owner-group averaging of FSDP-sharded gradients across replicas.

    Same per-step use as :class:`~subnetdp.sdp.sync.OwnerGroupAverager`. FSDP's reduce-scatter has
    already averaged each gradient over the S ranks of the replica when backward returns; this
    averages each local shard over the ranks holding the same shard of the same unit in the other
    owner replicas. Buckets are packed after backward, per owner set, in the partition's order.

    Args:
        model: the rank's FSDP-wrapped model.
        pmap: its parameter map (block level: every tensor is one whole global tensor).
        replica_plan: the mask plan over the R replicas.
        partition: the full model's partition.
        comm: the communicator (its world is R x S ranks).
        shard_size: S.
        bucket_cap_mb: largest bucket, in MiB.
        reduce_each_micro_batch: FSDP reduce-scatters every micro-batch (else only the last).
    """

    dense = False
    replicated = False  # each rank holds a shard: the norm and checks always need the world

    def __init__(self, model: nn.Module, pmap: ParamMap, replica_plan: MaskPlan, partition: Partition,
                 comm: Communicator, shard_size: int, bucket_cap_mb: float = 25.0,
                 reduce_each_micro_batch: bool = True) -> None:
        self.model, self.comm, self.shard_size = model, comm, shard_size
        self.reduce_each_micro_batch = reduce_each_micro_batch
        self.replica, self.shard = divmod(comm.rank, shard_size)
        self.world = tuple(range(comm.world_size))
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        unit_of = {s.name: u.id for u in partition.units for s in u.slices}
        order = {n: i for i, n in enumerate([s.name for u in partition.units for s in u.slices] + list(partition.shared))}
        everyone = tuple(range(replica_plan.world_size))

        def to_world(replicas: tuple[int, ...], s: int) -> tuple[int, ...]:
            return tuple(r * shard_size + s for r in replicas)

        # collective: every rank creates every (owner set, shard index) group in the same order.
        for owners in replica_plan.owner_sets() + ([everyone] if everyone not in replica_plan.owner_sets() else []):
            for s in range(shard_size):
                if len(owners) > 1:
                    comm.new_group(to_world(owners, s))
        self.k: dict[str, int] = {}
        by_group: dict[tuple[int, ...], list[str]] = {}
        for name in self.params:
            (piece,) = pmap.pieces[name]
            unit = unit_of.get(piece.global_name)
            owners = everyone if unit is None else replica_plan.owners(unit)
            self.k[name] = len(owners)
            by_group.setdefault(to_world(owners, self.shard), []).append(name)
        elem = next(iter(self.params.values())).element_size() if self.params else 4
        cap = max(1, int(bucket_cap_mb * 2**20) // elem)
        self.buckets: list[_Bucket] = []
        for group in sorted(by_group, key=lambda g: (len(g) == len(everyone), g)):
            if len(group) == 1:
                continue  # one owner replica: FSDP's reduce-scatter was the whole average
            names = sorted(by_group[group], key=lambda n: order[pmap.pieces[n][0].global_name])
            current: list[str] = []
            size = 0
            for n in names + [None]:
                numel = local(self.params[n]).numel() if n is not None else 0
                if current and (n is None or size + numel > cap):
                    self.buckets.append(_Bucket(group, current, size))
                    current, size = [], 0
                if n is not None:
                    current.append(n)
                    size += numel
        self._sync = True

    def prepare(self, keep_grads: bool = False) -> None:
        if keep_grads:  # the coming backward adds to the gradients already there
            return
        for p in self.params.values():
            p.grad = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches before the last (``train.grad_accum``).

        By default FSDP still reduce-scatters each micro-batch's gradients (as torchtitan does):
        memory stays at the sharded gradients, bytes grow with the micro-batches. With
        ``fsdp.reduce_each_micro_batch=false`` the reduce-scatter waits for the last micro-batch:
        one per step, but the replica's unsharded gradients live until then (+3.4 GiB at 1B LLaMA,
        benchmarks/fsdp_memory.py). The replicas' own averaging runs once per step in :meth:`finish`
        either way.
        """
        if self.reduce_each_micro_batch:
            yield
            return
        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

    def _grad(self, name: str) -> torch.Tensor:
        p = self.params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # an unused parameter still takes part in its owners' average
        return local(p.grad)

    def finish(self) -> None:
        """Average each shard among its owner replicas: launch every bucket, then wait and copy back."""
        for b in self.buckets:
            grads = [self._grad(n) for n in b.names]
            b.buffer = torch.cat([g.reshape(-1) for g in grads]) if grads else None
            # collective: every member of the group issues its buckets in the same (partition) order.
            b.handle = self.comm.all_reduce(b.buffer, b.group, async_op=True)
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
            b.buffer.div_(len(b.group))
            off = 0
            for n in b.names:
                g = self._grad(n)
                g.copy_(b.buffer[off:off + g.numel()].view_as(g))
                off += g.numel()
            b.buffer = None

    def carry(self, flags: torch.Tensor) -> bool:
        return False  # the check travels with the norm (see OwnerGroupAverager.carry)

    def carried(self) -> torch.Tensor | None:
        return None

    def local_grads(self) -> list[torch.Tensor]:
        return [local(p.grad) for p in self.params.values() if p.grad is not None]

    def grad_norm(self, flags: torch.Tensor | None = None) -> float:
        """Norm of the averaged full-model gradient: each shard counted once over its owner replicas.

        With ``flags`` (float64), the same all-reduce sums them over the world in place.
        """
        total = torch.zeros((), dtype=torch.float64, device=self.comm.device)
        for name, p in self.params.items():
            if p.grad is not None:
                total += torch.linalg.vector_norm(local(p.grad)).double() ** 2 / self.k[name]
        return world_norm(self.comm, total, flags)  # collective: every rank, once per step that needs it

    def scale_grads_(self, coef: float) -> None:
        for p in self.params.values():
            if p.grad is not None:
                local(p.grad).mul_(coef)

    def clip_grad_norm_(self, max_norm: float) -> float:
        norm = self.grad_norm()
        clip_to(self, norm, max_norm)
        return norm

    def bytes_per_step(self) -> int:
        elem = next(iter(self.params.values())).element_size() if self.params else 4
        return sum(b.numel for b in self.buckets) * elem

    def state_tensors(self) -> list[torch.Tensor]:
        return []

    def remove_hooks(self) -> None:
        pass

    def owner_groups(self) -> list[tuple[int, ...]]:
        return sorted({b.group for b in self.buckets})

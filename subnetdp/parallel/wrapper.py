"""SDP in the user's own training loop: :func:`parallelize`, the counterpart of ``DistributedDataParallel``.

::

    dist.init_process_group("gloo")
    with torch.device("meta"):
        model = MyTransformer(cfg)
    model = subnetdp.parallelize(model, units="layers.*", coverage=0.5, seed=0, skip="identity")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ...  # the user's loop: loss.backward() returns with the owner groups' averages in .grad

It plans with a registered masker, materialises only this rank's units from the meta-device model
(a unit it does not own is never allocated: its skip module takes its place), and averages the
gradients with :class:`~subnetdp.sdp.sync.OwnerGroupAverager`, the same owner-bucket code the
framework's loop uses, finished from autograd's end-of-backward callback as DDP does.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch import nn

from subnetdp.core.contracts import (Communicator, DataSpec, Handle, LaunchEnv, Masker, MaskerConfig, ModelAdapter,
                                     ParamMap, Partition)
from subnetdp.core.errors import ConfigError
from subnetdp.core.plan import MaskPlan, make_plan
from subnetdp.core.plugins import PluginManager
from subnetdp.sdp.construct import Initialiser, initialise
from subnetdp.sdp.sync import OwnerGroupAverager, SyncSettings, make_synchronizer
from subnetdp.sdp.variants import local_model, partition_model
from subnetdp.sdp.units import Skip, block_partition, drop_units, find_units, global_map, skip_module


class _Work(Handle):
    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()


class ProcessGroupCommunicator(Communicator):
    """A :class:`Communicator` over the process group the user already initialised (it creates none)."""

    def __init__(self, device: torch.device | None = None) -> None:
        env = LaunchEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=0)
        super().__init__(None, env)
        self._device = device or torch.device("cpu")
        self._groups: dict[tuple[int, ...], Any] = {}

    @property
    def device(self) -> torch.device:
        return self._device

    def init(self) -> None:
        return None

    def new_group(self, ranks: Sequence[int]) -> None:
        # collective: every rank creates every group, in the same order.
        self._groups[tuple(ranks)] = dist.new_group(list(ranks))

    def _group(self, ranks: Sequence[int] | None) -> Any:
        return None if ranks is None or tuple(ranks) == self.world else self._groups[tuple(ranks)]

    def all_reduce(self, tensor: torch.Tensor, group: Sequence[int], async_op: bool = False) -> Handle:
        self.bytes.add(tuple(group), tensor.numel() * tensor.element_size())
        return _Work(dist.all_reduce(tensor, group=self._group(group), async_op=async_op))

    def broadcast(self, tensor: torch.Tensor, src: int, group: Sequence[int] | None = None) -> None:
        dist.broadcast(tensor, src, group=self._group(group))

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()


class _ResetInit:
    """Initialises a module as PyTorch (``reset_parameters``) or ``transformers`` (``_init_weights``) would."""

    def __init__(self, root: nn.Module, init: Callable[[str, nn.Module], None] | None) -> None:
        self.root, self.init = root, init

    def init_module(self, name: str, module: nn.Module) -> None:
        if self.init is not None:
            self.init(name, module)
        elif callable(getattr(self.root, "_init_weights", None)):
            self.root._init_weights(module)  # a transformers model: its config's initializer_range
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        elif callable(getattr(module, "_reset_parameters", None)):
            module._reset_parameters()  # nn.MultiheadAttention, nn.Transformer: torch's private spelling


def _check_meta(model: nn.Module) -> None:
    off = [(n, t.device) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not t.is_meta]
    if off:
        raise ConfigError("model", f"{off[0][0]} on {off[0][1]}", f"{len(off)} tensors are allocated already, so "
                          "this rank would hold units it does not own", "build the model under "
                          "`with torch.device('meta'):` and let parallelize allocate the rank's own units")


class SubnetworkParallel(nn.Module):
    """The rank's subnetwork, trained as one of W data-parallel workers (see :func:`parallelize`).

    Attributes:
        module: the rank's model: owned units, shared tensors, skip modules for the other units.
        plan: the :class:`MaskPlan` (``plan.owned[r]``: unit ids rank r holds).
        partition: the full model's :class:`Partition` (unit names, tensors, shapes).
        averager: the owner-bucket averaging (shared with the framework's loop).
    """

    def __init__(self, module: nn.Module, pmap: ParamMap, plan: MaskPlan, partition: Partition, comm: Communicator,
                 bucket_cap_mb: float = 25.0, *, averager: OwnerGroupAverager | None = None,
                 before_finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.module, self.pmap, self.plan, self.partition, self.comm = module, pmap, plan, partition, comm
        self.averager = averager if averager is not None else OwnerGroupAverager(module, self.pmap, plan, partition,
                                                                                  comm, bucket_cap_mb=bucket_cap_mb)
        #: Called in the end-of-backward callback before the owner groups' reductions complete (the
        #: framework's test-only kill point ``SUBNETDP_TEST_KILL_IN_SYNC``); None in a user's loop.
        self.before_finish = before_finish
        self._queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in module.parameters()
                       if p.requires_grad]

    @classmethod
    def from_parts(cls, module: nn.Module, pmap: ParamMap, plan: MaskPlan, partition: Partition, comm: Communicator,
                   settings: SyncSettings, before_finish: Callable[[], None] | None = None) -> "SubnetworkParallel":
        """The framework's entrance: wrap a rank's model the training state already materialised, with
        the communicator it already initialised and the ``sync.*`` settings (per-step owner-group
        averaging, unsharded). Collective: every rank creates every owner group, in the same order.
        """
        if settings.mode == "local_steps":
            raise ValueError("SubnetworkParallel averages every step: sync.mode=local_steps keeps its own synchroniser")
        # collective: make_synchronizer creates the owner groups (the communicator keeps them); unsharded
        # and every step, it makes an OwnerGroupAverager.
        averager = make_synchronizer(settings, module, pmap, plan, partition, comm)
        return cls(module, pmap, plan, partition, comm, averager=averager, before_finish=before_finish)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.averager.in_step and torch.is_grad_enabled():
            # A new step (the framework's loop prepared it already). A loop that did not zero the
            # gradients accumulates onto the averaged ones, as with DDP.
            self.averager.prepare(keep_grads=any(p.grad is not None for p in self.averager.params.values()))
        return self.module(*args, **kwargs)

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.averager._sync_enabled and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self._queued = False
        if self.before_finish is not None:
            self.before_finish()
        # collective: every rank reaches the end of its backward; the owner groups' reductions complete here.
        self.averager.finish()

    def remove_hooks(self) -> None:
        """Detach from the module (the framework's re-plan builds a new wrapper on the new model)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.averager.remove_hooks()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (every micro-batch but the last), as DDP's ``no_sync``."""
        with self.averager.no_sync():
            yield

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the averaged full model's gradient, each unit counted once. Collective."""
        # collective: every rank (one world all-reduce of the squared norms below C = 1).
        return torch.tensor(self.averager.clip_grad_norm_(max_norm))

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def units_held(self) -> list[str]:
        return [self.partition.units[u].name for u in self.plan.owned[self.rank]]

    @property
    def params_held(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @property
    def bytes_per_step(self) -> int:
        """Payload this rank hands to the gradient all-reduces per step."""
        return self.averager.bytes_per_step()

    @property
    def bytes_sent(self) -> int:
        """Payload handed to collectives since the start."""
        return self.comm.bytes.total()

    # ------------------------------------------------------------------ state
    def _writer(self, global_name: str) -> int:
        unit = self._unit_of.get(global_name)
        return 0 if unit is None else min(self.plan.owners(unit))

    @property
    def _unit_of(self) -> dict[str, int]:
        return {s.name: u.id for u in self.partition.units for s in u.slices + u.buffers}

    def unit_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's share of the model, keyed by unit name (``"shared"`` for the rest): each tensor
        appears on exactly one rank, its lowest owner, so the union of all ranks' dicts is the model once."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        unit_of = self._unit_of
        for local, t in self.module.state_dict().items():
            name = self.pmap.pieces[local][0].global_name
            if self._writer(name) == self.rank:
                key = self.partition.units[unit_of[name]].name if name in unit_of else "shared"
                out.setdefault(key, {})[name] = t.detach().clone()
        return out

    def state_dict_full(self) -> dict[str, torch.Tensor]:
        """The union model's state dict (global names), on every rank. Collective (gathers on the CPU)."""
        # collective: every rank hands its share to every other.
        shares = self.comm.all_gather_object({n: t.cpu() for d in self.unit_state_dict().values()
                                              for n, t in d.items()})
        out: dict[str, torch.Tensor] = {}
        for share in shares:
            out.update(share)
        order = list(self.partition.shapes)
        return {n: out[n] for n in order if n in out}

    def load_state_dict_full(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's tensors from a full-model state dict (global names)."""
        with torch.no_grad():
            for local, t in self.module.state_dict(keep_vars=True).items():
                t.copy_(state[self.pmap.pieces[local][0].global_name])

    def _dcp_state(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        model = {self.pmap.pieces[n][0].global_name: t for n, t in self.module.state_dict().items()}
        state: dict[str, Any] = {"model": model}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(self.module, optimizer)
        return state

    def save(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Write the model (and ``optimizer``) with torch's distributed checkpoint (DCP). Collective.

        Every rank hands in all it holds under the full model's names; DCP keeps one copy of a tensor
        several ranks hand in (its owners hold it bit-identical), so each piece is written once.
        """
        # collective: DCP plans the write over every rank.
        dcp.save(self._dcp_state(optimizer), checkpoint_id=str(path))

    def load(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read this rank's tensors (and ``optimizer``'s state) from a :meth:`save` directory. Collective."""
        state = self._dcp_state(optimizer)
        # collective: DCP plans the read over every rank.
        dcp.load(state, checkpoint_id=str(path))
        if optimizer is not None:
            set_optimizer_state_dict(self.module, optimizer, state["optim"])

    def export(self, model: nn.Module) -> nn.Module:
        """Load the union model into ``model``, an instance of the user's own class. Collective."""
        model.load_state_dict(self.state_dict_full())
        return model


def _adapter_subnetwork(model: nn.Module, adapter: ModelAdapter, spec: DataSpec | None, mcfg: MaskerConfig,
                        masker: Masker, seed: int, device: torch.device | str) -> tuple[nn.Module, ParamMap, MaskPlan, Partition]:
    """A registered adapter's partition, plan and materialised blocks (the framework's own path)."""
    if spec is None:
        raise ConfigError("spec", None, "an adapter's partition needs the data's DataSpec", "pass spec=data.spec()")
    skeleton = copy.deepcopy(model)
    partition = partition_model(adapter, model, mcfg, spec)
    plan = make_plan(masker, partition, dist.get_world_size(), seed, mcfg.min_owners)
    local, pmap = local_model(adapter, model, plan.owned[dist.get_rank()], partition, mcfg)
    initialise(local, pmap, Initialiser(skeleton, adapter, seed), device)
    return local, pmap, plan, partition


def parallelize(model: nn.Module, units: str | Sequence[str] | ModelAdapter, coverage: float = 0.5, seed: int = 0,
                masker: str = "cyclic", skip: Skip = None, device: torch.device | str = "cpu",
                init: Callable[[str, nn.Module], None] | None = None, bucket_cap_mb: float = 25.0,
                min_owners: int = 1, spec: DataSpec | None = None) -> SubnetworkParallel:
    """Wrap a meta-device ``model`` so this rank trains its own subnetwork (SDP).

    Args:
        model: the full model, built under ``torch.device("meta")``.
        units: module paths of the units: a glob (``"layers.*"``; ``*`` is one path component) or a list;
            or a registered :class:`ModelAdapter` (with ``spec``): its block partition, skip rules and
            initialisation, as the framework's loop uses them.
        coverage: the share of units each rank keeps (1: every rank keeps all, as DDP).
        seed: the plan's and the initialisation's seed (the same on every rank).
        masker: a registered masker (``cyclic``, ``random``, ``balanced``).
        skip: what a dropped unit computes: ``"identity"``, a function ``(name, module) -> nn.Module``,
            or a dict by class name or module glob; default: the known blocks' rules.
        device: where the rank's tensors are allocated.
        init: ``(name, module)`` initialising a module's own tensors (default: ``reset_parameters``,
            or the ``transformers`` model's ``_init_weights``), under a seed from ``seed`` and ``name``.

    Raises:
        ConfigError: bad input, one line, before any group or tensor is created.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("process group", "not initialised", "parallelize averages among ranks",
                          "call torch.distributed.init_process_group first (torchrun sets its environment)")
    _check_meta(model)
    mcfg = MaskerConfig(name=masker, coverage=float(coverage), min_owners=min_owners)
    masker_obj = PluginManager().registries["masker"].create(masker, mcfg)
    comm = ProcessGroupCommunicator(torch.device(device))
    if isinstance(units, ModelAdapter):
        local, pmap, plan, partition = _adapter_subnetwork(model, units, spec, mcfg, masker_obj, seed, device)
        return SubnetworkParallel(local, pmap, plan, partition, comm, bucket_cap_mb)
    names = find_units(model, units)
    skeleton = copy.deepcopy(model)  # the full model on meta: the initialiser reads shapes from it
    skips = {n: skip_module(n, model.get_submodule(n), skip) for n in names}
    partition = block_partition(model, names, skips)
    plan = make_plan(masker_obj, partition, dist.get_world_size(), seed, min_owners)
    rank = dist.get_rank()
    global_names = {id(t): n for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    owned = set(plan.owned[rank])
    drop_units(model, {n: skips[n] for i, n in enumerate(names) if i not in owned})
    pmap = global_map(model, global_names)
    initialise(model, pmap, Initialiser(skeleton, _ResetInit(skeleton, init), seed), device)
    return SubnetworkParallel(model, pmap, plan, partition, comm, bucket_cap_mb)

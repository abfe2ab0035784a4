"""Owner-local construction: a rank builds its subnetwork without materialising what it does not own.

1. The full model is built on the ``meta`` device (:func:`meta_model`): structure and shapes, no
   storage. The partition, the units' FLOPs and the plan come from it.
2. The adapter materialises the rank's subnetwork from a copy of it, still on ``meta``.
3. :func:`initialise` gives the held tensors storage on the rank's device and their initial
   values: each is cut from the module that holds it in the full model, initialised on its own
   (a stand-alone copy of that one module at full size on CPU, by the adapter's
   :meth:`~subnetdp.core.contracts.ModelAdapter.init_module`, with torch's RNG seeded from the
   seed and the module's global name). A rank copies the pieces it holds and drops the rest.

A tensor's initial value therefore depends on the seed and its global name alone: the union model at
step 0 is the same, tensor for tensor, whatever the world size, coverage or masker, and
:func:`initial_model` (everything owned, one process) is the model every run starts from, the one a
torch DDP baseline must start from to be compared. Besides the rank's own tensors, construction holds
one module of the full model at a time (the largest is a neuron-level layer's whole weight, or an
embedding every rank holds anyway).
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from subnetdp.core.contracts import DataSpec, ModelAdapter, ParamMap, Partition, Piece
from subnetdp.core.errors import SubnetdpError
from subnetdp.sdp.branches import regularize
from subnetdp.sdp.variants import local_model, regime_of


def build_model(adapter: ModelAdapter, spec: DataSpec) -> nn.Module:
    """The full model as a run trains it: the adapter's plain model, with the configured regularisers
    (``model.stochastic_depth``, ``model.hidden_dropout``) attached from outside."""
    return regularize(adapter, adapter.build(spec))


class _NoMetaFills(TorchFunctionMode):
    """An initialiser's random fill of a ``meta`` tensor is skipped: there is nothing to fill, and torch
    computes the meta result of ``normal_``, ``erfinv_`` and ``clamp_`` through Python decompositions
    (about 1, 0.2 and 4 ms a call, measured; torchvision's ResNet-18 spends half its meta build in
    ``kaiming_normal_``). Every value is made later, on the rank's device (:func:`initialise`)."""

    FILLS = frozenset({"normal_", "uniform_", "erfinv_", "clamp_", "clamp_min_", "clamp_max_", "bernoulli_",
                       "exponential_", "random_", "log_normal_", "cauchy_", "geometric_"})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.FILLS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]  # what an in-place fill returns
        return func(*args, **(kwargs or {}))


def meta_model(adapter: ModelAdapter, spec: DataSpec) -> nn.Module:
    """The full model on the ``meta`` device: every shape, no storage, nothing initialised."""
    with torch.device("meta"), _NoMetaFills():
        return build_model(adapter, spec)


def module_seed(seed: int, name: str) -> int:
    """The RNG seed of the module called ``name`` (its global name; ``""`` is the root)."""
    return int.from_bytes(hashlib.sha256(f"subnetdp-init:{seed}:{name}".encode()).digest()[:8], "little") >> 1


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of names under which one parameter object appears (tied weights), first name first."""
    seen: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return [names for names in seen.values() if len(names) > 1]


def to_empty(model: nn.Module, device: torch.device | str) -> None:
    """``model.to_empty(device)`` that keeps tied weights tied (``to_empty`` alone unties them)."""
    ties = tied_parameters(model)
    model.to_empty(device=device)
    for names in ties:
        first = model.get_parameter(names[0])
        for alias in names[1:]:
            path, _, attr = alias.rpartition(".")
            setattr(model.get_submodule(path) if path else model, attr, first)


def _standalone(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its children (left on ``meta``) with its own tensor slots."""
    shell = copy.copy(module)
    shell._parameters = dict(module._parameters)
    shell._buffers = dict(module._buffers)
    shell._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    shell._modules = dict(module._modules)
    return shell


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in list(module._parameters.items()) + list(module._buffers.items()):
        if t is not None:
            yield name, t


def _poison(t: torch.Tensor) -> None:
    """Fill an uninitialised tensor with a value no initialisation produces, to detect it afterwards."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.data.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.data.fill_(torch.iinfo(t.dtype).min)


def _poisoned(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t.sum()))  # a NaN anywhere makes the sum NaN: one pass, no mask
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).any())


def poison(model: nn.Module) -> None:
    """Fill every tensor of ``model`` with a value no initialisation produces (see :func:`poisoned`)."""
    for t in list(model.parameters()) + list(model.buffers()):
        _poison(t)


def poisoned(model: nn.Module) -> list[str]:
    """Names of ``model``'s tensors still holding (some of) what :func:`poison` put there."""
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if _poisoned(t)]


class Initialiser:
    """The full-size initial values of the full model's tensors, one module at a time.

    Args:
        skeleton: the full model on ``meta`` (:func:`meta_model`); never modified.
        adapter: whose :meth:`~subnetdp.core.contracts.ModelAdapter.init_module` initialises.
        seed: the run's seed.
    """

    def __init__(self, skeleton: nn.Module, adapter: ModelAdapter, seed: int) -> None:
        self.skeleton, self.adapter, self.seed = skeleton, adapter, int(seed)
        self.initialised: list[str] = []  # module names, in the order they were initialised

    @torch.no_grad()
    def module_tensors(self, path: str) -> dict[str, torch.Tensor]:
        """The initial values of the tensors module ``path`` holds itself, by global tensor name."""
        try:
            source = self.skeleton.get_submodule(path) if path else self.skeleton
        except AttributeError:
            raise SubnetdpError(f"{type(self.adapter).__name__}: the subnetwork holds tensors of a module "
                                f"{path!r} the full model does not have: materialize must keep global names") from None
        shell = _standalone(source)
        shell.to_empty(device="cpu", recurse=False)
        for _, t in _own_tensors(shell):
            _poison(t)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(self.seed, path))
            self.adapter.init_module(path, shell)
        self.initialised.append(path)
        prefix = f"{path}." if path else ""
        out = {}
        for name, t in _own_tensors(shell):
            if _poisoned(t):
                raise SubnetdpError(f"{type(self.adapter).__name__}.init_module left {prefix}{name} of "
                                    f"{type(source).__name__} {path or '(root)'!r} uninitialised: initialise it there "
                                    "(the default calls the module's reset_parameters)")
            out[prefix + name] = t
        return out


def _module_of(global_name: str) -> str:
    return global_name.rpartition(".")[0]


def _cut(t: torch.Tensor, dim: int | None, start: int, stop: int) -> torch.Tensor:
    return t if dim is None else t.narrow(dim, start, stop - start)


@torch.no_grad()
def initialise(model: nn.Module, pmap: ParamMap, init: Initialiser, device: torch.device | str) -> None:
    """Give ``model``'s ``meta`` tensors storage on ``device`` and each its initial value.

    Every local tensor is filled piece by piece from the full-size initial value of the global tensor
    the piece belongs to (:class:`Initialiser`, one module of the full model at a time).
    """
    to_empty(model, device)
    local = dict(model.named_parameters())
    local.update(dict(model.named_buffers()))
    missing = sorted(set(local) - set(pmap.pieces))
    if missing:
        raise SubnetdpError(f"{type(init.adapter).__name__}: the subnetwork's {missing[:3]} are not in its ParamMap")
    by_module: dict[str, list[tuple[str, Piece]]] = {}
    for lname, pieces in pmap.pieces.items():
        if lname not in local:
            continue
        for p in pieces:
            by_module.setdefault(_module_of(p.global_name), []).append((lname, p))
    for path, wanted in by_module.items():
        values = init.module_tensors(path)
        for lname, p in wanted:
            dst = _cut(local[lname], p.dim, p.local_start, p.local_stop)
            dst.copy_(_cut(values[p.global_name], p.dim, p.global_start, p.global_stop))
        del values  # one module of the full model at a time


def build_local(adapter: ModelAdapter, skeleton: nn.Module, owned: Sequence[int], partition: Partition,
                mcfg: Any, seed: int, device: torch.device | str,
                init: Initialiser | None = None) -> tuple[nn.Module, ParamMap]:
    """What a rank holds, initialised on ``device``: its subnetwork (forward masking) or the full model
    with non-owned units masked (backward masking, which holds the whole model by definition)."""
    init = init or Initialiser(skeleton, adapter, seed)
    if regime_of(mcfg).full_model:
        full = copy.deepcopy(skeleton)
        initialise(full, identity_map(full), init, device)
        return local_model(adapter, full, owned, partition, mcfg)
    with torch.device("meta"):  # modules the adapter creates while narrowing stay on meta too
        model, pmap = local_model(adapter, copy.deepcopy(skeleton), owned, partition, mcfg)
    initialise(model, pmap, init, device)
    return model, pmap


def empty_local(adapter: ModelAdapter, spec: DataSpec, owned: Sequence[int], partition: Partition, mcfg: Any,
                device: torch.device | str) -> tuple[nn.Module, ParamMap]:
    """What a rank holds under a new plan, with storage on ``device`` and no values yet: every tensor is
    poisoned (:func:`poison`), so one that whoever fills it leaves unset shows in :func:`poisoned`."""
    with torch.device("meta"):  # structure only: every value is received or copied in afterwards
        model, pmap = local_model(adapter, meta_model(adapter, spec), owned, partition, mcfg)
    to_empty(model, device)
    poison(model)
    return model, pmap


def identity_map(model: nn.Module) -> ParamMap:
    """Every tensor of ``model`` as the whole global tensor of the same name."""
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return ParamMap.identity(names, {})


def initial_model(adapter: ModelAdapter, spec: DataSpec, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The full model every run of ``seed`` starts from (its union at step 0), in one process.

    The starting point of a baseline that must match SDP at C = 1 (torch DDP, FSDP).
    """
    model = meta_model(adapter, spec)
    initialise(model, identity_map(model), Initialiser(meta_model(adapter, spec), adapter, seed), device)
    return model


def drop_in_place(adapter: ModelAdapter, model: nn.Module, pmap: ParamMap, owned: Sequence[int],
                  partition: Partition) -> ParamMap | str | None:
    """``model`` (a subnetwork holding more units than ``owned``) less every unit not in ``owned``, in
    place (:meth:`~subnetdp.core.contracts.ModelAdapter.drop_units`): its new map; None when the
    adapter cannot (``model`` is untouched); a line saying what is wrong when the adapter's result
    fails the check (``model`` is then changed and must not be trained: the caller builds anew).

    The check: the model holds exactly the tensors its new map names, each the same object with the
    same pieces as before, and it lost exactly the tensors of the dropped units (a shared tensor or
    one holding pieces of several units stays)."""
    held = dict(_named_tensors(model))
    new = adapter.drop_units(model, owned, partition)
    if new is None:
        return None
    now, keep = dict(_named_tensors(model)), set(owned)
    if set(now) - set(held):
        return f"it made tensors the model did not hold: {sorted(set(now) - set(held))[:3]}"
    if set(now) != set(new.pieces):
        return f"its map names {sorted(set(now) ^ set(new.pieces))[:3]} but the model does not hold them, or holds them unnamed"
    for name, t in held.items():
        unit = pmap.unit_of.get(name)
        if (unit is not None and unit not in keep) != (name not in now):
            return f"{name} ({'unit ' + str(unit) if unit is not None else 'shared'}) was {'kept' if name in now else 'dropped'}"
        if name in now and (now[name] is not t or new.pieces[name] != pmap.pieces[name]):
            return f"{name} is not the tensor it was, or maps to other pieces"
    return new


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()

"""The run's components as torch's ``Stateful``: ``state_dict()`` / ``load_state_dict(state)``.

A checkpoint holds a mapping of them (:meth:`~subnetdp.train.state.TrainState.stateful`, with the
loader and the host RNGs the checkpointer adds), as torchtitan's ``CheckpointManager(states={...})``
does: the checkpointer asks each for its state and hands each its state back, and knows none of
their insides. Those that keep state per parameter key it by the parameter's local name, each tensor
of its parameter's local shape, so the checkpointer cuts it into pieces and keys it by unit like the
parameter (``train/checkpoints/units.py``):

- :class:`ModelUnits`: the rank's model, keyed by piece (a unit's slice of a global tensor, or a shared
  tensor): ``{"params": {piece key: view}, "buffers": {piece key: view}}``;
- the synchroniser: ``{"pieces": {prefix: {local name: tensor}}, "rank": {...}}`` (``sdp/sync/protocol.py``);
- :class:`OptimizerUnits`: the optimizer's class, its groups' hyper-parameters and each parameter's state;
- :class:`HostRng`: the torch, numpy and Python RNG states;
- the learning-rate schedule and the training loader (their own ``state_dict``).

Here, not in ``train/checkpoints/``: the training state hands these out, and it imports nothing of
the checkpoints (the floors, ``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Protocol

import numpy as np
import torch
from torch import nn

from subnetdp.core.contracts import ParamMap, Partition
from subnetdp.core.errors import CheckpointError
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.pieces import LocalIndex, global_items, item_key


class Stateful(Protocol):
    """What a checkpoint asks of each component it holds (torch.distributed.checkpoint's shape)."""

    def state_dict(self) -> dict[str, Any]:
        """The component's state: tensors and plain values."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave."""


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


def set_rng_state(state: Mapping[str, Any]) -> None:
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


class HostRng:
    """The process's RNG streams (torch CPU and CUDA, numpy, Python) as one Stateful.

    ``load_state_dict({"seed": n})`` starts fresh streams from ``n`` instead: a rank whose saved
    streams have no counterpart (another world size, or a rank that died with its own)."""

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) == {"seed"}:
            reseed(int(state["seed"]))
        else:
            set_rng_state(state)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def local_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The local name of every optimizer parameter, in the optimizer's order (outside ``gathered()``)."""
    names = {id(t): n for n, t in model.named_parameters()}
    return [names[id(p)] for p in optimizer_params(optimizer)]


class OptimizerUnits:
    """The optimizer as a Stateful keyed by parameter, not by its position in the optimizer:
    ``{"class": name, "param_groups": [hyper-parameters, no params], "params": {local name: state}}``.

    Each parameter's state has its parameter's full local shape (a sharded rank's shards gathered),
    so the checkpointer cuts it by unit like the parameter, and a rank holding other units (a
    resume on another plan) takes exactly its own parameters' state back.

    Args:
        model: the rank's model (its parameter names).
        optimizer: the optimizer over its parameters.
        parallel: the rank's parallelisms (:class:`~subnetdp.parallel.apply.RankParallelism`), which
            gather sharded optimizer state and cut it back.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, parallel: Any) -> None:
        self.model, self.optimizer, self.parallel = model, optimizer, parallel

    def state_dict(self) -> dict[str, Any]:
        """Collective when sharded: each parameter's state is gathered over its shard group."""
        optimizer = self.optimizer
        names = local_names(self.model, optimizer)
        full = self.parallel.optimizer_state_full(optimizer)
        return {"class": type(optimizer).__name__,
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in optimizer.state_dict()["param_groups"]],
                "params": dict(zip(names, full))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the groups' hyper-parameters and the state of the parameters this rank holds (a
        parameter the mapping lacks starts fresh). A CheckpointError names what does not fit."""
        optimizer = self.optimizer
        if state.get("class") != type(optimizer).__name__:
            raise CheckpointError(f"optimizer {state.get('class')}, this run uses {type(optimizer).__name__}: "
                                  "use the same optim.name or start a new run")
        groups = state["param_groups"]
        mine = optimizer.state_dict()["param_groups"]
        if len(groups) != len(mine):
            raise CheckpointError(f"{len(groups)} optimizer parameter groups, this run has {len(mine)}")
        found = state.get("params") or {}
        names = local_names(self.model, optimizer)
        sd = {"state": {i: found[n] for i, n in enumerate(names) if n in found},
              "param_groups": [{**g, "params": m["params"]} for g, m in zip(groups, mine)]}
        try:
            optimizer.load_state_dict(sd)
            self.parallel.optimizer_state_from_full(optimizer)
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"its optimizer state does not fit this run ({e})") from None


class ModelUnits:
    """The rank's model as a Stateful keyed by piece, not by its local names: every piece the rank holds
    under ``plan`` (a unit's slice of a global tensor, or a shared tensor) under its checkpoint key
    (:func:`~subnetdp.sdp.pieces.item_key`, the global name and slice), so a rank holding other units
    (a resume on another plan or world size) takes exactly its own pieces from any checkpoint. Like
    :meth:`subnetdp.parallel.wrapper.SubnetworkParallel.unit_state_dict`, but every piece the rank
    holds (the checkpointer picks each piece's writer) and the live views, not copies.

    ``state_dict()``: ``{"params": {key: view}, "buffers": {key: view}}``, views into the model's
    tensors (taken at the call: inside ``gathered()`` for a sharded model). ``load_state_dict(state)``
    copies ``state["params"][key]`` into every parameter piece the rank holds (a missing key is a
    KeyError), and the buffers ``state["buffers"]`` holds; ``state`` may be any mapping (the
    checkpointer's reads a piece from disk when asked).
    """

    def __init__(self, model: nn.Module, pmap: ParamMap, partition: Partition, plan: MaskPlan, rank: int) -> None:
        self.model, self.pmap, self.partition, self.plan, self.rank = model, pmap, partition, plan, rank

    def _views(self, buffers: bool) -> dict[str, torch.Tensor]:
        index = LocalIndex(self.model, self.pmap)
        out = {}
        for it in global_items(self.partition, self.plan, buffers=buffers):
            found = index.find(it) if self.rank in it.owners else None
            if found is not None:
                out[item_key(it)] = index.view(it)
            elif not buffers and self.rank in it.owners:  # the plan says this rank holds it
                raise CheckpointError(f"rank {self.rank} owns {item_key(it)} but its model does not hold it "
                                      "(model and plan disagree)")
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"params": self._views(False), "buffers": self._views(True)}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, view in self._views(False).items():
            view.copy_(state["params"][key])
        values = state.get("buffers") or {}
        for key, view in self._views(True).items():
            if key in values:
                view.copy_(values[key])

"""Owner-local construction: each rank materialises and initialises only what it holds.

- The union at step 0 is the same tensor for tensor at any world size, coverage or masker (every
  owner of every piece holds the W = 1, C = 1 model's value, bit for bit), for ResNet, Swin, LLaMA.
- Forward masking never materialises a tensor of a unit the rank does not own: every storage created
  while a rank is built is counted (a dispatch mode), and every module initialised is recorded.
- The per-module initialisation follows each architecture's own scheme (compared with the model the
  adapter builds eagerly: same tensors, constants equal, random tensors with the same spread).
- An adapter that leaves a tensor uninitialised is told which one.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from subnetdp.core.contracts import ParamMap
from subnetdp.core.errors import SubnetdpError
from subnetdp.core.plan import make_plan
from subnetdp.sdp.construct import Initialiser, build_local, initial_model, meta_model
from subnetdp.sdp.pieces import LocalIndex, global_items
from subnetdp.sdp.variants import partition_model
from tests.helpers import plugin_manager, small_config

MODELS = [("resnet18_digits", "block"), ("resnet18_digits", "neuron"), ("swin_cifar_digits", "block"),
          ("swin_cifar_digits", "neuron"), ("llama_tiny_stdlib", "block"), ("llama_tiny_stdlib", "neuron")]


def _setup(recipe: str, granularity: str, *extra: str):
    cfg = small_config(f"masker.granularity={granularity}", "masker.units_per_layer=4", *extra, recipe=recipe)
    regs = plugin_manager().registries
    spec = regs["data"].create(cfg.data.name, cfg.data, seed=0).spec()
    adapter = regs["model"].create(cfg.model.name, cfg.model)
    skeleton = meta_model(adapter, spec)
    return cfg, regs, spec, adapter, skeleton, partition_model(adapter, skeleton, cfg.masker, spec)


def _index(model: nn.Module) -> LocalIndex:
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return LocalIndex(model, ParamMap.identity(names, {}))


@pytest.mark.parametrize("recipe,granularity", MODELS)
def test_step0_union_is_the_same_at_any_world_size_coverage_and_masker(recipe, granularity):
    cfg, regs, spec, adapter, skeleton, partition = _setup(recipe, granularity)
    reference = _index(initial_model(adapter, spec, int(cfg.seed)))
    checked = 0
    for masker_name, world, coverage in (("cyclic", 4, 0.5), ("random", 3, 0.5)):
        cfg.masker.coverage = coverage
        masker = regs["masker"].create(masker_name, cfg.masker)
        plan = make_plan(masker, partition, world, int(cfg.seed), 1)
        assert any(len(plan.owners(u.id)) < world for u in partition.units)
        for rank in range(world):
            model, pmap = build_local(adapter, skeleton, plan.owned[rank], partition, cfg.masker, int(cfg.seed), "cpu")
            index = LocalIndex(model, pmap)
            for item in global_items(partition, plan) + global_items(partition, plan, buffers=True):
                if rank in item.owners:
                    assert torch.equal(index.view(item), reference.view(item)), (masker_name, world, rank, item.name)
                    checked += 1
                else:
                    assert not index.holds(item), (rank, item.name)
    assert checked > len(partition.units)
    # Another seed gives another model.
    other = initial_model(adapter, spec, int(cfg.seed) + 1)
    name = next(n for n, p in other.named_parameters() if p.dim() > 1)
    assert not torch.equal(other.get_parameter(name), reference.tensors[name])


class _Allocations(TorchDispatchMode):
    """Every storage an operator creates off the meta device: its bytes, and the live peak."""

    def __init__(self) -> None:
        super().__init__()
        self.total = self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st._cdata not in inputs and st._cdata not in self._seen:
                    self._seen.add(st._cdata)
                    self.total += st.nbytes()
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, st.nbytes())
        return out

    def _free(self, n: int) -> None:
        self.live -= n


def _module_bytes(skeleton: nn.Module, path: str) -> int:
    m = skeleton.get_submodule(path) if path else skeleton
    return sum(t.numel() * t.element_size() for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))


@pytest.mark.parametrize("recipe,granularity", [("resnet18_digits", "block"), ("resnet18_digits", "neuron"),
                                                ("llama_tiny_stdlib", "block")])
def test_forward_masking_never_materialises_a_tensor_the_rank_does_not_own(recipe, granularity):
    cfg, regs, spec, adapter, skeleton, partition = _setup(recipe, granularity, "masker.coverage=0.5")
    plan = make_plan(regs["masker"].create("cyclic", cfg.masker), partition, 4, 0, 1)
    for rank in (0, 3):
        init = Initialiser(skeleton, adapter, int(cfg.seed))
        with _Allocations() as seen:
            model, pmap = build_local(adapter, skeleton, plan.owned[rank], partition, cfg.masker, int(cfg.seed), "cpu",
                                      init=init)
        held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
        # Modules initialised: exactly those holding a tensor this rank keeps; none of a dropped unit
        # alone (a neuron-level layer is initialised whole, then cut to the owned ranges).
        kept_tensors = {p.global_name for ps in pmap.pieces.values() for p in ps}
        assert set(init.initialised) == {n.rpartition(".")[0] for n in kept_tensors}
        assert len(init.initialised) == len(set(init.initialised))
        not_owned = [u for u in partition.units if u.id not in plan.owned[rank]]
        assert not_owned
        if granularity == "block":
            dropped = {s.name for u in not_owned for s in u.slices + u.buffers}
            assert not dropped & kept_tensors
            assert not {n.rpartition(".")[0] for n in dropped} & set(init.initialised)
        # Storage created: the rank's own tensors plus one full-size module at a time, nothing more.
        transient = sum(_module_bytes(skeleton, p) for p in init.initialised)
        largest = max(_module_bytes(skeleton, p) for p in init.initialised)
        assert held <= seen.total <= held + transient + 4096, (seen.total, held, transient)
        assert seen.peak <= held + largest + 4096, (seen.peak, held, largest)


@pytest.mark.parametrize("recipe", ["resnet18_digits", "swin_cifar_digits", "llama_tiny_stdlib"])
def test_per_module_initialisation_follows_the_architectures_scheme(recipe):
    cfg, regs, spec, adapter, skeleton, partition = _setup(recipe, "block")
    ours = initial_model(adapter, spec, 0)
    torch.manual_seed(0)
    eager = adapter.build(spec)  # the architecture's own initialisation, whole-model
    ours_t = dict(ours.named_parameters()) | dict(ours.named_buffers())
    eager_t = dict(eager.named_parameters()) | dict(eager.named_buffers())
    assert ours_t.keys() == eager_t.keys()
    for name, t in eager_t.items():
        mine = ours_t[name]
        assert mine.shape == t.shape and mine.dtype == t.dtype, name
        if not t.dtype.is_floating_point or bool((t == t.flatten()[0]).all()):
            assert torch.equal(mine, t), name  # constants (norm weights, biases, statistics, indices)
        elif t.numel() >= 4096:
            # The same distribution: equal spread within what 4096+ samples allow.
            assert abs(float(mine.detach().std()) / float(t.detach().std()) - 1) < 0.1, name
            assert abs(float(mine.detach().mean()) - float(t.detach().mean())) < 0.1 * float(t.detach().std()), name


def test_an_uninitialised_tensor_is_named():
    cfg, regs, spec, adapter, skeleton, partition = _setup("resnet18_digits", "block")

    class Lazy(type(adapter)):
        def init_module(self, name, module):
            if not isinstance(module, nn.BatchNorm2d):
                super().init_module(name, module)

    lazy = Lazy(cfg.model)
    with pytest.raises(SubnetdpError, match=r"init_module left bn1\.weight of BatchNorm2d 'bn1' uninitialised"):
        initial_model(lazy, spec, 0)

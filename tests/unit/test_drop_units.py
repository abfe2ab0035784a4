"""A subnetwork loses units in place (``ModelAdapter.drop_units``): what a member of a world that grows back
at a join does with the units it gained at W-1, instead of building a new model.

- For ResNet, Swin and LLaMA at block level, a subnetwork of units A that drops all but B ⊂ A is the
  subnetwork of B: the same tensor names and shapes, the kept tensors the same objects, and the same
  forward output, bit for bit, as the subnetwork of B built from the seed.
- Neuron level cannot (a narrowed tensor would change shape): None, and the model is untouched.
- An adapter whose result is wrong (it keeps a dropped unit, or hands back new tensors) is caught by the
  check and named in one line, so the framework builds anew.
"""

from __future__ import annotations

import copy

import pytest
import torch

from subnetdp.core.contracts import ParamMap
from subnetdp.core.plan import make_plan
from subnetdp.sdp.construct import build_local, drop_in_place
from tests.unit.test_construct import _setup


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("recipe", ["resnet18_digits", "swin_cifar_digits", "llama_tiny_stdlib"])
def test_a_subnetwork_that_drops_units_in_place_is_the_smaller_subnetwork(recipe):
    cfg, regs, spec, adapter, skeleton, partition = _setup(recipe, "block")
    bigger = [u.id for u in partition.units][1:]  # all but the first unit
    # Keep every other one: the dropped ones sit between kept ones, in every stage the model has.
    smaller = bigger[::2]
    assert len(bigger) >= 3 and set(smaller) < set(bigger)
    model, pmap = build_local(adapter, skeleton, bigger, partition, cfg.masker, int(cfg.seed), "cpu")
    held = _tensors(model)
    new = drop_in_place(adapter, model, pmap, smaller, partition)
    assert isinstance(new, ParamMap), new
    want, want_pmap = build_local(adapter, skeleton, smaller, partition, cfg.masker, int(cfg.seed), "cpu")
    got = _tensors(model)
    assert {n: t.shape for n, t in got.items()} == {n: t.shape for n, t in _tensors(want).items()}
    assert new.pieces == want_pmap.pieces and new.unit_of == want_pmap.unit_of
    assert all(got[n] is held[n] for n in got)  # in place: the kept tensors themselves, values and all
    dropped = {s.name for u in set(bigger) - set(smaller) for s in partition.units[u].slices}
    assert dropped and not dropped & set(got)
    torch.manual_seed(0)
    x = torch.randint(0, spec.vocab_size, (2, 8)) if spec.vocab_size else torch.randn(2, spec.in_channels or 3, 32, 32)
    model.eval(), want.eval()
    with torch.no_grad():
        assert torch.equal(model(x), want(x))
    # Dropping again, from what it dropped to, goes on the same way.
    again = drop_in_place(adapter, model, new, smaller[:1], partition)
    assert isinstance(again, ParamMap) and len(_tensors(model)) < len(got)


def test_neuron_level_cannot_and_leaves_the_model_as_it_was():
    cfg, regs, spec, adapter, skeleton, partition = _setup("resnet18_digits", "neuron")
    plan = make_plan(regs["masker"].create("cyclic", cfg.masker), partition, 2, int(cfg.seed), 1)
    model, pmap = build_local(adapter, skeleton, plan.owned[0], partition, cfg.masker, int(cfg.seed), "cpu")
    before = {n: t.shape for n, t in _tensors(model).items()}
    assert drop_in_place(adapter, model, pmap, sorted(plan.owned[0])[:1], partition) is None
    assert {n: t.shape for n, t in _tensors(model).items()} == before


class _KeepsEverything:
    """An adapter whose drop_units drops nothing and says it did."""

    def __init__(self, inner):
        self.inner = inner

    def drop_units(self, model, owned, partition):
        return copy.deepcopy(self._pmap)


class _NewTensors:
    """An adapter whose drop_units drops right but hands back copies of the tensors it keeps."""

    def __init__(self, inner):
        self.inner = inner

    def drop_units(self, model, owned, partition):
        pmap = self.inner.drop_units(model, owned, partition)
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(p.detach().clone()))
        return pmap


@pytest.mark.parametrize("wrong,said", [(_KeepsEverything, "was kept"), (_NewTensors, "is not the tensor it was")])
def test_a_wrong_drop_is_caught_and_named(wrong, said):
    cfg, regs, spec, adapter, skeleton, partition = _setup("resnet18_digits", "block")
    units = [u.id for u in partition.units]
    model, pmap = build_local(adapter, skeleton, units, partition, cfg.masker, int(cfg.seed), "cpu")
    bad = wrong(adapter)
    bad._pmap = pmap
    problem = drop_in_place(bad, model, pmap, units[:2], partition)
    assert isinstance(problem, str) and said in problem, problem

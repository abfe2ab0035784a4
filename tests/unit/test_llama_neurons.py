"""Neuron-level LLaMA: a materialised subnetwork is the full model with dropped hidden neurons zeroed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from subnetdp.sdp.backward import apply_backward_masking
from subnetdp.core.contracts import DataSpec, ParamMap
from subnetdp.core.errors import ConfigError
from subnetdp.sdp.pieces import LocalIndex, global_items
from subnetdp.core.plan import MaskPlan
from subnetdp.plugins.models.llama.adapter import LlamaAdapter, LlamaConfig
from tests.helpers import assert_pieces_at_global_coordinates

SPEC = DataSpec(vocab_size=97, seq_len=16)
K = 4  # units per layer


def _adapter() -> LlamaAdapter:
    cfg = OmegaConf.structured(LlamaConfig)
    cfg.variant = "tiny"
    return LlamaAdapter(cfg)


def _full():
    torch.manual_seed(0)
    return _adapter().build(SPEC)


def _zero_dropped(model: torch.nn.Module, partition, owned: set[int], rescale: bool) -> None:
    """Reference: the full model with dropped hidden neurons zeroed and the MLP output scaled by K/n."""
    for group, units in partition.groups().items():
        ff = model.get_submodule(group)
        mask = torch.zeros(ff.w1.out_features)
        kept = [u for u in units if u.id in owned]
        for u in kept:
            mask[u.slices[0].start:u.slices[0].stop] = 1.0
        scale = len(units) / max(1, len(kept)) if rescale else 1.0

        def hook(module, args, mask=mask, scale=scale):
            return (args[0] * mask * (scale if module.training else 1.0),)
        ff.w2.register_forward_pre_hook(hook)


def test_partition_cuts_the_swiglu_hidden_dimension_and_everything_else_is_shared():
    model = _full()
    a = model.args
    partition = _adapter().partition(model, "neuron", SPEC, units_per_layer=K)
    assert len(partition.units) == K * a.n_layers and len(partition.groups()) == a.n_layers
    assert not any(n.startswith("layers.") and "feed_forward" in n for n in partition.shared)
    assert {n for n, _ in model.named_parameters()} == set(partition.shared) | {
        s.name for u in partition.units for s in u.slices}
    for group, units in partition.groups().items():
        bounds = [(u.slices[0].start, u.slices[0].stop) for u in units]
        assert bounds[0][0] == 0 and bounds[-1][1] == a.hidden_dim
        assert all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))  # contiguous, disjoint
        for u in units:
            assert [(s.name.rsplit(".", 2)[-2], s.dim) for s in u.slices] == [("w1", 0), ("w3", 0), ("w2", 1)]
            width = u.slices[0].stop - u.slices[0].start
            assert u.cost == 6 * a.dim * width * SPEC.seq_len
    with pytest.raises(ConfigError, match="masker.units_per_layer"):
        _adapter().partition(model, "neuron", SPEC, units_per_layer=a.hidden_dim + 1)


@pytest.mark.parametrize("rescale", [True, False])
def test_narrowed_mlps_match_zeroed_neurons(rescale):
    adapter = _adapter()
    full = _full()
    a = full.args
    partition = adapter.partition(full, "neuron", SPEC, units_per_layer=K)
    # Layer 0 keeps units 3, 1 (given out of order); layer 1 all; layer 2 one; layer 3 none.
    owned = [3, 1, 4, 5, 6, 7, 10]
    reference = copy.deepcopy(full)
    _zero_dropped(reference, partition, set(owned), rescale)
    sub, pmap = adapter.materialize(full, owned, partition, rescale=rescale)

    # Physically narrower: the expected parameter count, pieces in ascending unit order.
    kept_width = sum(partition.units[u].slices[0].stop - partition.units[u].slices[0].start for u in owned)
    expected = a.num_params() - 3 * a.dim * (a.n_layers * a.hidden_dim - kept_width)
    assert sum(p.numel() for p in sub.parameters()) == expected
    w1 = pmap.pieces["layers.0.feed_forward.w1.weight"]
    assert [(p.global_start, p.global_stop) for p in w1] == [(44, 88), (132, 176)]
    assert [(p.local_start, p.local_stop) for p in w1] == [(0, 44), (44, 88)]
    assert pmap.pieces["layers.3.feed_forward.w2.weight"] == []
    assert sub.layers["0"].feed_forward.hidden_scale == (2.0 if rescale else 1.0)

    x = torch.randint(0, SPEC.vocab_size, (3, SPEC.seq_len))
    y = torch.randint(0, SPEC.vocab_size, (3, SPEC.seq_len))
    for train in (True, False):
        sub.train(train), reference.train(train)
        out_sub, out_ref = sub(x), reference(x)
        torch.testing.assert_close(out_sub, out_ref, rtol=1e-5, atol=1e-6)
        if train:
            F.cross_entropy(out_sub.flatten(0, 1), y.flatten()).backward()
            F.cross_entropy(out_ref.flatten(0, 1), y.flatten()).backward()
    # Gradients agree at global coordinates: the ParamMap puts each owned piece where it belongs.
    checked = assert_pieces_at_global_coordinates(sub, pmap, reference, partition, owned, rtol=1e-4, atol=1e-6)
    assert checked == len(partition.shared) + 3 * len(owned)


def test_backward_masking_trains_only_owned_hidden_ranges():
    adapter = _adapter()
    full = _full()
    partition = adapter.partition(full, "neuron", SPEC, units_per_layer=K)
    reference = copy.deepcopy(full)
    owned = [0, 2, 5, 6, 7, 15]
    model, pmap = apply_backward_masking(full, partition, owned)
    x = torch.randint(0, SPEC.vocab_size, (2, SPEC.seq_len))
    y = torch.randint(0, SPEC.vocab_size, (2, SPEC.seq_len))
    out, ref = model(x), reference(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the full model runs unchanged
    F.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(ref.flatten(0, 1), y.flatten()).backward()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    a = full.args
    shared = a.num_params() - 3 * a.dim * a.hidden_dim * a.n_layers
    assert trainable == shared + 3 * a.dim * (a.hidden_dim // K) * len(owned)
    plan = MaskPlan(1, [owned], len(partition.units))
    index = LocalIndex(model, pmap)
    ref_index = LocalIndex(reference, ParamMap.identity([n for n, _ in reference.named_parameters()], {}))
    for item in global_items(partition, plan):
        if item.owners:
            torch.testing.assert_close(index.view(item, grad=True), ref_index.view(item, grad=True),
                                       rtol=1e-5, atol=1e-7)

"""The owners' digests: one flipped bit in a unit's value or optimizer state changes that unit's digest
and no other; the majority rule; the test-only fault flips exactly one bit (no process group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from subnetdp.core.contracts import ParamMap, Partition, TensorSlice, Unit
from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.verify import SHARED, Mismatch, unit_digests
from subnetdp.train.faults import FLIP_BIT, flip_bits


def _neuron_model():
    """Two neuron units of a 4 -> 6 -> 3 MLP (rows of the first layer, columns of the second); the last bias shared."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    units = [Unit(u, f"hidden{u}", "hidden", 1.0,
                  (TensorSlice("0.weight", 0, 3 * u, 3 * u + 3), TensorSlice("0.bias", 0, 3 * u, 3 * u + 3),
                   TensorSlice("2.weight", 1, 3 * u, 3 * u + 3))) for u in range(2)]
    shapes, dtypes = Partition.tensor_info(model)
    partition = Partition("neuron", units, ["2.bias"], shapes=shapes, dtypes=dtypes)
    names = [n for n, _ in model.named_parameters()]
    pmap = ParamMap.identity(names, {n: None for n in names})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return SimpleNamespace(model=model, optimizer=opt, pmap=pmap, partition=partition, plan=MaskPlan(1, [[0, 1]], 2))


def _digests(st) -> dict[int, bytes]:
    return unit_digests(st.model, st.optimizer, st.pmap, st.partition, st.plan, 0)


def _flip(t: torch.Tensor, index: tuple[int, ...]) -> None:
    with torch.no_grad():
        t[index] = (t[index].reshape(1).view(torch.int32) ^ (1 << 7)).view(torch.float32)[0]


@pytest.mark.parametrize("where, unit", [(("2.weight", None, (1, 4)), 1), (("0.weight", "exp_avg_sq", (2, 0)), 0),
                                         (("2.bias", "exp_avg", (0,)), SHARED), (("0.bias", None, (5,)), 1)])
def test_one_flipped_bit_changes_its_units_digest_and_no_other(where, unit):
    st = _neuron_model()
    before = _digests(st)
    assert set(before) == {0, 1, SHARED} and len(set(before.values())) == 3
    name, state, index = where
    param = dict(st.model.named_parameters())[name]
    _flip(param if state is None else st.optimizer.state[param][state], index)
    after = _digests(st)
    assert {u for u in before if before[u] != after[u]} == {unit}


def test_the_majority_rule():
    two = Mismatch(3, (0, 1), {"a": [0], "b": [1]})
    assert two.majority is None  # two owners: nobody can tell which copy is right
    three = Mismatch(3, (0, 1, 2), {"a": [0, 2], "b": [1]})
    assert three.majority == [0, 2] and three.odd == [1]
    assert Mismatch(3, (0, 1, 2), {"a": [0], "b": [1], "c": [2]}).majority is None
    assert Mismatch(3, (0, 1, 2, 3), {"a": [0, 1], "b": [2, 3]}).majority is None  # a tie
    assert "unit 3 (ranks [0, 1, 2]) disagree after step 7" in three.line(7)


def test_the_test_only_fault_flips_exactly_one_bit_of_the_named_unit(monkeypatch):
    st = _neuron_model()
    before = {n: p.detach().clone() for n, p in st.model.named_parameters()}
    monkeypatch.setenv(FLIP_BIT, "4:0:1:16,4:1:0,5:0:0")  # only step 4's fault on rank 0 applies
    flip_bits(4, st, SimpleNamespace(rank=0))
    changed = 0
    for n, p in st.model.named_parameters():
        xor = before[n].view(torch.int32) ^ p.detach().view(torch.int32)
        changed += sum(bin(int(v) & 0xFFFFFFFF).count("1") for v in xor.reshape(-1).tolist())
    assert changed == 1
    flipped = [n for n, p in st.model.named_parameters() if not torch.equal(before[n], p.detach())]
    xor = before[flipped[0]].view(torch.int32) ^ dict(st.model.named_parameters())[flipped[0]].detach().view(torch.int32)
    assert int(xor.abs().max()) == 1 << 16
    monkeypatch.setenv(FLIP_BIT, "4:0:7")
    with pytest.raises(ValueError, match="does not own 7"):
        flip_bits(4, st, SimpleNamespace(rank=0))

"""Loading the survivors' pieces in memory (``continuation.LiveReader``, going on in-process and a join):
what the optimizer keeps must not hold the buffer a message came in, and a rank's own pieces are not copied.

The heal receives each source's pieces packed in one buffer and hands them out as views of it. The
optimizer keeps its per-tensor scalars (AdamW's ``step``) as they are given, so a received ``step`` that
is a view kept the whole buffer (every value and moment the rank received) alive for the rest of the
run. A rank's own pieces (views of its live model and optimizer) load without a copy.
"""

from __future__ import annotations

import torch

from subnetdp.core.plan import MaskPlan
from subnetdp.sdp.construct import build_local
from subnetdp.sdp.pieces import LocalIndex
from subnetdp.train.checkpoints import units
from subnetdp.train.continuation import LiveReader, _pack, _span
from subnetdp.train.stateful import local_names
from tests.unit.test_construct import _setup


def _trained(adapter, skeleton, partition, cfg, plan):
    model, pmap = build_local(adapter, skeleton, plan.owned[0], partition, cfg.masker, int(cfg.seed), "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # every parameter gets exp_avg, exp_avg_sq and step
    index = LocalIndex(model, pmap)
    state = {n: optimizer.state[p] for n, p in zip(local_names(model, optimizer), model.parameters())}
    return model, index, units.pieces_to_write(0, partition, plan, index, {}, state, per_owner=True)


def test_received_pieces_leave_no_view_of_their_buffer_in_the_optimizer_and_own_ones_are_not_copied():
    cfg, regs, spec, adapter, skeleton, partition = _setup("resnet18_digits", "block")
    plan = MaskPlan(1, [[u.id for u in partition.units]], len(partition.units))
    _, _, sent = _trained(adapter, skeleton, partition, cfg, plan)
    # As the heal hands them out: one buffer, every piece a view of it (continuation._Messages.swap).
    names = list(sent)
    buffer = _pack([sent[n] for n in names], torch.device("cpu"))
    received, at = LiveReader(0, {}, {}), 0
    for n in names:
        t = sent[n]
        received._add(n, buffer[at:at + _span(t.shape, t.dtype)].view(t.dtype).reshape(t.shape))
        at += -(-_span(t.shape, t.dtype) // 64) * 64
    model, _ = build_local(adapter, skeleton, plan.owned[0], partition, cfg.masker, int(cfg.seed), "cpu")
    state, _ = units.load_pieces(received, 0, partition, plan, LocalIndex(model, model_pmap(adapter, model, partition)))
    held = [t for per in state.values() for t in per.values()]
    assert held and any(t.dim() == 0 for t in held)  # the steps are among them
    ptr = buffer.untyped_storage().data_ptr()
    assert not [t for t in held if t.untyped_storage().data_ptr() == ptr], "a view of the message's buffer is kept"

    # A rank's own pieces: the very tensors it holds, taken as they are.
    model, index, own = _trained(adapter, skeleton, partition, cfg, plan)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    state, _ = units.load_pieces(LiveReader(0, own, {}), 0, partition, plan, index)
    assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())
    mine = {id(t) for t in own.values()} | {t.untyped_storage().data_ptr() for t in own.values()}
    kept = [t for per in state.values() for t in per.values()]
    assert kept and all(t.untyped_storage().data_ptr() in mine for t in kept)  # lent, not copied


def model_pmap(adapter, model, partition):
    from subnetdp.plugins.models._blocks import identity_param_map

    return identity_param_map(model, partition)

"""The chunked LM-head loss (``model.loss_chunk``) against the plain path, and what it saves.

Tolerances: fp32 ``rtol=1e-5, atol=1e-6`` (design section 7): the two paths run the same operations
per token and differ only in the order of the sums over tokens (the loss, and the head's weight
gradient, which the chunked path accumulates chunk by chunk). bf16: under autocast the head's
weight gradient of each chunk is rounded to bf16 before the chunks are summed, where the plain path
rounds the whole sum once, so elements differ by a few bf16 units (2^-8 relative) of the larger
partial sums: ``rtol=2^-6`` and ``atol=2^-6 * max|grad|`` per tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from subnetdp.core.contracts import DataSpec
from subnetdp.parallel.memory import TensorMemoryTracker, live_state_bytes
from subnetdp.parallel.checkpointing import apply_ac
from subnetdp.plugins.models.llama.adapter import LlamaAdapter, LlamaConfig


def _adapter(chunk: int) -> LlamaAdapter:
    cfg = OmegaConf.structured(LlamaConfig)
    cfg.loss_chunk = chunk
    return LlamaAdapter(cfg)


def _batch(vocab: int, b: int = 3, t: int = 40, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


def _loss_and_grads(model, adapter, batch, precision: str):
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else torch.enable_grad()
    with ctx:
        loss = adapter.training_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ac", [False, True])
def test_chunked_loss_equals_the_plain_loss_and_gradients(precision, ac):
    spec = DataSpec(vocab_size=1000, seq_len=40)
    torch.manual_seed(0)
    model = _adapter(0).build(spec)
    chunked_model = copy.deepcopy(model)
    if ac:  # activation checkpointing of the blocks composes with the checkpointed head chunks
        apply_ac(list(chunked_model.layers.values()), 1)
    batch = _batch(spec.vocab_size)  # 120 tokens in chunks of 37: three full chunks and a short one
    plain, g_plain = _loss_and_grads(model, _adapter(0), batch, precision)
    chunked, g_chunked = _loss_and_grads(chunked_model, _adapter(37), batch, precision)
    if precision == "fp32":
        torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-6)
        for n in g_plain:
            torch.testing.assert_close(g_chunked[n], g_plain[n], rtol=1e-5, atol=1e-6, msg=n)
    else:
        torch.testing.assert_close(chunked, plain, rtol=2**-6, atol=0)
        for n in g_plain:
            scale = float(g_plain[n].abs().max())
            torch.testing.assert_close(g_chunked[n], g_plain[n], rtol=2**-6, atol=2**-6 * scale, msg=n)
    assert g_chunked["output.weight"].abs().sum() > 0  # the head did learn through the chunks
    # Evaluation and metrics still see the logits.
    with torch.no_grad():
        assert chunked_model(batch[0]).shape == (3, 40, spec.vocab_size)


def _step_peak(model, adapter, batch) -> int:
    model.zero_grad(set_to_none=True)
    params = list(model.parameters())
    with TensorMemoryTracker(live_state_bytes(params)) as tracker:
        adapter.training_loss(model, batch).backward()
    return tracker.peak


def test_chunked_loss_removes_at_least_the_logits_from_the_peak():
    spec = DataSpec(vocab_size=32_000, seq_len=128)
    torch.manual_seed(0)
    model = _adapter(0).build(spec)
    batch = _batch(spec.vocab_size, b=2, t=128)
    logits_bytes = 2 * 128 * spec.vocab_size * 4  # one fp32 copy of the step's logits
    plain = _step_peak(model, _adapter(0), batch)
    chunked = _step_peak(model, _adapter(64), batch)
    # The plain step holds the logits and their fp32 log-softmax at once (2x here); the chunked one
    # at most a chunk's (64 of 256 tokens).
    assert plain - chunked >= logits_bytes, (plain, chunked, logits_bytes)

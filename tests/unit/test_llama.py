"""The LLaMA model: causal, rotary is a rotation, variant sizes, exact block-level subnetworks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import subnetdp.plugins.models.llama.adapter as llama_module
from subnetdp.core.contracts import DataSpec
from subnetdp.plugins.models.llama.adapter import LlamaAdapter, LlamaConfig
from subnetdp.plugins.models.llama.model import VARIANTS, Llama, apply_rotary, rotary_tables

SPEC = DataSpec(vocab_size=257, seq_len=32)


def _adapter(variant: str = "tiny", **kw) -> LlamaAdapter:
    cfg = OmegaConf.structured(LlamaConfig)
    cfg.variant = variant
    for k, v in kw.items():
        cfg[k] = v
    return LlamaAdapter(cfg)


def _model(**kw) -> Llama:
    torch.manual_seed(0)
    return _adapter(**kw).build(SPEC)


def test_changing_a_future_token_never_changes_an_earlier_logit():
    model = _model().eval()
    tokens = torch.randint(0, 257, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(tokens)
        for pos in (0, 7, 31):
            changed = tokens.clone()
            changed[:, pos] = (changed[:, pos] + 1) % 257
            out = model(changed)
            assert torch.equal(out[:, :pos], base[:, :pos]), pos  # bit for bit
            assert not torch.allclose(out[:, pos], base[:, pos])  # the changed position does see it
    assert base.shape == (3, 32, 257)


def test_rotary_embedding_is_a_rotation():
    head_dim, seq = 16, 40
    cos, sin = rotary_tables(seq, head_dim, 10_000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(seq, head_dim, generator=g), torch.randn(seq, head_dim, generator=g)
    rq, rk = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    # Norm-preserving, and the identity at position 0.
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rq[0], q[0])
    # Relative: <R_m q, R_n k> depends only on m - n (same vectors placed at every position).
    qs, ks = q[:1].expand(seq, -1), k[:1].expand(seq, -1)
    scores = apply_rotary(qs, cos, sin) @ apply_rotary(ks, cos, sin).T
    for offset in (0, 3, -5):
        diag = torch.diagonal(scores, offset)
        torch.testing.assert_close(diag, diag[0].expand_as(diag), rtol=1e-4, atol=1e-4)
    # And it is a real rotation: different offsets give different scores.
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, 3)[0])


@pytest.mark.parametrize("variant,target", [("134m", 134e6), ("500m", 500e6), ("1b", 1e9)])
def test_variant_parameter_counts_are_within_5_percent_of_their_names(variant, target):
    adapter = _adapter(variant)
    with torch.device("meta"):
        model = adapter.build(DataSpec())  # vocabulary 32,000 when the data does not say
    n = sum(p.numel() for p in model.parameters())
    assert model.args.vocab_size == 32_000
    assert n == adapter.args(DataSpec()).num_params()
    assert abs(n / target - 1) < 0.05, n
    assert f"{n:,}" in llama_module.__doc__  # the documented count is the real one


def test_tied_embeddings_share_one_tensor_and_count_once():
    adapter = _adapter("tiny", tie_embeddings=True)
    model = adapter.build(SPEC)
    assert model.output.weight is model.tok_embeddings.weight
    partition = adapter.partition(model, "block", SPEC)
    assert partition.shared.count("tok_embeddings.weight") == 1 and "output.weight" not in partition.shared
    untied = _adapter("tiny").build(SPEC)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(untied) - n(model) == 257 * 64


@pytest.mark.parametrize("owned", [[0, 2], [3], [0, 1, 2, 3]])
def test_blocks_are_the_units_and_a_subnetwork_keeps_the_owned_layers_in_order(owned):
    adapter = _adapter()
    full = _model()
    partition = adapter.partition(full, "block", SPEC)
    assert [u.name for u in partition.units] == [f"layers.{i}" for i in range(4)]
    assert {u.group for u in partition.units} == {"layers"}  # one group for LLaMA
    assert all(u.cost == partition.units[0].cost > 0 for u in partition.units)

    # Equality with the full model without the dropped blocks (values and gradients), and the tensors
    # held: test_adapter_contract.py.
    sub, _ = adapter.materialize(full, owned, partition)
    assert [int(k) for k in sub.layers.keys()] == sorted(owned)


def test_partition_covers_every_parameter_once_and_cost_is_measured_flops():
    adapter = _adapter()
    model = _model()
    partition = adapter.partition(model, "block", SPEC)
    names = [s.name for u in partition.units for s in u.slices] + partition.shared
    assert sorted(names) == sorted(n for n, _ in model.named_parameters()) and len(names) == len(set(names))
    assert set(partition.shared) == {"tok_embeddings.weight", "norm.weight", "output.weight"}
    a = model.args
    matmul = 2 * SPEC.seq_len * (a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.dim * a.dim
                                 + 3 * a.dim * a.hidden_dim)
    attention = 2 * 2 * SPEC.seq_len * SPEC.seq_len * a.dim  # scores and weighted values
    assert matmul <= partition.units[0].cost <= matmul + attention


def test_loss_is_next_token_cross_entropy_and_metrics_report_perplexity():
    adapter = _adapter()
    model = _model()
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(4))
    batch = (tokens[:, :-1], tokens[:, 1:])
    logits = model(adapter.inputs(batch))
    loss = adapter.loss(logits, batch)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 257), tokens[:, 1:].reshape(-1)))
    assert abs(float(loss.detach()) - math.log(257)) < 0.5  # near uniform at initialisation
    m = adapter.metrics([logits, logits], [batch, batch])
    assert m["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert m["perplexity"] == pytest.approx(math.exp(m["loss"]), rel=1e-6)


def test_vocabulary_follows_the_data_and_a_smaller_override_is_refused():
    assert _model().args.vocab_size == 257
    assert _adapter(vocab_size=512).build(SPEC).args.vocab_size == 512
    from subnetdp.core.errors import ConfigError

    with pytest.raises(ConfigError, match="model.vocab_size"):
        _adapter(vocab_size=100).build(SPEC)
    a = dataclasses.replace(VARIANTS["tiny"], vocab_size=257)
    assert a.num_params() == sum(p.numel() for p in _model().parameters())


@pytest.mark.parametrize("recipe,variant,coverage", [("llama_tiny_stdlib", "tiny", 0.5), ("llama_134m_fineweb", "134m", 0.5),
                                                     ("llama_500m_fineweb", "500m", 0.5), ("llama_1b_fineweb", "1b", 0.69)])
def test_llm_recipes_compose(recipe, variant, coverage):
    from tests.helpers import plugin_manager
    from subnetdp.train.configure import load_config

    cfg = load_config(recipe, [], plugin_manager().registries)
    assert (cfg.model.name, cfg.model.variant, cfg.masker.coverage, cfg.data.name) == ("llama", variant, coverage, "tokens")
    assert cfg.optim.name == "adamw" and cfg.optim.schedule == "cosine" and cfg.optim.warmup_steps > 0

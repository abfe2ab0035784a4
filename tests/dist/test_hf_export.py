"""``subnetdp export --format hf``: transformers loads the LLaMA without key warnings and computes the
union model's logits; the tokenizer files encode as the run's tokenizer does.

Two trained runs: 2 gloo ranks at coverage 0.5 with an untied head (each block has one owner, so the
union really is assembled from both ranks' files), and one process with a tied head. Both use the
tiny variant's grouped-query attention (4 heads, 2 key/value heads) and a BPE tokenizer.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from subnetdp.cli import main
from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.loop import train
from subnetdp.plugins.data.corpus import ByteTokenizer
from subnetdp.evaluate.export import load_union
from subnetdp.evaluate.hf import hf_tokenizer, run_tokenizer
from subnetdp.plugins.data.tokens import TokensConfig, TokensData
from tests.helpers import plugin_manager, run_ranks, small_config

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install 'subnetdp[hf]'")

DATA = ("data.tokenizer=bpe", "data.bpe_vocab_size=384", "data.stdlib_max_mb=0.5", "data.seq_len=32")


def _config(tmp, name: str, *overrides: str):
    return small_config("train.steps=3", "train.batch_size=4", "eval.batches=1", "checkpoint.enabled=true", "checkpoint.final=always",
                        f"data.cache_dir={tmp}/data", f"run.name={name}", *DATA, *overrides,
                        recipe="llama_tiny_stdlib", run_dir=tmp / "runs")


def _sdp_worker(rank: int, world: int, init_method: str, tmp) -> list:
    run = train(_config(tmp, "untied", "masker.coverage=0.5", f"comm.init_method={init_method}"),
                LaunchEnv(rank, world, rank, world, "test"), plugin_manager())
    return run.state.plan.owned


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    TokensData(TokensConfig(root="stdlib", cache_dir=str(tmp / "data"), tokenizer="bpe", bpe_vocab_size=384,
                            stdlib_max_mb=0.5), seed=0).check()  # the corpus once, before the ranks start
    owned = run_ranks(_sdp_worker, 2, tmp, tmp)[0]
    assert owned == [[0, 1], [2, 3]]  # two ranks, disjoint blocks: the union needs both ranks' files
    train(_config(tmp, "tied", "comm.name=local", "masker.coverage=1", "model.tie_embeddings=true"),
          LaunchEnv(), plugin_manager())
    return tmp


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_transformers_loads_the_export_and_computes_the_union_logits(runs, name, capsys, caplog):
    out = runs / f"hf-{name}"
    # The corpus (and its tokenizer) where the runs built it: export never takes data.cache_dir from a checkpoint.
    cache = f"data.cache_dir={runs / 'data'}"
    assert main(["export", str(runs / "runs" / name), str(out), cache, "--format", "hf"]) == 0
    assert "AutoModelForCausalLM.from_pretrained" in capsys.readouterr().out

    loaded = load_union(runs / "runs" / name, plugin_manager(), [cache])
    union, args = loaded.model.eval(), loaded.model.args
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == \
        (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.hidden_dim, args.vocab_size)
    assert args.n_kv_heads < args.n_heads  # grouped-query attention
    assert config["tie_word_embeddings"] is (name == "tied") and args.tie_embeddings is (name == "tied")
    assert (config["rope_theta"], config["rms_norm_eps"]) == (args.rope_theta, args.norm_eps)
    assert ("lm_head.weight" in load_file(str(out / "model.safetensors"))) is (name == "untied")

    caplog.set_level(logging.WARNING)
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True)
    auto = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    noisy = [r.getMessage() for r in caplog.records if any(w in r.getMessage().lower() for w in
                                                          ("missing", "unexpected", "newly initialized", "not used"))]
    assert noisy == []
    assert type(auto) is transformers.LlamaForCausalLM
    if name == "tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs, auto_logits = union(tokens), model.eval()(tokens).logits, auto.eval()(tokens).logits
    # The same operations in fp32 (rotary pairs x[i], x[i+d/2] in both: no permutation of q/k rows).
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(auto_logits, ours, rtol=1e-5, atol=1e-6)

    # The tokenizer files encode as the run's tokenizer does, and generate() follows the union greedily.
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ours_tok = run_tokenizer(loaded, plugin_manager())
    text = "def area(radius):\n    return 3.14159 * radius ** 2  # é, ß\n"
    ids = [int(i) for i in ours_tok.encode([text])[0]]
    assert tok(text).input_ids == ids and tok.decode(ids) == text
    assert tok.eos_token_id == ours_tok.eot == config["eos_token_id"]
    prompt = [int(i) for i in ours_tok.encode(["import os\n"])[0]]
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert generated[0, len(prompt):].tolist() == _greedy(union, prompt, 8)


def test_byte_tokenizer_exports_as_an_equal_hf_tokenizer():
    hf = hf_tokenizer(ByteTokenizer())
    text = "bytes: \x00\x7f é ✓ 😀 \t\n"
    expected = [int(i) for i in ByteTokenizer().encode([text])[0]]
    assert hf.encode(text).ids == expected
    assert hf.decode(expected) == text
    assert hf.token_to_id("<|endoftext|>") == 256 and hf.get_vocab_size() == 257

"""Token shards: prepare-text round trip, header validation, packing, sharding, resuming, stdlib corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from subnetdp.cli import main
from subnetdp.core.errors import ConfigError
from subnetdp.plugins.data.corpus import BPETokenizer, ByteTokenizer
from subnetdp.plugins.data.token_shards import HEADER_BYTES, open_shard, write_shard
from subnetdp.plugins.data.tokens import TokensConfig, TokensData

DOCS = [f"document {i}: déjà vu — {'x' * (i % 7)} " + "def f(a, b):\n    return a + b\n" * (1 + i % 3)
        for i in range(40)]


def _data(root, **kw) -> TokensData:
    cfg = OmegaConf.structured(TokensConfig)
    cfg.root = str(root)
    for k, v in kw.items():
        cfg[k] = v
    return TokensData(cfg, seed=5)


def _write_inputs(tmp_path):
    src = tmp_path / "src"
    (src / "txt").mkdir(parents=True)
    for i, d in enumerate(DOCS[:10]):
        (src / "txt" / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    with open(src / "b.jsonl", "w", encoding="utf-8") as f:
        for d in DOCS[10:25]:
            f.write(json.dumps({"text": d}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS[25:], "id": list(range(15))}), src / "c.parquet")
    # Directory order: b.jsonl, c.parquet, txt/00.txt ... (sorted paths)
    return src, DOCS[10:25] + DOCS[25:] + DOCS[:10]


def _stream(tokens: np.ndarray, eot: int) -> list[list[int]]:
    docs, cur = [], None
    for t in tokens.tolist():
        if t == eot:
            if cur is not None:
                docs.append(cur)
            cur = []
        else:
            cur.append(t)
    docs.append(cur)
    return docs


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_prepare_text_shards_read_back_to_the_same_tokens(tmp_path, tokenizer, capsys):
    src, ordered = _write_inputs(tmp_path)
    out = tmp_path / "shards"
    args = ["prepare-text", str(src), "--out", str(out), "--tokenizer", tokenizer, "--val-fraction", "0.2",
            "--shard-tokens", "700"]
    if tokenizer == "bpe":
        args += ["--vocab-size", "300"]
    assert main(args) == 0
    assert "training and" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    tok = ByteTokenizer() if tokenizer == "bytes" else BPETokenizer.load(out / "tokenizer.json")
    assert meta["vocab_size"] == tok.vocab_size and meta["documents"] == {"train": 32, "val": 8}
    for split, docs in (("train", [d for i, d in enumerate(ordered) if i % 5 != 4]),
                        ("val", [d for i, d in enumerate(ordered) if i % 5 == 4])):
        files = sorted(out.glob(f"text_{split}_*.bin"))
        assert len(files) == meta["shards"][split] and (split == "val" or len(files) > 1)
        tokens = np.concatenate([open_shard(f, vocab_size=tok.vocab_size) for f in files])
        assert len(tokens) == meta["tokens"][split]
        expected = tok.encode(docs)
        assert [list(e) for e in expected] == _stream(tokens, tok.eot)  # the same tokens, in order
        assert [tok.decode(ids) for ids in _stream(tokens, tok.eot)] == docs  # and the same text

    if tokenizer == "bpe":  # a saved tokenizer loaded with --tokenizer-file gives the same shards
        again = tmp_path / "again"
        assert main(args[:3] + [str(again), "--tokenizer", "bpe", "--tokenizer-file", str(out / "tokenizer.json"),
                                "--val-fraction", "0.2", "--shard-tokens", "700"]) == 0
        assert [f.read_bytes() for f in sorted(again.glob("*.bin"))] == [f.read_bytes() for f in sorted(out.glob("*.bin"))]

    # The data module reads them: vocabulary from meta.json, windows packed from the stream.
    data = _data(out, seq_len=16)
    data.check()
    assert data.spec().vocab_size == tok.vocab_size and data.spec().seq_len == 16


def test_header_is_validated_and_bad_files_get_clear_errors(tmp_path):
    tokens = np.arange(1000, dtype=np.uint32) % 300
    good = write_shard(tmp_path / "good.bin", tokens)
    raw = good.read_bytes()
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    assert list(header[:3]) == [20240520, 1, 1000] and len(raw) == HEADER_BYTES + 2000
    np.testing.assert_array_equal(open_shard(good), tokens)

    cases = {
        "truncated.bin": (raw[:-10], "is truncated: the header announces 1000 tokens"),
        "short.bin": (raw[:100], "fewer than the 1024-byte FineWeb header"),
        "foreign.bin": (b"hello, this is a text file, not a shard\n" * 40, "not a FineWeb magic number"),
        "version.bin": (np.array([20240520, 3, 1000], "<i4").tobytes() + raw[12:], "header version 3"),
        "trailing.bin": (raw + b"\0\0\0\0", "4 bytes after the 1000 tokens"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ConfigError) as e:
            open_shard(tmp_path / name)
        assert name in str(e.value) and message in str(e.value) and "data.root" in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="token id 299, but the vocabulary has 257"):
        open_shard(good, vocab_size=257)

    # Plain .bin files: tokens only, uint16 or uint32; an odd byte count is refused.
    write_shard(tmp_path / "plain.bin", tokens, "plain-uint32")
    np.testing.assert_array_equal(open_shard(tmp_path / "plain.bin", "plain", "uint32"), tokens)
    (tmp_path / "odd.bin").write_bytes(b"\1\2\3")
    with pytest.raises(ConfigError, match="odd.bin: holds 3 bytes, not a whole number of uint16"):
        open_shard(tmp_path / "odd.bin", "plain", "uint16")


def test_missing_or_empty_directory_says_how_to_prepare_data(tmp_path):
    with pytest.raises(ConfigError) as e:
        _data(tmp_path / "nowhere").check()
    assert "no such directory" in str(e.value) and "subnetdp prepare-text" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="matches no file.*prepare-text"):
        _data(tmp_path / "empty").check()
    (tmp_path / "nometa").mkdir()
    write_shard(tmp_path / "nometa" / "x_train_0.bin", np.arange(100))
    with pytest.raises(ConfigError, match="data.vocab_size.*no meta.json"):
        _data(tmp_path / "nometa").spec()


def test_meta_json_names_only_a_tokenizer_beside_it(tmp_path):
    (tmp_path / "secret.json").write_text("{}")
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("../secret.json", str(tmp_path / "secret.json"), ".."):
        (shards / "meta.json").write_text(json.dumps({"vocab_size": 300, "tokenizer": "bpe", "tokenizer_file": name}))
        with pytest.raises(ConfigError) as e:
            _data(shards).tokenizer()
        assert str(e.value).startswith("data.root=") and repr(name) in str(e.value) and "\n" not in str(e.value)


def test_loader_packs_shards_by_rank_deterministically_and_resumes(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    streams = [np.arange(0, 1000), np.arange(5000, 5333)]  # two shards; windows never cross them
    for i, s in enumerate(streams):
        write_shard(root / f"t_train_{i:03d}.bin", s)
    write_shard(root / "t_val_000.bin", np.arange(9000, 9100))
    data = _data(root, seq_len=10, vocab_size=10_000)
    windows = data._windows("train")
    assert len(windows) == 99 + 33  # (n - 1) // seq_len windows of seq_len + 1 tokens per shard

    loaders = [data.train_loader(r, 2, 4) for r in range(2)]
    epoch = [[b for _, b in zip(range(loaders[r].batches_per_epoch), iter(loaders[r]))] for r in range(2)]
    seen = []
    for batches in epoch:
        for x, y in batches:
            assert x.shape == (4, 10) and x.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
            assert torch.equal(y[:, -1] - x[:, -1], torch.ones(4, dtype=torch.int64))  # contiguous windows
            seen += x[:, 0].tolist()
    assert len(seen) == len(set(seen))  # ranks get disjoint windows within an epoch
    assert all(s % 10 == 0 or (s - 5000) % 10 == 0 for s in seen)

    # Deterministic and resumable: a fresh loader restored to a saved position continues identically.
    a = data.train_loader(1, 2, 4)
    it = iter(a)
    for _ in range(20):  # crosses an epoch boundary (16 batches per epoch)
        next(it)
    state = a.state_dict()
    expected = [next(it) for _ in range(5)]
    b = data.train_loader(1, 2, 4)
    b.load_state_dict(state)
    got = [batch for _, batch in zip(range(5), iter(b))]
    assert state["epoch"] == 1 and all(torch.equal(e[0], g[0]) for e, g in zip(expected, got))
    first = next(iter(data.train_loader(1, 2, 4)))
    assert torch.equal(first[0], epoch[1][0][0])

    # Evaluation: the whole validation split in order.
    val = list(data.eval_loader(4))
    assert len(val) == 3 and torch.equal(val[0][0][0], torch.arange(9000, 9010))


def test_stdlib_corpus_is_built_once_deterministically(tmp_path):
    data = _data("stdlib", cache_dir=str(tmp_path), stdlib_max_mb=0.5, seq_len=64)
    data.check()
    root = data.root()
    meta = json.loads((root / "meta.json").read_text())
    assert meta["vocab_size"] == 257 and meta["tokens"]["train"] > 200_000 and meta["tokens"]["val"] > 0
    stamp = (root / "stdlib_train_000000.bin").stat().st_mtime_ns
    again = _data("stdlib", cache_dir=str(tmp_path), stdlib_max_mb=0.5, seq_len=64)
    again.check()
    assert again.root() == root and (root / "stdlib_train_000000.bin").stat().st_mtime_ns == stamp
    text = ByteTokenizer().decode(open_shard(root / "stdlib_train_000000.bin")[:200_000].tolist())
    assert "def " in text and "import " in text  # Python source, read back

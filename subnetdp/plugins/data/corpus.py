"""Text corpora as token shards: documents, tokenizers, the shard writer and the stdlib corpus.

What the ``tokens`` data plugin needs at run time (it builds the standard-library corpus on first
use and reads the tokenizer the shards were made with), and what ``subnetdp prepare-text``
(:mod:`subnetdp.tools.prepare_text`) tokenises with.

Inputs: ``.txt`` (one document per file), ``.jsonl`` (one document per line, field ``text``),
``.parquet`` (column ``text``; needs ``pyarrow``), ``.py``. Documents are split into train and
validation by position (every ``round(1 / val_fraction)``-th document is held out), tokenised,
separated by an end-of-text token, and written as FineWeb-layout shards ``<name>_train_000000.bin``,
``<name>_val_000000.bin`` with a ``meta.json`` (vocabulary, tokenizer, token counts) beside them.

Tokenizers: ``bytes`` (the UTF-8 bytes, ids 0..255, end-of-text 256: vocabulary 257; needs nothing)
or ``bpe`` (an HF ``tokenizers`` byte-level BPE trained on the training documents, or loaded from a
``tokenizer.json``).

Corpus ``stdlib``: this Python's standard library source (``*.py`` under
``sysconfig.get_paths()['stdlib']``, ``site-packages`` excluded, sorted, capped), so a language-model
run needs no download.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from subnetdp import SubnetdpError
from subnetdp.plugins.data.token_shards import write_shard

EOT = "<|endoftext|>"
SUFFIXES = (".txt", ".jsonl", ".parquet", ".py")


# ----------------------------------------------------------------------------- documents
def read_documents(files: Iterable[Path], text_field: str = "text", max_bytes: int = 0) -> Iterator[str]:
    """Documents of ``files`` in order; stops once ``max_bytes`` (> 0) of text were yielded."""
    seen = 0
    for f in files:
        for doc in _file_documents(f, text_field):
            if not doc:
                continue
            yield doc
            seen += len(doc.encode("utf-8", "surrogatepass"))
            if max_bytes and seen >= max_bytes:
                return


def _file_documents(f: Path, text_field: str) -> Iterator[str]:
    if f.suffix == ".jsonl":
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield json.loads(line)[text_field]
                    except (ValueError, KeyError, TypeError):
                        raise SubnetdpError(f"prepare-text: {f} line {n} is not a JSON object with a "
                                            f"'{text_field}' field (--text-field)") from None
    elif f.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SubnetdpError("prepare-text: reading .parquet needs pyarrow: pip install 'subnetdp[llm]'") from None
        table = pq.ParquetFile(f)
        if text_field not in table.schema_arrow.names:
            raise SubnetdpError(f"prepare-text: {f} has no column '{text_field}' (columns: "
                                f"{', '.join(table.schema_arrow.names)}); choose one with --text-field")
        for batch in table.iter_batches(columns=[text_field], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if t)
    else:
        yield f.read_bytes().decode("utf-8", errors="replace")


def stdlib_files() -> list[Path]:
    """This Python's standard-library ``*.py`` files, ``site-packages`` excluded, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


# ----------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-text 256."""

    vocab_size = 257
    eot = 256
    name = "bytes"

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8", "surrogatepass"), dtype=np.uint8).astype(np.uint32) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, out: Path) -> str:
        return ""


class BPETokenizer:
    """An HF ``tokenizers`` byte-level BPE (trained here, or loaded from a ``tokenizer.json``)."""

    name = "bpe"

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        eot = tokenizer.token_to_id(EOT)
        if eot is None:
            raise SubnetdpError(f"prepare-text: the tokenizer has no '{EOT}' token to separate documents")
        self.eot = eot

    @classmethod
    def train(cls, docs: Iterable[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(docs, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))

    def save(self, out: Path) -> str:
        self.tok.save(str(out / "tokenizer.json"))
        return "tokenizer.json"


def make_tokenizer(kind: str, train_docs: Iterable[str] = (), vocab_size: int = 4096,
                   tokenizer_file: str | None = None):
    """``bytes``, or ``bpe`` trained on ``train_docs`` (or loaded from ``tokenizer_file``)."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "bpe":
        raise SubnetdpError(f"prepare-text: unknown tokenizer '{kind}'; choices: bytes, bpe")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise SubnetdpError("prepare-text: --tokenizer bpe needs HF tokenizers: pip install 'subnetdp[llm]'") from None
    return BPETokenizer.load(tokenizer_file) if tokenizer_file else BPETokenizer.train(train_docs, vocab_size)


# ----------------------------------------------------------------------------- shards
@dataclass
class ShardWriter:
    """Appends documents' tokens and writes a shard every ``shard_tokens`` tokens."""

    out: Path
    prefix: str
    shard_tokens: int
    eot: int
    written: int = 0
    shards: int = 0

    def __post_init__(self) -> None:
        self._buf: list[np.ndarray] = []
        self._n = 0

    def add(self, ids: np.ndarray) -> None:
        self._buf += [np.asarray([self.eot], dtype=np.uint32), ids]  # every document starts with EOT
        self._n += len(ids) + 1
        while self._n >= self.shard_tokens:
            flat = np.concatenate(self._buf)
            self._write(flat[:self.shard_tokens])
            self._buf, self._n = [flat[self.shard_tokens:]], len(flat) - self.shard_tokens

    def close(self) -> None:
        if self._n or not self.shards:
            self._write(np.concatenate(self._buf) if self._buf else np.zeros(0, np.uint32))
        self._buf, self._n = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        write_shard(self.out / f"{self.prefix}_{self.shards:06d}.bin", tokens)
        self.shards += 1
        self.written += len(tokens)


def prepare(docs_for_training: Iterable[str], docs: Iterable[str], out: str | Path, name: str = "text",
            tokenizer: str = "bytes", vocab_size: int = 4096, tokenizer_file: str | None = None,
            val_fraction: float = 0.05, shard_tokens: int = 100_000_000, source: str = "") -> dict:
    """Tokenise ``docs`` into train/val shards in ``out``; returns (and writes) ``meta.json``.

    ``docs_for_training`` feeds BPE training (its held-out documents are skipped); it may be
    ``docs`` itself when that is a list.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    every = max(2, int(round(1.0 / val_fraction))) if val_fraction > 0 else 0

    def is_val(i: int) -> bool:
        return bool(every) and i % every == every - 1

    tok = make_tokenizer(tokenizer, (d for i, d in enumerate(docs_for_training) if not is_val(i)),
                         vocab_size, tokenizer_file)
    writers = {split: ShardWriter(out, f"{name}_{split}", shard_tokens, tok.eot) for split in ("train", "val")}
    counts = {"train": 0, "val": 0}
    batch: list[tuple[str, str]] = []

    def flush() -> None:
        for (split, _), ids in zip(batch, tok.encode([d for _, d in batch])):
            writers[split].add(ids)
        batch.clear()

    for i, doc in enumerate(docs):
        split = "val" if is_val(i) else "train"
        counts[split] += 1
        batch.append((split, doc))
        if len(batch) >= 1024:
            flush()
    flush()
    if every and counts["val"] == 0:
        raise SubnetdpError(f"prepare-text: {counts['train']} document(s) with --val-fraction {val_fraction} hold "
                            f"out none (every {every}th document is held out): give more documents (a .jsonl "
                            "line or a .txt file is one) or a larger --val-fraction")
    for w in writers.values():
        w.close()
    meta = {"vocab_size": tok.vocab_size, "tokenizer": tok.name, "tokenizer_file": tok.save(out),
            "eot_token": tok.eot, "format": "fineweb", "source": source,
            "documents": counts, "tokens": {s: w.written for s, w in writers.items()},
            "shards": {s: w.shards for s, w in writers.items()}}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def build_stdlib_corpus(out: str | Path, tokenizer: str = "bytes", vocab_size: int = 4096,
                        max_mb: float = 4.0, val_fraction: float = 0.05) -> Path:
    """Tokenise the standard library into ``out`` once; safe when several ranks race to do it.

    Each builder writes into a private temporary directory and renames it into place; the first
    rename wins and the others discard their copy. Returns ``out``.
    """
    out = Path(out)
    if (out / "meta.json").is_file():
        return out
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    docs = list(read_documents(stdlib_files(), max_bytes=int(max_mb * 2**20)))
    prepare(docs, docs, tmp, name="stdlib", tokenizer=tokenizer, vocab_size=vocab_size,
            val_fraction=val_fraction, source=f"python {sysconfig.get_python_version()} standard library, "
            f"first {max_mb:g} MiB of *.py in sorted path order")
    try:
        os.rename(tmp, out)
    except OSError:  # another rank finished first; its corpus is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return out

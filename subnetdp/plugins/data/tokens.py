"""Data ``tokens``: pre-tokenised shards on disk, memory-mapped, packed into fixed-length windows.

``data.root`` is a directory of shards (see :mod:`subnetdp.plugins.data.token_shards`): training
shards match ``data.train_pattern`` (default ``*train*.bin``), validation shards
``data.val_pattern`` (``*val*.bin``), each list in sorted name order, as FineWeb's
``fineweb_train_000001.bin`` ... and ``subnetdp prepare-text``'s output are named. A ``meta.json``
beside them (written by ``prepare-text``) gives the vocabulary; without it set ``data.vocab_size``.

``data.root: stdlib`` (the default, or an empty root) tokenises this Python's standard library into
``data.cache_dir`` on first use (a few seconds), so a language-model run needs no download.

Sequence packing: every shard is cut into contiguous windows of ``seq_len + 1`` tokens (consecutive
windows share one token), so a sample is ``(tokens[:-1], tokens[1:])`` and documents, separated by
an end-of-text token, run into each other as in GPT-style pre-training. Every epoch the windows are
shuffled from ``seed + epoch`` and dealt to ranks in turn; every rank gets the same number of full
batches. The position (epoch, batch) is saved and restored.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from subnetdp import ConfigError, DataConfig, DataModule, DataSpec, ResumableLoader, doc, hookimpl, plain_name_problem
from subnetdp.plugins.data.token_shards import PLAIN_DTYPES, open_shard

PREPARE_HINT = ("prepare shards with `subnetdp prepare-text FILES_OR_DIRS --out DIR` (or `--fineweb N`), "
                "or set data.root=stdlib to use the Python standard library")


@dataclass
class TokensConfig(DataConfig):
    root: str = "stdlib"
    seq_len: int = 128
    vocab_size: int = 0  # 0: from meta.json
    format: str = "auto"  # auto | fineweb | plain
    dtype: str = "uint16"  # token type of plain files
    train_pattern: str = "*train*.bin"
    val_pattern: str = "*val*.bin"
    shuffle: bool = True
    # Only for root=stdlib: where the corpus is built, and how.
    cache_dir: str = doc("root=stdlib only: where the corpus is built (eval and export take their own, never a "
                         "checkpoint's)", "runs/data", writes=True)
    tokenizer: str = "bytes"  # bytes | bpe
    bpe_vocab_size: int = 4096
    stdlib_max_mb: float = 4.0
    val_fraction: float = 0.05


class TokenWindows:
    """Windows of ``seq_len + 1`` tokens over a list of memory-mapped shards."""

    def __init__(self, shards: list[np.ndarray], seq_len: int) -> None:
        self.shards, self.seq_len = shards, seq_len
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def batch(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for i in np.asarray(indices, dtype=np.int64).reshape(-1):
            s = int(np.searchsorted(self.starts, i, side="right")) - 1
            off = int(i - self.starts[s]) * self.seq_len
            rows.append(np.asarray(self.shards[s][off:off + self.seq_len + 1], dtype=np.int64))
        window = torch.from_numpy(np.stack(rows))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class TokenLoader(ResumableLoader):
    """Endless batches of this rank's windows; reshuffled every epoch; position saved and restored."""

    def __init__(self, windows: TokenWindows, rank: int, world_size: int, batch_size: int, seed: int,
                 shuffle: bool = True) -> None:
        self.windows, self.rank, self.world_size = windows, rank, world_size
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.per_rank = len(windows) // world_size
        self.batches_per_epoch = self.per_rank // batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError("train.batch_size", batch_size,
                              f"the training shards hold {len(windows)} windows of {windows.seq_len + 1} tokens: "
                              f"fewer than one batch for each of {world_size} ranks",
                              "use a smaller batch or data.seq_len, or more data")
        self.epoch, self.position = 0, 0

    def _order(self) -> torch.Tensor:
        n = len(self.windows)
        order = (torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
                 if self.shuffle else torch.arange(n))
        return order[self.rank:self.per_rank * self.world_size:self.world_size]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            mine = self._order()
            while self.position < self.batches_per_epoch:
                b = self.position
                self.position += 1
                yield self.windows.batch(mine[b * self.batch_size:(b + 1) * self.batch_size].numpy())
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["batch"])


class EvalWindows:
    """The validation windows in order, in batches (re-iterable; nothing is read until iterated)."""

    def __init__(self, windows: TokenWindows, batch_size: int) -> None:
        self.windows, self.batch_size = windows, batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.windows), self.batch_size):
            yield self.windows.batch(np.arange(start, min(start + self.batch_size, len(self.windows))))

    def __len__(self) -> int:
        return -(-len(self.windows) // self.batch_size)


class TokensData(DataModule):
    """Token shards for language models (``DataSpec.vocab_size``, ``DataSpec.seq_len``)."""

    Config = TokensConfig
    data_kind = "tokens"
    ignores = {"image_size": "it yields token windows, whose length is data.seq_len"}

    @classmethod
    def conformance_overrides(cls, tmp_path: Any) -> list[str]:
        # A small slice of the stdlib corpus, built under tmp_path instead of the working directory.
        return ["data.stdlib_max_mb=0.5", "data.seq_len=32", f"data.cache_dir={tmp_path}/data"]

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        if cfg.seq_len < 1:
            raise ConfigError("data.seq_len", cfg.seq_len, "must be >= 1")
        for key, choices in (("format", ("auto", "fineweb", "plain")), ("dtype", tuple(PLAIN_DTYPES)),
                             ("tokenizer", ("bytes", "bpe"))):
            if cfg[key] not in choices:
                raise ConfigError(f"data.{key}", cfg[key], f"valid choices: {', '.join(choices)}")
        if not 0.0 <= cfg.val_fraction < 1.0:
            raise ConfigError("data.val_fraction", cfg.val_fraction, "must be in [0, 1)")

    def __init__(self, cfg: Any, seed: int = 0) -> None:
        super().__init__(cfg, seed)
        self._root: Path | None = None
        self._meta: dict[str, Any] = {}
        self._splits: dict[str, TokenWindows] = {}

    def root(self) -> Path:
        """The shard directory; ``stdlib`` (or empty) builds the standard-library corpus first."""
        if self._root is None:
            root = self.cfg.root
            if root in ("", "stdlib"):
                from subnetdp.plugins.data.corpus import build_stdlib_corpus

                c = self.cfg
                name = (f"stdlib-py{sysconfig.get_python_version()}-{c.tokenizer}"
                        + (f"{c.bpe_vocab_size}" if c.tokenizer == "bpe" else "")
                        + f"-{c.stdlib_max_mb:g}mb-val{c.val_fraction:g}")
                self._root = build_stdlib_corpus(Path(str(c.cache_dir)) / name, c.tokenizer, int(c.bpe_vocab_size),
                                                 float(c.stdlib_max_mb), float(c.val_fraction))
            else:
                self._root = Path(root).expanduser()
                if not self._root.is_dir():
                    raise ConfigError("data.root", root, "no such directory", PREPARE_HINT)
            meta = self._root / "meta.json"
            self._meta = json.loads(meta.read_text()) if meta.is_file() else {}
        return self._root

    def _windows(self, split: str) -> TokenWindows:
        if split not in self._splits:
            root = self.root()
            pattern = str(self.cfg.train_pattern if split == "train" else self.cfg.val_pattern)
            files = sorted(root.glob(pattern))
            if not files:
                raise ConfigError(f"data.{split if split == 'train' else 'val'}_pattern", pattern,
                                  f"matches no file in {root}", PREPARE_HINT)
            fmt = self.cfg.format
            if fmt == "auto" and self._meta.get("format") == "plain":
                fmt = "plain"
            dtype = str(self._meta.get("dtype", self.cfg.dtype))
            shards = [open_shard(f, fmt, dtype, self.spec().vocab_size) for f in files]
            windows = TokenWindows(shards, self.cfg.seq_len)
            if len(windows) == 0:
                raise ConfigError("data.seq_len", self.cfg.seq_len,
                                  f"the {split} shards in {root} hold fewer than {self.cfg.seq_len + 1} tokens",
                                  "use a smaller data.seq_len or more data")
            self._splits[split] = windows
        return self._splits[split]

    def check(self) -> None:
        self._windows("train")
        self._windows("val")

    def spec(self) -> DataSpec:
        self.root()
        vocab = self.cfg.vocab_size or int(self._meta.get("vocab_size", 0))
        if not vocab:
            raise ConfigError("data.vocab_size", 0, f"{self._root} has no meta.json to read the vocabulary from",
                              "set data.vocab_size to the tokenizer's vocabulary size (e.g. 50257 for GPT-2)")
        return DataSpec(vocab_size=vocab, seq_len=self.cfg.seq_len)

    def tokenizer(self) -> Any:
        """The tokenizer the shards were made with (``meta.json``), or None when it is unknown.

        A ``ByteTokenizer`` or ``BPETokenizer`` of :mod:`subnetdp.plugins.data.corpus`: ``encode(texts)``,
        ``decode(ids)``, ``eot``, ``vocab_size``. Used by downstream evaluation and HF export.
        """
        from subnetdp.plugins.data.corpus import make_tokenizer

        root = self.root()
        kind = self._meta.get("tokenizer")
        if kind == "bytes":
            return make_tokenizer("bytes")
        if kind == "bpe" and self._meta.get("tokenizer_file"):
            name = self._meta["tokenizer_file"]
            problem = plain_name_problem(name)
            if problem:  # meta.json is data: it names a file beside it, never one elsewhere
                raise ConfigError("data.root", self.cfg.root, f"{root / 'meta.json'} names the tokenizer file "
                                  f"{name!r}, which {problem}", "name a file in the shards' folder")
            path = root / name
            if not path.is_file():
                raise ConfigError("data.root", self.cfg.root, f"meta.json names {path}, which is missing",
                                  "copy the tokenizer file beside the shards, or prepare them again")
            return make_tokenizer("bpe", tokenizer_file=str(path))
        return None

    def planning_spec(self) -> tuple[DataSpec, str]:
        """Vocabulary from ``data.vocab_size``, else ``meta.json`` beside the shards when they exist,
        else the standard-library tokenizer's (``root=stdlib``); 0 (the model's default) otherwise."""
        seq = self.cfg.seq_len
        if self.cfg.vocab_size:
            return DataSpec(vocab_size=self.cfg.vocab_size, seq_len=seq), "config (data.vocab_size, data.seq_len)"
        root = self.cfg.root
        if root in ("", "stdlib"):
            vocab = 257 if self.cfg.tokenizer == "bytes" else self.cfg.bpe_vocab_size
            return (DataSpec(vocab_size=vocab, seq_len=seq),
                    f"config (data.root=stdlib, data.tokenizer={self.cfg.tokenizer}: vocabulary {vocab}; data.seq_len)")
        meta = Path(root).expanduser() / "meta.json"
        if meta.is_file():
            return self.spec(), f"dataset ({meta}: vocabulary; data.seq_len)"
        return (DataSpec(vocab_size=0, seq_len=seq),
                f"config ({root} has no meta.json: the model's default vocabulary; data.seq_len)")

    def train_loader(self, rank: int, world_size: int, batch_size: int) -> TokenLoader:
        return TokenLoader(self._windows("train"), rank, world_size, batch_size, self.seed, self.cfg.shuffle)

    def eval_loader(self, batch_size: int) -> EvalWindows:
        return EvalWindows(self._windows("val"), batch_size)


@hookimpl
def subnetdp_register_datasets(registry) -> None:
    registry.add("tokens", TokensData)

"""Token shard files: the FineWeb (llm.c) layout and plain ``.bin``, written and read back validated.

FineWeb layout (llm.c's ``fineweb.py``, also used by modded-nanogpt): a header of 256 little-endian
int32 — ``[20240520, 1, n_tokens, 0, ...]`` — then ``n_tokens`` uint16 tokens (vocabularies up to
65,536). llm.c's LLaMA-3 variant ``[20240801, 7, n_tokens, ...]`` followed by uint32 tokens is read
too. A plain ``.bin`` is the tokens alone, uint16 or uint32, with no header.

Every read validates: a known magic and version, a file size that matches the token count, and (on
the first million tokens) token ids below the vocabulary. Anything else is a :class:`ConfigError`
that names the file and what is wrong with it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from subnetdp import ConfigError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# magic -> (version, token dtype)
LAYOUTS = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}
PLAIN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
CHECK_TOKENS = 1 << 20


def write_shard(path: Path, tokens: np.ndarray, layout: str = "fineweb") -> Path:
    """Write ``tokens`` to ``path`` atomically (a temporary name, then a rename).

    Args:
        layout: ``fineweb`` (header; uint16 when every id fits, else llm.c's uint32 variant) or
            ``plain-uint16`` / ``plain-uint32`` (tokens only).
    """
    tokens = np.asarray(tokens)
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        if layout == "fineweb":
            magic = 20240520 if tokens.size == 0 or int(tokens.max()) < 1 << 16 else 20240801
            version, dtype = LAYOUTS[magic]
            header = np.zeros(HEADER_INTS, dtype="<i4")
            header[:3] = (magic, version, tokens.size)
            f.write(header.tobytes())
        elif layout.startswith("plain-") and layout[6:] in PLAIN_DTYPES:
            dtype = PLAIN_DTYPES[layout[6:]]
        else:
            raise ValueError(f"unknown shard layout {layout!r}")
        if tokens.size and int(tokens.max()) > np.iinfo(dtype).max:
            raise ValueError(f"token id {int(tokens.max())} does not fit {dtype} ({path})")
        f.write(tokens.astype(dtype).tobytes())
    os.replace(tmp, path)
    return path


def _bad(path: Path, problem: str, fix: str = "") -> ConfigError:
    return ConfigError("data.root", str(path.parent), f"token shard {path.name}: {problem}", fix)


def open_shard(path: Path, fmt: str = "auto", plain_dtype: str = "uint16", vocab_size: int = 0) -> np.memmap:
    """Memory-map one shard's tokens after validating the file.

    Args:
        path: the shard.
        fmt: ``auto`` (FineWeb header if the file starts with a known magic number, else an error),
            ``fineweb`` (a header is required) or ``plain`` (no header; ``plain_dtype`` tokens).
        plain_dtype: ``uint16`` or ``uint32``, for plain files.
        vocab_size: when > 0, the first million token ids must be below it.
    """
    path = Path(path)
    size = path.stat().st_size
    if fmt == "plain":
        dtype = PLAIN_DTYPES[plain_dtype]
        if size % dtype.itemsize:
            raise _bad(path, f"holds {size} bytes, not a whole number of {plain_dtype} tokens (truncated?)")
        tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
    else:
        tokens = _open_headered(path, size, fmt)
    if vocab_size and tokens.size:
        top = int(tokens[:CHECK_TOKENS].max())
        if top >= vocab_size:
            raise _bad(path, f"holds token id {top}, but the vocabulary has {vocab_size} ids",
                       "set data.vocab_size to the tokenizer's vocabulary, or check that the file is a token shard")
    return tokens


def _open_headered(path: Path, size: int, fmt: str) -> np.memmap:
    plain_fix = "if it is a plain token file, set data.format=plain and data.dtype=uint16|uint32"
    if size < HEADER_BYTES:
        raise _bad(path, f"holds {size} bytes, fewer than the {HEADER_BYTES}-byte FineWeb header (truncated or not a shard)",
                   plain_fix)
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, n_tokens = int(header[0]), int(header[1]), int(header[2])
    if magic not in LAYOUTS:
        raise _bad(path, f"starts with {magic}, not a FineWeb magic number ({', '.join(map(str, LAYOUTS))}): "
                         "a foreign file", plain_fix)
    want_version, dtype = LAYOUTS[magic]
    if version != want_version:
        raise _bad(path, f"has header version {version}; magic {magic} goes with version {want_version}")
    expected = HEADER_BYTES + n_tokens * dtype.itemsize
    if n_tokens < 0 or size < expected:
        raise _bad(path, f"is truncated: the header announces {n_tokens} tokens ({expected} bytes), the file "
                         f"holds {size} bytes", "prepare the data again (subnetdp prepare-text)")
    if size > expected:
        raise _bad(path, f"has {size - expected} bytes after the {n_tokens} tokens its header announces")
    if n_tokens == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))

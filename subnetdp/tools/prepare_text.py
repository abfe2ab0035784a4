"""``subnetdp prepare-text``: turn local text, the standard library or FineWeb into token shards.

Inputs are files or directories (a directory is searched recursively for ``.txt``, ``.jsonl``,
``.parquet`` and ``.py`` files, in sorted order), ``--stdlib`` (this Python's standard library), or
``--fineweb N``, which downloads files of FineWeb's ``sample-10BT`` from the Hugging Face hub over
HTTPS and tokenises them. Documents, tokenizers and the shard format are those of
:mod:`subnetdp.plugins.data.corpus`, which the ``tokens`` data plugin reads back.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path
from typing import Iterable

from subnetdp.core.errors import SubnetdpError
from subnetdp.plugins.data.corpus import SUFFIXES, prepare, read_documents, stdlib_files

FINEWEB_REPO, FINEWEB_DIR = "HuggingFaceFW/fineweb", "sample/10BT"


def input_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files named, and the text files under the directories named, in sorted order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES and f.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise SubnetdpError(f"prepare-text: input {p} does not exist")
    return out


def download_fineweb(out: str | Path, files: int = 1) -> list[Path]:
    """Download the first ``files`` parquet files (about 2 GB each) of FineWeb ``sample-10BT``.

    The file list comes from the Hugging Face hub's tree API; each file is streamed to a ``.part``
    name and renamed when complete, so a finished file is never fetched twice and an interrupted one
    is fetched again. Uses ``HF_ENDPOINT`` (default ``https://huggingface.co``) and ``HF_TOKEN`` if set.
    Not exercised by the tests (no internet there).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    headers = {"User-Agent": "subnetdp"}
    if os.environ.get("HF_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['HF_TOKEN']}"

    def get(url: str):
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60)

    try:
        with get(f"{endpoint}/api/datasets/{FINEWEB_REPO}/tree/main/{FINEWEB_DIR}") as r:
            listing = json.load(r)
    except OSError as e:
        raise SubnetdpError(f"prepare-text --fineweb: cannot list {endpoint}/datasets/{FINEWEB_REPO} ({e}); "
                            "this needs internet access (or HF_ENDPOINT pointing at a mirror)") from None
    names = sorted(item["path"] for item in listing if str(item.get("path", "")).endswith(".parquet"))
    if files > len(names):
        raise SubnetdpError(f"prepare-text --fineweb {files}: {FINEWEB_DIR} holds only {len(names)} files")
    paths = []
    for remote in names[:files]:
        dest = out / Path(remote).name
        paths.append(dest)
        if dest.is_file():
            continue
        url = f"{endpoint}/datasets/{FINEWEB_REPO}/resolve/main/{remote}"
        print(f"downloading {url}", flush=True)
        part = dest.with_suffix(".part")
        with get(url) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f, length=1 << 22)
        os.replace(part, dest)
    return paths


def add_prepare_text_arguments(p) -> None:
    """The options of ``subnetdp prepare-text``."""
    p.add_argument("inputs", nargs="*", metavar="FILE_OR_DIR",
                   help=".txt (a document per file), .jsonl (a document per line), .parquet or .py files, "
                        "or directories searched for them")
    p.add_argument("--out", required=True, help="output directory for the shards and meta.json")
    p.add_argument("--stdlib", action="store_true", help="use this Python's standard library as the corpus")
    p.add_argument("--fineweb", type=int, default=0, metavar="N",
                   help="download the first N parquet files (~2 GB each) of FineWeb sample-10BT into OUT/raw "
                        "and tokenise them (needs internet and pyarrow)")
    p.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bytes",
                   help="bytes: UTF-8 bytes, vocabulary 257 (default); bpe: HF tokenizers byte-level BPE")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary when training one (default 4096)")
    p.add_argument("--tokenizer-file", default=None, help="load a BPE tokenizer.json instead of training one")
    p.add_argument("--bpe-train-mb", type=float, default=256.0,
                   help="train the BPE on at most this many MiB of the training text (default 256)")
    p.add_argument("--text-field", default="text", help="JSON field / parquet column holding the text")
    p.add_argument("--val-fraction", type=float, default=0.05, help="fraction of documents held out (0.05)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (100M, as FineWeb)")
    p.add_argument("--max-mb", type=float, default=0.0, help="stop after this many MiB of text (0: all)")
    p.add_argument("--name", default=None, help="shard name prefix (default: text, stdlib or fineweb)")


def prepare_text_command(ns) -> int:
    """Run ``subnetdp prepare-text``; prints where the shards went and what they hold."""
    sources = [bool(ns.inputs), ns.stdlib, ns.fineweb > 0]
    if sum(sources) != 1:
        raise SubnetdpError("prepare-text: give input files or directories, or --stdlib, or --fineweb N (one of them)")
    if not 0.0 <= ns.val_fraction < 1.0:
        raise SubnetdpError(f"prepare-text: --val-fraction {ns.val_fraction} must be in [0, 1)")
    out = Path(ns.out)
    if ns.stdlib:
        files, name, source = stdlib_files(), "stdlib", "python standard library"
    elif ns.fineweb:
        files, name, source = download_fineweb(out / "raw", ns.fineweb), "fineweb", "FineWeb sample-10BT"
    else:
        files, name, source = input_files(ns.inputs), "text", ", ".join(map(str, ns.inputs))
    if not files:
        raise SubnetdpError(f"prepare-text: no {', '.join(SUFFIXES)} files in {', '.join(ns.inputs)}")
    max_bytes = int(ns.max_mb * 2**20)
    cap = min(max_bytes, int(ns.bpe_train_mb * 2**20)) if max_bytes else int(ns.bpe_train_mb * 2**20)
    training = read_documents(files, ns.text_field, cap) if ns.tokenizer == "bpe" and not ns.tokenizer_file else ()
    meta = prepare(training, read_documents(files, ns.text_field, max_bytes), out, ns.name or name, ns.tokenizer,
                   ns.vocab_size, ns.tokenizer_file, ns.val_fraction, ns.shard_tokens, source)
    print(f"wrote {meta['tokens']['train']:,} training and {meta['tokens']['val']:,} validation tokens "
          f"({meta['documents']['train']:,} + {meta['documents']['val']:,} documents, vocabulary "
          f"{meta['vocab_size']:,}, tokenizer {meta['tokenizer']}) to {out}\n"
          f"train on them with: subnetdp train llama_tiny_stdlib data.root={out}")
    return 0

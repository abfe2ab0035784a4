"""``subnetdp prepare-text``: turn local text, the standard library or FineWeb into token shards.

Inputs are files or directories (a directory is searched recursively for ``.txt``, ``.jsonl``,
``.parquet`` and ``.py`` files, in sorted order), ``--stdlib`` (this Python's standard library), or
``--fineweb N``, which downloads files of FineWeb's ``sample-10BT`` from the Hugging Face hub with
``huggingface_hub`` and tokenises them. Documents, tokenizers and the shard format are those of
:mod:`subnetdp.plugins.data.corpus`, which the ``tokens`` data plugin reads back.
"""

from __future__ import annotations

import logging
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


def _hub_failure(e: Exception) -> str:
    """One line for what went wrong talking to the hub (its errors can span lines)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def download_fineweb(out: str | Path, files: int = 1) -> list[Path]:
    """Download the first ``files`` parquet files (about 2 GB each) of FineWeb ``sample-10BT``.

    Through ``huggingface_hub`` (the ``llm`` extra): its resumable downloads and its own settings,
    ``HF_ENDPOINT`` (a mirror), ``HF_TOKEN`` or a stored login, ``HF_HUB_OFFLINE``. The files land in
    ``out`` (``huggingface_hub``'s ``local_dir``), so a finished file is not fetched again and an
    interrupted one resumes. Not exercised against the real hub by the tests (no internet there);
    the errors without a network are.
    """
    try:
        import huggingface_hub as hub
    except ImportError:
        raise SubnetdpError("prepare-text --fineweb needs huggingface_hub: pip install 'subnetdp[llm]'") from None
    from huggingface_hub import constants

    where = f"{constants.ENDPOINT}/datasets/{FINEWEB_REPO}"
    advice = ("this needs internet access, or HF_ENDPOINT pointing at a mirror (or the files already in "
              f"{Path(out) / FINEWEB_DIR} and --fineweb no larger than their number)")
    out = Path(out)
    # The hub retries an unreachable endpoint for about 20 s, logging each retry (through loggers that
    # other libraries may have given levels of their own); the answer is the one line below.
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        listing = hub.HfApi().list_repo_tree(FINEWEB_REPO, path_in_repo=FINEWEB_DIR, repo_type="dataset")
        names = sorted(item.path for item in listing if item.path.endswith(".parquet"))
    except Exception as e:  # noqa: BLE001 - the hub's HTTP client raises its own network errors
        have = sorted((out / FINEWEB_DIR).glob("*.parquet"))
        if len(have) >= files:  # offline, or the hub unreachable: what an earlier run downloaded serves
            return have[:files]
        raise SubnetdpError(f"prepare-text --fineweb: cannot list {where} ({_hub_failure(e)}); {advice}") from None
    finally:
        logging.disable(disabled)
    if files > len(names):
        raise SubnetdpError(f"prepare-text --fineweb {files}: {FINEWEB_DIR} holds only {len(names)} files")
    paths = []
    for remote in names[:files]:
        print(f"downloading {where}/{remote}", flush=True)
        try:
            paths.append(Path(hub.hf_hub_download(FINEWEB_REPO, remote, repo_type="dataset", local_dir=out)))
        except Exception as e:  # noqa: BLE001 - as above
            raise SubnetdpError(f"prepare-text --fineweb: cannot download {where}/{remote} ({_hub_failure(e)}); "
                                f"{advice}") from None
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
                        "with huggingface_hub and tokenise them (needs internet and the llm extra)")
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

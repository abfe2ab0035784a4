"""``subnetdp export CHECKPOINT OUT --format hf``: the union model as a Hugging Face model directory.

OUT receives what ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` reads:

- ``config.json``: the architecture (``LlamaForCausalLM`` for ``model.name=llama``);
- ``model.safetensors``: the union model's tensors under Hugging Face's names and layouts;
- ``generation_config.json``: the end-of-text token, so ``generate`` stops at a document's end;
- the tokenizer, when the run's data says which one made its shards (``meta.json`` of
  ``data.name=tokens``): ``tokenizer.json`` and ``tokenizer_config.json``, loadable with
  ``AutoTokenizer.from_pretrained(OUT)``. An HF ``tokenizers`` BPE is written as it is; the byte
  tokenizer (ids 0..255 = UTF-8 bytes, 256 = end of text) as the equivalent byte-level tokenizer
  without merges, so it too round-trips exactly.

A model plugin supports this by implementing ``hf_export(model, options, bos, eos) -> (config,
state_dict)`` (see docs/plugins.md). Nothing here needs ``transformers``: only loading does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from subnetdp.train.checkpoints import files as ck
from subnetdp.core.errors import SubnetdpError
from subnetdp.core.plugins import PluginManager

EOT = "<|endoftext|>"


def run_tokenizer(loaded: Any, pm: PluginManager) -> Any:
    """The tokenizer of the run's data (None when the data module does not know it)."""
    cfg = loaded.cfg
    data = pm.registries["data"].get(cfg.data.name)(cfg.data, seed=cfg.seed)
    return data.tokenizer()


def hf_tokenizer(tok: Any) -> Any:
    """A ``tokenizers.Tokenizer`` equal to a :mod:`subnetdp.plugins.data.corpus` tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if getattr(tok, "name", "") == "bpe":
        return tok.tok
    # Byte tokenizer: byte-level pre-tokenisation maps byte b to one printable character; a BPE
    # without merges whose vocabulary gives that character id b then encodes every byte as itself.
    alphabet = _byte_chars()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab[EOT] = int(tok.eot)
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOT])
    return hf


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, the one ``pre_tokenizers.ByteLevel`` uses."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tokenizer(tok: Any, out: Path, max_length: int) -> list[str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` for ``AutoTokenizer``; returns the file names."""
    hf = hf_tokenizer(tok)
    ck.write_atomic(out / "tokenizer.json", lambda p: hf.save(str(p)))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
              "unk_token": None, "pad_token": None, "model_max_length": int(max_length),
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    ck.write_text_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2))
    return ["tokenizer.json", "tokenizer_config.json"]


def export_hf(path: str | Path, out: str | Path, pm: PluginManager | None = None,
              data: Sequence[str] = ()) -> tuple[Path, list[str]]:
    """Write a checkpoint's union model as a Hugging Face model directory; returns it and its files.

    ``data``: ``data.key=value`` overrides, as for :func:`subnetdp.evaluate.export.export` (the tokenizer is the data's).
    """
    from subnetdp.evaluate.export import load_union

    pm = pm or PluginManager()
    loaded = load_union(path, pm, data)
    cfg, adapter = loaded.cfg, loaded.adapter
    options = loaded.manifest.get("reference")
    if not adapter.has_hf_export() or options is None:
        raise SubnetdpError(f"model plugin '{cfg.model.name}' has no Hugging Face export (hf_export): use "
                            "--format subnetdp for its plain reference state_dict")
    tok = run_tokenizer(loaded, pm)
    eot = int(tok.eot) if tok is not None else None
    config, state = adapter.hf_export(loaded.model, dict(options), bos=eot, eos=eot)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "subnetdp_run_id": str(loaded.manifest["run_id"]),
            "subnetdp_step": str(loaded.manifest["step"])}
    # The project's writer, as for every other file: created with the user's umask (0644), where
    # safetensors' own save_file leaves it readable by its owner alone (0600).
    ck.write_atomic(out / "model.safetensors", lambda p: ck.save_safetensors(p, state, meta))
    ck.write_text_atomic(out / "config.json", json.dumps(config, indent=2))
    files = ["config.json", "model.safetensors"]
    if eot is not None:
        gen = {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}
        ck.write_text_atomic(out / "generation_config.json", json.dumps(gen, indent=2))
        files.append("generation_config.json")
        files += write_tokenizer(tok, out, int(options.get("max_seq_len", 0)) or 2048)
    return out, files

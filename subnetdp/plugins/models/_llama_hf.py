"""The project's ``Llama`` as Hugging Face ``LlamaForCausalLM``: ``config.json`` fields and tensor names.

Layouts need no change, only names:

- every ``nn.Linear`` keeps its ``(out_features, in_features)`` weight, as HF's do;
- rotary embeddings: :func:`~subnetdp.plugins.models.llama.model.apply_rotary` rotates the pairs
  ``(x[i], x[i + head_dim/2])`` of each head (``cat(-x2, x1)`` with ``cos``/``sin`` repeated over
  both halves), which is exactly HF's ``rotate_half`` convention, so the rows of ``wq`` and ``wk``
  are copied as they are. (Meta's original checkpoints pair *interleaved* dims ``(2i, 2i+1)``; HF's
  conversion script permutes their rows for that reason. This model never had that layout.)
- a tied head is not written: HF ties ``lm_head.weight`` to ``model.embed_tokens.weight`` itself
  when ``tie_word_embeddings`` is true.
"""

from __future__ import annotations

from typing import Any

import torch

# Project name suffix -> HF name suffix, for every tensor of one block.
BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    """The HF ``LlamaForCausalLM`` name of one of the project's ``Llama`` tensors."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    head, index, rest = name.split(".", 2)
    if head != "layers" or rest not in BLOCK_NAMES:
        raise KeyError(f"no Hugging Face name for tensor '{name}'")
    return f"model.layers.{index}.{BLOCK_NAMES[rest]}"


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model's tensors under HF names (the tied head left out), contiguous copies."""
    tied = bool(model.args.tie_embeddings)
    out = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "output.weight":
            continue
        out[hf_name(name)] = tensor.detach().contiguous().clone()
    return out


def hf_config(options: dict[str, Any], bos: int | None, eos: int | None, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of ``LlamaForCausalLM`` for :class:`~subnetdp.plugins.models.llama.model.LlamaArgs` options.

    ``rope_theta`` is written both at the top level (transformers 4.x) and in ``rope_parameters``
    (transformers 5.x); each version reads its own and ignores the other.
    """
    dim, heads = int(options["dim"]), int(options["n_heads"])
    theta = float(options["rope_theta"])
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(options["vocab_size"]),
        "hidden_size": dim,
        "intermediate_size": int(options["hidden_dim"]),
        "num_hidden_layers": int(options["n_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(options["n_kv_heads"]),
        "head_dim": dim // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(options["max_seq_len"]),
        "rms_norm_eps": float(options["norm_eps"]),
        "rope_theta": theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": bool(options["tie_embeddings"]),
        "initializer_range": float(options["init_std"]),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }

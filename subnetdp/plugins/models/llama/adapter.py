"""Model ``llama``: a compact LLaMA; units are its transformer blocks (block level, one group).

The architecture is the usual one: token embedding, ``n_layers`` pre-norm blocks (RMSNorm,
grouped-query attention with rotary position embeddings through
``F.scaled_dot_product_attention``, RMSNorm, SwiGLU MLP), a final RMSNorm and a linear head, tied
to the embedding or not. Every block is one unit; the embedding, the final norm and the head are
shared. A dropped block is the identity (its two residual branches are zero), so a subnetwork is the
same model with fewer blocks. Blocks live in an ``nn.ModuleDict`` keyed by their original index, so a
subnetwork's parameter names are the full model's names.

Variants (vocabulary 32,000; parameter counts exact, checked by a test):

=======  =====  ======  =====  ========  ======  ====  =============
variant  dim    layers  heads  kv heads  hidden  tied  parameters
=======  =====  ======  =====  ========  ======  ====  =============
tiny     64     4       4      2         176     no    4,280,896 *
134m     768    12      12     12        2048    no    134,105,856
500m     1536   16      24     8         4096    no    501,007,872
1b       2048   16      32     8         8192    yes   1,038,682,112
=======  =====  ======  =====  ========  ======  ====  =============

(*) at vocabulary 32,000; with the byte tokenizer (257 tokens) ``tiny`` holds 217,792.

Each architecture key (``model.dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``hidden_dim``)
overrides the variant's value when set, e.g. ``model.n_layers=8 model.dim=128`` for a deeper
small model (``benchmarks/evidence_tasks.py``).

Neuron level (``masker.granularity=neuron``): each block's SwiGLU hidden dimension is cut into
``masker.units_per_layer`` equal ranges ``[a, b)``, one unit each, one group per layer
(``layers.i.feed_forward``), with slices ``TensorSlice("layers.i.feed_forward.w1.weight", 0, a, b)``
and ``...w3.weight", 0, a, b)`` (rows of gate and up) and ``...w2.weight", 1, a, b)`` (columns of
down); everything else is shared. See :mod:`subnetdp.plugins.models.llama.neurons`.
"""

from __future__ import annotations

import contextlib

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from subnetdp import ConfigError, DataSpec, HiddenSite, ModelConfig, hookimpl
from subnetdp.plugins.models._blocks import BlockAdapter, check_variant
from subnetdp.plugins.models.llama.neurons import materialize_neurons, neuron_partition
from subnetdp.plugins.models.llama.model import DEFAULT_VOCAB, VARIANTS, Llama, LlamaArgs, init_tensor, rotary_tables


@dataclass
class LlamaConfig(ModelConfig):
    variant: str = "tiny"
    vocab_size: int = 0  # 0: the data's vocabulary (32,000 when the data does not say)
    tie_embeddings: Optional[bool] = None  # None: the variant's choice
    rope_theta: float = 10_000.0
    init_std: float = 0.02
    # Tokens per chunk of the head and cross entropy in training (the full logits never exist);
    # 0: the plain path, all logits at once.
    loss_chunk: int = 1024
    # Architecture keys: each overrides the variant's value when set (None = the variant's).
    dim: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    hidden_dim: Optional[int] = None


ARCH_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim")


class LlamaAdapter(BlockAdapter):
    """LLaMA with block-level units (every transformer block, one group) or neuron-level units
    (ranges of each block's SwiGLU hidden dimension, one group per block)."""

    Config = LlamaConfig
    data_kind = "tokens"
    neuron_partition = staticmethod(neuron_partition)
    materialize_neurons = staticmethod(materialize_neurons)

    @classmethod
    def validate_config(cls, cfg: Any, root: Any) -> None:
        check_variant(cfg.variant, VARIANTS)
        if cfg.loss_chunk < 0:
            raise ConfigError("model.loss_chunk", cfg.loss_chunk, "must be >= 0",
                              "0 computes all logits at once; e.g. 1024 tokens per chunk")
        if cfg.vocab_size < 0:
            raise ConfigError("model.vocab_size", cfg.vocab_size, "must be >= 0", "0 takes the data's vocabulary")
        arch = cls._arch(cfg)
        for key in ARCH_KEYS:
            if arch[key] < 1:
                raise ConfigError(f"model.{key}", arch[key], "must be >= 1")
        if arch["dim"] % arch["n_heads"]:
            raise ConfigError("model.n_heads", arch["n_heads"], f"must divide model.dim={arch['dim']}",
                              "choose a head count that divides the width")
        if arch["n_heads"] % arch["n_kv_heads"]:
            raise ConfigError("model.n_kv_heads", arch["n_kv_heads"], f"must divide model.n_heads={arch['n_heads']}",
                              "grouped-query attention shares each key/value head among n_heads / n_kv_heads heads")

    @staticmethod
    def _arch(cfg: Any) -> dict[str, int]:
        """The variant's dimensions with the config's explicit architecture keys on top."""
        base = VARIANTS[cfg.variant]
        return {k: int(getattr(base, k)) if getattr(cfg, k, None) is None else int(getattr(cfg, k)) for k in ARCH_KEYS}

    def args(self, spec: DataSpec) -> LlamaArgs:
        """The variant's dimensions with the vocabulary, sequence length and options filled in."""
        base = VARIANTS[self.cfg.variant]
        vocab = self.cfg.vocab_size or spec.vocab_size or DEFAULT_VOCAB
        if spec.vocab_size and vocab < spec.vocab_size:
            raise ConfigError("model.vocab_size", vocab, f"is smaller than the data's vocabulary ({spec.vocab_size})",
                              "set model.vocab_size=0 to take the data's")
        tie = base.tie_embeddings if self.cfg.tie_embeddings is None else self.cfg.tie_embeddings
        arch = self._arch(self.cfg)
        return LlamaArgs(arch["dim"], arch["n_layers"], arch["n_heads"], arch["n_kv_heads"], arch["hidden_dim"], tie, vocab,
                         spec.seq_len or base.max_seq_len, self.cfg.rope_theta,
                         base.norm_eps, self.cfg.init_std)

    def build(self, spec: DataSpec) -> nn.Module:
        self._init_args = self.args(spec)
        return Llama(self._init_args)

    def init_module(self, name: str, module: nn.Module) -> None:
        """Each tensor as :meth:`Llama.reset_parameters` initialises it (by its global name)."""
        prefix = f"{name}." if name else ""
        for pname, p in module.named_parameters(recurse=False):
            init_tensor(prefix + pname, p, self._init_args)

    def residual_branches(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """A block's two residual branches: the attention and the SwiGLU MLP."""
        return {f"layers.{key}": [block.attention, block.feed_forward] for key, block in model.layers.items()}

    def branch_output_layers(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """The output projection ``wo`` and the down projection ``w2``."""
        return {f"layers.{key}": [block.attention.wo, block.feed_forward.w2] for key, block in model.layers.items()}

    def hidden_sites(self, model: nn.Module) -> list[HiddenSite]:
        """The SwiGLU hidden is the input of the down projection ``w2`` (last dimension)."""
        return [HiddenSite(block.feed_forward.w2, -1, "input") for block in model.layers.values()]

    def reference_options(self, spec: DataSpec) -> dict[str, Any]:
        """Rebuild an exported model with ``Llama(LlamaArgs(**options))``."""
        return dict(self.args(spec).__dict__)

    @staticmethod
    def reference_model(options: dict[str, Any]) -> nn.Module:
        """The plain model for :meth:`reference_options` (used by ``subnetdp export``)."""
        return Llama(LlamaArgs(**options))

    def hf_export(self, model: nn.Module, options: dict[str, Any], bos: int | None = None,
                  eos: int | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The full model as Hugging Face ``LlamaForCausalLM``: its ``config.json`` and its tensors
        under HF names (used by ``subnetdp export --format hf``; see ``_llama_hf``)."""
        from subnetdp.plugins.models._llama_hf import hf_config, hf_state_dict

        return hf_config(options, bos, eos, model.tok_embeddings.weight.dtype), hf_state_dict(model)

    def named_blocks(self, model: nn.Module) -> list[tuple[str, str, nn.Module]]:
        """Every transformer block, all in one group ``layers``."""
        return [(f"layers.{key}", "layers", block) for key, block in model.layers.items()]

    def block_costs(self, model: nn.Module, spec: DataSpec) -> dict[str, float]:
        cost = self._block_cost(model, spec)
        return {name: cost for name, _, _ in self.named_blocks(model)}

    @staticmethod
    def _block_cost(model: Llama, spec: DataSpec) -> float:
        """Forward FLOPs per sample of one block at the data's sequence length, measured with
        ``FlopCounterMode`` under ``FakeTensorMode`` (nothing is computed, so it is instant even for
        a 1B model). Every block has the same shape, so one measurement serves them all."""
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode

        block = next(iter(model.layers.values()))
        seq = spec.seq_len or model.args.max_seq_len
        device = next(block.parameters()).device
        meta = device.type == "meta"  # a model on meta is measured as it is: nothing is computed either
        fake = contextlib.nullcontext() if meta else (detect_fake_mode(list(block.parameters()))
                                                       or FakeTensorMode(allow_non_fake_inputs=True))
        counter = FlopCounterMode(display=False)
        with fake, torch.no_grad(), counter:
            x = torch.zeros(1, seq, model.args.dim, device=device if meta else None)
            cos, sin = rotary_tables(seq, model.args.head_dim, model.args.rope_theta, device if meta else None)
            block(x, cos, sin)
        return float(counter.get_total_flops())

    def drop_blocks(self, model: nn.Module, keep: set[str]) -> None:
        for key in list(model.layers.keys()):
            if f"layers.{key}" not in keep:
                del model.layers[key]  # a dropped block is the identity: nothing of it is kept

    def blocks(self, submodel: nn.Module) -> list[nn.Module]:
        return list(submodel.layers.values())

    def inputs(self, batch: Any) -> torch.Tensor:
        return batch[0]

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch; with ``model.loss_chunk > 0`` the head and cross entropy run
        inside the model's forward in chunks (:mod:`~subnetdp.plugins.models._lm_loss`), so FSDP's
        hooks around the root module see the head's use of its weight."""
        chunk = self.cfg.loss_chunk
        if chunk <= 0:
            return super().training_loss(model, batch)
        return model(batch[0], targets=batch[1], loss_chunk=chunk)

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        """Next-token cross entropy: ``batch = (tokens, targets)`` with targets shifted by one."""
        return F.cross_entropy(output.flatten(0, 1).float(), batch[1].flatten())

    @torch.no_grad()
    def metrics(self, outputs: Sequence[torch.Tensor], batches: Sequence[Any]) -> dict[str, float]:
        total, count = 0.0, 0
        for logits, batch in zip(outputs, batches):
            total += float(F.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten(), reduction="sum"))
            count += batch[1].numel()
        loss = total / max(count, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


@hookimpl
def subnetdp_register_models(registry) -> None:
    registry.add("llama", LlamaAdapter)

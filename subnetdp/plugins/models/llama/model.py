"""The LLaMA reference model: plain PyTorch modules, no SDP code (subnetdp's adapter is adapter.py).

``Llama(LlamaArgs(...))(tokens)`` gives next-token logits; ``VARIANTS`` holds the sizes subnetdp
ships (``tiny``, ``134m``, ``500m``, ``1b``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from subnetdp.plugins.models._lm_loss import chunked_cross_entropy

DEFAULT_VOCAB = 32_000


@dataclass(frozen=True)
class LlamaArgs:
    """The dimensions of one LLaMA."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    tie_embeddings: bool
    vocab_size: int = DEFAULT_VOCAB
    max_seq_len: int = 2048
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count, analytically (what ``sum(p.numel())`` of the built model gives)."""
        hd = self.head_dim
        attn = self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2
        block = attn + 3 * self.dim * self.hidden_dim + 2 * self.dim
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return embed + self.n_layers * block + self.dim


VARIANTS: dict[str, LlamaArgs] = {
    "tiny": LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=176, tie_embeddings=False),
    "134m": LlamaArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, hidden_dim=2048, tie_embeddings=False),
    "500m": LlamaArgs(dim=1536, n_layers=16, n_heads=24, n_kv_heads=8, hidden_dim=4096, tie_embeddings=False),
    "1b": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192, tie_embeddings=True),
}


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the angles ``t * theta^(-2i/head_dim)``, shape ``(seq_len, head_dim)``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[i], x[i + d/2])`` of ``x`` (``..., seq, head_dim``) by each position's angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: gate ``w1``, up ``w3``, down ``w2`` (LLaMA's names)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A pre-norm transformer block: two residual branches (attention, MLP)."""

    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.feed_forward = SwiGLU(a.dim, a.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


@torch.no_grad()
def init_tensor(name: str, p: torch.Tensor, a: LlamaArgs) -> None:
    """LLaMA's initialisation of the tensor called ``name``: norms 1, weights Normal(0, init_std), the
    projections back into the residual stream (``wo``, ``w2``) with std / sqrt(2 * n_layers)."""
    if p.dim() < 2:
        nn.init.ones_(p)
    elif name.endswith(("wo.weight", "w2.weight")):
        nn.init.normal_(p, std=a.init_std / math.sqrt(2 * a.n_layers))
    else:
        nn.init.normal_(p, std=a.init_std)


class Llama(nn.Module):
    """The reference model: ``Llama(LlamaArgs(...))(tokens)`` gives next-token logits ``(B, T, V)``."""

    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.reset_parameters()
        if a.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights; the projections back into the residual stream scaled by 1/sqrt(2L)."""
        for name, p in self.named_parameters():
            init_tensor(name, p, self.args)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, loss_chunk: int = 0) -> torch.Tensor:
        """Logits ``(B, T, V)``; with ``targets`` and ``loss_chunk > 0``, the mean next-token cross
        entropy instead, with the head computed ``loss_chunk`` tokens at a time (no full logits)."""
        cos, sin = rotary_tables(tokens.shape[1], self.args.head_dim, self.args.rope_theta, tokens.device)
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():  # a subnetwork holds only its own blocks
            h = block(h, cos, sin)
        if targets is not None and loss_chunk > 0:
            return chunked_cross_entropy(self.norm(h), self.output.weight, targets, loss_chunk)
        return self.output(self.norm(h))

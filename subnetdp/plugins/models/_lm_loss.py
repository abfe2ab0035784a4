"""A language model's head and cross entropy in chunks of tokens: the full logits never exist.

The plain path computes ``logits = h @ W^T`` for every token of the micro-batch (tokens x
vocabulary, in fp32 for the loss) and keeps them, their log-softmax and, in backward, their
gradient: about three copies of the largest activation of a language model, which SDP does not
shrink because the head is shared. :func:`chunked_cross_entropy` cuts the tokens into chunks and
runs head and loss of each chunk under :func:`torch.utils.checkpoint.checkpoint`: forward keeps no
chunk's logits (only the chunk's hidden states, which are needed anyway), and backward recomputes
one chunk's logits at a time, so at most one chunk's logits and their gradient exist at once.

The result is the plain ``F.cross_entropy(F.linear(h, W).float(), targets)`` (mean over the
targets that are not ``ignore_index``): the same operations on the same values per token, with the
sum over tokens and the head's weight gradient accumulated chunk by chunk, so the two paths differ
only by the order of floating-point sums. The extra cost is one more head matmul per chunk (the
recomputation), about 2% of a 1B LLaMA step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_nll(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    # As the plain path: the head in the autocast dtype, the loss in fp32.
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, targets, reduction="sum", ignore_index=ignore_index)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                          ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy of ``F.linear(hidden, weight)`` against ``targets``, ``chunk`` tokens at a time.

    Args:
        hidden: ``(..., dim)`` final hidden states (after the last norm).
        weight: the head's ``(vocab, dim)`` weight.
        targets: ``(...)`` token ids, the shape of ``hidden`` without its last dimension.
        chunk: tokens per chunk (> 0).
        ignore_index: targets that do not count, as in ``F.cross_entropy``.
    """
    flat, tgt = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    total = None
    # split (not slicing): its backward concatenates the chunks' gradients once, where slices would
    # each scatter into a zero tensor of the full size.
    for h, t in zip(flat.split(chunk), tgt.split(chunk)):
        part = checkpoint(_chunk_nll, h, weight, t, ignore_index, use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    count = (tgt != ignore_index).sum()
    return total / count

"""lm-eval's model API over a subnetdp language model (tokens -> logits): loglikelihood, rolling
loglikelihood and greedy generation. Imported only when ``eval.tasks`` or ``subnetdp eval --tasks``
asks for lm-eval (an optional extra), so this module may import it at the top."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM


class SubnetdpLM(TemplateLM):
    """A subnetdp language model (tokens -> logits) behind lm-eval's model API."""

    backend = "causal"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, device: torch.device, max_length: int,
                 batch_size: int = 16, max_gen_toks: int = 256) -> None:
        super().__init__()
        self.model, self.tok, self._device = model, tokenizer, torch.device(device)
        self.max_length, self.batch_size, self.max_gen_toks = int(max_length), int(batch_size), int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return int(self.tok.eot)

    @property
    def tokenizer_name(self) -> str:
        return f"subnetdp-{getattr(self.tok, 'name', 'tokenizer')}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return [int(i) for i in self.tok.encode([string])[0]]

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Log-softmax over the vocabulary at every position of each row (rows padded on the right,
        which a causal model cannot see from earlier positions)."""
        width = max(len(r) for r in rows)
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            batch[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        logits = self.model(batch.to(self._device)).float()
        return [F.log_softmax(logits[i, :len(r)], dim=-1).cpu() for i, r in enumerate(rows)]

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        # Each request: (key, context tokens, continuation tokens). The model sees at most
        # max_length tokens ending just before the last continuation token (left-truncated).
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            rows = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in chunk]
            for i, row, lp in zip(chunk, rows, self._logprobs(rows)):
                key, _, cont = requests[i]
                n = len(cont)
                scored = lp[len(row) - n:]
                target = torch.tensor(cont, dtype=torch.long)
                logprob = float(scored.gather(1, target[:, None]).sum())
                greedy = bool((scored.argmax(-1) == target).all())
                out[i] = (logprob, greedy)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, out[i])
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        results = []
        for (text,) in [r.args for r in requests]:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            total = sum(s for s, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding until one of ``until`` (or the end-of-text token), at most ``max_gen_toks``."""
        results = []
        for context, kwargs in [r.args for r in requests]:
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context) or [self.prefix_token_id]
            new: list[int] = []
            text = ""
            for _ in range(budget):
                window = (ids + new)[-self.max_length:]
                logits = self.model(torch.tensor([window], device=self._device))[0, -1]
                nxt = int(logits.argmax())
                if nxt == self.eot_token_id:
                    break
                new.append(nxt)
                text = self.tok_decode(new)
                if any(u in text for u in until):
                    break
            for u in until:
                text = text.split(u)[0]
            self.cache_hook.add_partial("generate_until", (context, kwargs), text)
            results.append(text)
        return results

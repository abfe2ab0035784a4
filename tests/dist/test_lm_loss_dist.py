"""The chunked LM-head loss in real 2-rank runs: SDP at C = 0.5, bf16, FSDP2 with activation checkpointing.

Each pair of runs differs only in ``model.loss_chunk`` (0: all logits at once; 48: chunks of 48 of
the 128 tokens of a micro-batch). The paths differ only in the order of the sums over tokens; after a
few AdamW steps fp32 weights agree to ``rtol=1e-5, atol=1e-6`` except where a near-zero gradient
let a rounding flip AdamW's normalised update (bounded by ``2 lr x steps``, at most 1% of them); in bf16 a gradient element near zero can change sign between the paths, and AdamW's
normalised update then moves that weight by up to ``lr`` the other way: ``atol = 2 lr x steps``.
"""

from __future__ import annotations

import torch

from subnetdp.plugins.data.tokens import TokensConfig, TokensData
from tests.helpers import lm_config, train_gathered
from tests.helpers import run_ranks

LR = 1e-3  # optim.lr of tests.helpers.lm_config
PAIRS = {
    "sdp": ("masker.coverage=0.5", "train.grad_accum=2"),
    "sdp_bf16": ("masker.coverage=0.5", "train.precision=bf16"),
    "fsdp_ac": ("masker.coverage=1", "fsdp.shard_size=2", "train.activation_checkpointing=1"),
}


def _pairs(rank: int, world: int, init_method: str, cache: str) -> dict:
    out = {}
    for name, overrides in PAIRS.items():
        for chunk in (0, 48):
            cfg = lm_config(f"{init_method}-{name}-{chunk}", cache, *overrides, f"model.loss_chunk={chunk}",
                          f"run.name={name}-{chunk}", "train.steps=3")
            params, summary, _ = train_gathered(cfg, rank, world)
            out[(name, chunk)] = (params, summary["ranks"][rank]["owned_units"])
    return out


def test_chunked_loss_trains_like_the_plain_loss_with_sdp_bf16_and_fsdp(tmp_path):
    cache = tmp_path / "data"
    TokensData(TokensConfig(root="stdlib", cache_dir=str(cache), stdlib_max_mb=0.5), seed=0).check()
    results = run_ranks(_pairs, 2, tmp_path, str(cache), timeout=400)
    owned = [res[("sdp", 0)][1] for res in results]
    assert owned[0] != owned[1] and len(owned[0]) == 2  # C = 0.5 of 4 blocks: two each, different ones
    for res in results:
        for name in PAIRS:
            plain, _ = res[(name, 0)]
            chunked, _ = res[(name, 48)]
            assert plain.keys() == chunked.keys()
            for n in plain:
                if name.endswith("bf16"):
                    # AdamW moves each weight by at most about lr per step whatever its gradient.
                    torch.testing.assert_close(chunked[n], plain[n], rtol=0, atol=2 * LR * 3, msg=n)
                else:
                    # The paths differ in the order of the sums over tokens: after the first step the
                    # weights differ by roundings, and where a gradient is near zero AdamW's normalised
                    # update can turn a rounding into a whole step (at most about 2 lr per step). So:
                    # every weight within that, and nearly all within fp32 tolerance.
                    torch.testing.assert_close(chunked[n], plain[n], rtol=0, atol=2 * LR * 3, msg=f"{name} {n}")
                    close = torch.isclose(chunked[n], plain[n], rtol=1e-5, atol=1e-6)
                    assert float(close.float().mean()) >= 0.99, (name, n, float(close.float().mean()))

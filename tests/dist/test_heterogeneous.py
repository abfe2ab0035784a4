"""Heterogeneous ranks (``masker.capacity``): 3 real gloo ranks holding 4, 2 and 1 of 4 blocks train together."""

from __future__ import annotations

import torch

from subnetdp.train.report import format_summary
from subnetdp.plugins.data.tokens import TokensConfig, TokensData
from tests.helpers import lm_config, train_gathered
from tests.helpers import run_ranks


def _run(rank: int, world: int, init_method: str, cache: str) -> dict:
    cfg = lm_config(init_method, cache, "masker.capacity=[1.0,0.5,0.25]", "run.name=het", "train.steps=3",
                  "checkpoint.enabled=true", "checkpoint.final=always")
    params, summary, _ = train_gathered(cfg, rank, world)
    return {"params": params, "summary": summary}


def test_heterogeneous_three_ranks_train_with_owners_bit_identical(tmp_path):
    cache = tmp_path / "data"
    TokensData(TokensConfig(root="stdlib", cache_dir=str(cache), stdlib_max_mb=0.5), seed=0).check()
    results = run_ranks(_run, 3, tmp_path, str(cache), timeout=300)
    summary = results[0]["summary"]
    owned = [r["owned_units"] for r in summary["ranks"]]
    assert [len(o) for o in owned] == [4, 2, 1]
    assert {u for o in owned for u in o} == {0, 1, 2, 3}
    held = [res["params"] for res in results]
    shared_names = 0
    for name in held[0]:
        holders = [r for r in range(3) if name in held[r]]
        for r in holders[1:]:
            assert torch.equal(held[r][name], held[holders[0]][name]), (name, holders)
        shared_names += len(holders) > 1
    assert shared_names > 0
    for r, res in enumerate(results):  # a held block is a block the plan gave that rank
        blocks = {int(n.split(".")[1]) for n in res["params"] if n.startswith("layers.")}
        assert blocks == set(owned[r])
    # Each rank's share is in the summary (the step waits for the rank holding the whole model).
    full = summary["full_model_params"]
    shares = [r["params_held"] / full for r in summary["ranks"]]
    assert shares[0] == 1.0 and shares[0] > shares[1] > shares[2]
    text = format_summary(summary, tmp_path)
    assert "100%" in text and "50%" in text and "25%" in text
    # A checkpoint of the heterogeneous run was written, keyed by unit as always.
    assert list(tmp_path.glob("*-runs/het/checkpoints/step_*/MANIFEST.json"))

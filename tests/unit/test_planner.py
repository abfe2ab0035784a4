"""``subnetdp plan`` from the data's shape, the memory-budget search, and heterogeneous capacities."""

from __future__ import annotations

import pytest

from subnetdp.cli import main
from subnetdp.plan.budget import DEFAULT_MARGIN, budget_search, format_budget, parse_margin, parse_memory
from subnetdp.core.config import config_root
from subnetdp.train.configure import load_config
from subnetdp.core.errors import ConfigError, SubnetdpError
from subnetdp.train.setup import build_plan
from subnetdp.plan.report import format_report, plan_report, shape_plan
from tests.helpers import plugin_manager, small_config

RECIPES = sorted(p.stem for p in (config_root() / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_plan_needs_no_dataset_on_disk(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/ folder, no runs/data cache: nothing on disk
    pm = plugin_manager()
    reads_root = "root" not in pm.registries["data"].get(load_config(recipe, [], pm.registries).data.name).ignores
    cfg = load_config(recipe, ["data.root=" + str(tmp_path / "absent")] if reads_root and "stdlib" not in recipe else [],
                      pm.registries)
    report = plan_report(cfg, 8, pm, estimate=False)
    assert report["data_source"].startswith("config"), report["data_source"]
    assert report["world_size"] == 8 and len(report["owned"]) == 8
    assert not any(tmp_path.iterdir())  # and nothing was written (the stdlib corpus is not built)


def test_shape_plan_is_the_training_plan_when_the_data_exists(tmp_path):
    cfg = small_config("masker.coverage=0.5")  # digits: the data ships with scikit-learn
    pm = plugin_manager()
    _, spec, _, _, partition, plan = build_plan(cfg, 4, pm)
    _, spec2, source, _, partition2, plan2 = shape_plan(cfg, 4, pm)
    assert spec2 == spec and plan2.digest() == plan.digest()
    assert [(u.name, u.cost, u.slices) for u in partition2.units] == [(u.name, u.cost, u.slices) for u in partition.units]


def test_parse_memory():
    assert parse_memory("24GiB", 3) == [24 * 2**30] * 3
    assert parse_memory("80GiB,80GiB,24GB,512MiB", 4) == [80 * 2**30, 80 * 2**30, 24 * 10**9, 512 * 2**20]
    with pytest.raises(SubnetdpError, match="--memory"):
        parse_memory("24GiB,24GiB", 3)
    with pytest.raises(SubnetdpError, match="--memory"):
        parse_memory("lots", 3)


def test_parse_margin():
    assert parse_margin("0.1") == parse_margin("10%") == DEFAULT_MARGIN == 0.1
    assert parse_margin("0") == 0
    for bad in ("1", "-0.1", "150%", "some", "nan"):
        with pytest.raises(SubnetdpError, match="--margin"):
            parse_margin(bad)


def test_budget_keeps_a_margin_and_ranks_the_whole_model_with_checkpointing_first():
    """The 1B recipe on 8 ranks with 24 GiB each: C = 0.6875 fills the budget to 23.89 GiB, but with
    activation checkpointing the whole model fits at 18.04 GiB, and the README prefers C = 1."""
    pm = plugin_manager()
    cfg = load_config("llama_1b_fineweb", [], pm.registries)
    budget = parse_memory("24GiB", 8)
    result = budget_search(cfg, 8, pm, budget)
    usable = int(24 * 2**30 * (1 - DEFAULT_MARGIN))
    assert result["usable"] == [usable] * 8 and result["fits"]
    first, last = result["options"][0], result["options"][-1]
    assert first["coverage"] == 1 and first["remedy"] == {"train.activation_checkpointing": 1}, result["options"]
    assert result["overrides"] == first["overrides"] and "train.activation_checkpointing=1" in first["overrides"]
    assert result["coverage"] == 1 and result["report"]["ranks"][0]["peak_memory_bytes"] == first["max_peak_bytes"]
    # Then the largest coverage that fits as configured, within the margin, the next one above it.
    assert len(result["options"]) == 2 and last["coverage"] < 1 and last["remedy"] == {}
    assert all(o["max_peak_bytes"] <= usable for o in result["options"])
    assert last["next_max_peak_bytes"] > usable
    # Each with its step cost: checkpointing recomputes a forward; a subnetwork trains fewer FLOPs.
    assert first["step_flops"] > 1.2 > 1 > last["step_flops"] > 0
    assert first["bytes_per_step"] > last["bytes_per_step"] > 0
    text = format_budget({"memory": "24GiB", **result})
    assert "planned to: 21.60 GiB (--margin 0.1" in text
    assert "answer: option 1, the whole model with activation checkpointing" in text


def _tiny(*overrides: str):
    return small_config("train.batch_size=2", "data.seq_len=32", *overrides, recipe="llama_tiny_stdlib")


def _peak(coverage: float) -> int:
    # flops=False: the peaks alone are compared; a FLOP count would cost more than the dry run.
    report = plan_report(_tiny(f"masker.coverage={coverage}"), 4, plugin_manager(), flops=False)
    return max(r["peak_memory_bytes"] for r in report["ranks"])


def test_budget_search_uniform_and_per_rank():
    pm = plugin_manager()
    cfg = _tiny()
    full, half, quarter = _peak(1.0), _peak(0.5), _peak(0.25)
    assert full > half > quarter
    budget = (full + half) // 2  # between the peaks of 2 and 4 of the 4 blocks
    dry_runs: dict = {}  # the three searches below share their dry runs: each candidate is dry-run once
    result = budget_search(cfg, 4, pm, [budget] * 4, margin=0, dry_runs=dry_runs)
    assert result["fits"] and result["max_peak_bytes"] <= budget
    largest = result["options"][-1]  # after the whole model with a remedy, when one makes it fit
    assert largest["coverage"] in (0.5, 0.75) and largest["next_max_peak_bytes"] > budget
    if largest["coverage"] == 0.5:
        assert largest["max_peak_bytes"] == half  # the plan's own estimate for that coverage
    # Too small for any coverage: it says what would fit, each answer within the budget.
    small = budget_search(cfg, 4, pm, [quarter - 1] * 4, margin=0, dry_runs=dry_runs)
    assert not small["fits"] and small["would_fit"], small
    assert all(a["max_peak_bytes"] < quarter for a in small["would_fit"])

    # One budget per rank: the probe plan (one rank at the candidate coverage, the others whole)
    # buckets a rank's gradients by other owner sets than the uniform plan, so leave a little room.
    room = (half - quarter) // 4
    budgets = [full, full, half + room, quarter + room]
    het = budget_search(cfg, 4, pm, budgets, margin=0, dry_runs=dry_runs)
    assert het["fits"], het
    assert het["capacity"] == [1.0, 1.0, 0.5, 0.25]
    report = het["report"]
    assert [row["coverage"] for row in report["ranks"]] == het["capacity"]
    assert all(row["peak_memory_bytes"] <= b for row, b in zip(report["ranks"], budgets))
    assert min(len(u["owners"]) for u in report["units"]) >= 1
    costs = [row["cost"] for row in report["ranks"]]
    assert report["cost_balance"] == pytest.approx(sum(costs) / len(costs) / max(costs)) and report["cost_balance"] < 1
    # Each candidate was dry-run once for the three searches, and each search still lists every dry run
    # its answer rests on (the whole model's, made by the first, in the second's too).
    tried = [t for r in (result, small, het) for t in r["tried"]]
    assert len(dry_runs) == len({(repr(sorted(t["overrides"].items())), t["probe"]) for t in tried}) < len(tried)
    whole = {"masker.coverage": 1.0, "masker.capacity": []}
    assert [t for t in small["tried"] if t["overrides"] == whole] == [t for t in result["tried"] if t["overrides"] == whole]


def test_capacity_plans_keep_every_unit_owned_and_are_checked_by_name():
    pm = plugin_manager()
    for masker in ("cyclic", "random"):
        _, _, _, _, partition, plan = shape_plan(_tiny(f"masker.name={masker}", "masker.capacity=[0.75,0.5,0.25]"), 3, pm)
        assert [len(o) for o in plan.owned] == [3, 2, 1] and min(plan.owner_counts()) >= 1
    # Equal capacities are the plain plan.
    a = shape_plan(_tiny("masker.capacity=[0.5,0.5,0.5,0.5]"), 4, pm)[-1]
    b = shape_plan(_tiny("masker.coverage=0.5"), 4, pm)[-1]
    assert a.digest() == b.digest()
    with pytest.raises(ConfigError, match="masker.capacity"):
        shape_plan(_tiny("masker.capacity=[0.5,0.5]"), 3, pm)
    with pytest.raises(ConfigError, match="masker.capacity"):
        _tiny("masker.capacity=[0.5,1.5]")
    with pytest.raises(ConfigError, match="masker.capacity"):
        _tiny("masker.name=balanced", "masker.capacity=[0.5,0.5]")
    assert main(["plan", "llama_tiny_stdlib", "-n", "3", "masker.capacity=[0.5,2]"]) == 2


@pytest.mark.parametrize("coverage, world, survived", [(1.0, 4, 3), (0.5, 4, 1), (0.5, 2, 0)])
def test_plan_reports_the_failures_it_survives_and_the_coverage_for_one(coverage, world, survived):
    cfg = _tiny(f"masker.coverage={coverage}")
    report = plan_report(cfg, world, plugin_manager(), estimate=False)
    counts = [len(u["owners"]) for u in report["units"]]
    assert report["failures"]["survived"] == min(counts) - 1 == survived
    # The smallest coverage for one failure is the first of the masker's coverages whose plan puts
    # every unit on two ranks: the one found plans so, and no smaller candidate does.
    found = report["failures"]["coverage_for_one"]
    assert found is not None
    one = plan_report(_tiny(f"masker.coverage={found}"), world, plugin_manager(), estimate=False)
    assert one["failures"]["survived"] >= 1
    if found > 0.25:
        below = plan_report(_tiny(f"masker.coverage={found - 0.25}"), world, plugin_manager(), estimate=False)
        assert below["failures"]["survived"] == 0
    text = format_report(report)
    line = next(x for x in text.splitlines() if x.startswith("failures:"))
    assert (f"survives any {survived} of {world} ranks" in line) == (survived > 0)
    assert f"survives one failure here is {found:.4g}" in line


def test_a_remedy_the_model_cannot_train_with_is_no_option():
    """BatchNorm refuses a micro-batch of 1 (the last halving remedy): the search records the failed
    dry run in one line and goes on, rather than ending in the dry run's traceback."""
    from subnetdp.plan.budget import BudgetSearch

    search = BudgetSearch(small_config(), 2, plugin_manager())
    assert search.evaluate({"train.batch_size": 1, "train.grad_accum": 32, "masker.coverage": 1.0}) is None
    failed = search.tried[-1]["invalid"]
    assert failed.startswith("the dry run fails: Expected more than 1 value per channel") and "\n" not in failed

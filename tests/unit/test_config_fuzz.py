"""Property-based fuzzing of the whole validation path: ``compose`` then ``preflight``.

Random keys (the schema's own and made-up ones) with random values (NaN, infinities, huge and
negative numbers, empty strings, unicode, lists and mappings where scalars belong) go through what
``subnetdp train`` runs before any worker starts. The property: a clean one-line error that names
one of the keys given, or a config that trains. A few accepted configs (``TRAINED``) really train one
step in this process; the others count as accepted by validation. Examples are fixed by a seed
(printed in every failure; ``SUBNETDP_FUZZ_SEED=N`` explores others), and the number of examples
bounds the time (about a minute here; raise SUBNETDP_FUZZ_EXAMPLES to explore more).
"""

from __future__ import annotations

import collections
import math
import os

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from subnetdp.core.config import compose
from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.errors import ConfigError, NonFiniteError, SubnetdpError
from subnetdp.train.loop import preflight, train
from tests.helpers import plugin_manager

SEED = int(os.environ.get("SUBNETDP_FUZZ_SEED", "16"))
EXAMPLES = int(os.environ.get("SUBNETDP_FUZZ_EXAMPLES", "60"))
TRAINED = 3  # accepted configs that really train one step; the rest stop after validation
BASE = ["launch.nproc=2", "launch.threads_per_rank=1", "train.progress=false",
        "checkpoint.enabled=false", "eval.bn_recalibrate_batches=0", "train.log_every=1000"]
PM = plugin_manager()


def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


KNOWN = _leaves(OmegaConf.to_container(compose("resnet18_digits", BASE, PM.registries)))  # type: ignore[arg-type]
KNOWN += ["model", "masker", "train", "optim", "seed", "resume", "comm.init_method", "comm.timeout_s"]
HOSTILE = [".nan", ".inf", "-.inf", "''", "null", "[]", "[1, 2]", "{a: 1}", "99999999999999999999999", "-1", "0",
           "1e309", "-0.0", "é", "日本", "\u202e", "../../x", "/etc", "/abs/path", "env://", "bogus://x",
           "tcp://h", "auto", "never", "tokens", "synthetic", "llama", "neuron", "backward", "adamw", "1000000000"]
keys = st.one_of(st.sampled_from(KNOWN), st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,2}", fullmatch=True))
values = st.one_of(
    st.sampled_from(HOSTILE),
    st.integers(-2**70, 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f) if math.isfinite(f) else str(f).replace("inf", ".inf").replace("nan", ".nan")),
    st.lists(st.integers(-3, 3), max_size=3).map(lambda xs: "[" + ",".join(map(str, xs)) + "]"),
    st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=6).map(lambda t: t.replace("=", "")),
)
# Values a user would type, so that some configs pass and train.
BENIGN = st.sampled_from([("masker.coverage", "1"), ("masker.coverage", "0.75"), ("masker.name", "random"),
                          ("masker.granularity", "neuron"), ("masker.regime", "backward"), ("optim.name", "adamw"),
                          ("optim.lr", "0.01"), ("optim.clip_grad_norm", "1.0"), ("seed", "3"), ("train.batch_size", "4"),
                          ("train.grad_accum", "2"), ("sync.max_groups", "1"), ("optim.schedule", "constant"),
                          ("model.variant", "resnet34"), ("data.name", "synthetic"), ("train.on_nonfinite", "skip")])
OUTCOMES: collections.Counter = collections.Counter()


def _names_a_given_key(error: SubnetdpError, given_keys: list[str]) -> bool:
    if isinstance(error, ConfigError):
        k = str(error.key)
        return any(g == k or g.startswith(k + ".") or k.startswith(g + ".") or k.startswith(g) for g in given_keys)
    return any(g in str(error) for g in given_keys)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print(f"\nconfig fuzzer (seed {SEED}): {sum(OUTCOMES.values())} cases: {dict(OUTCOMES)}")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False,
          print_blob=True, database=None)
@given(pairs=st.lists(st.one_of(st.tuples(keys, values), BENIGN, BENIGN), min_size=1, max_size=3))
@seed(SEED)
def test_fuzzed_config_is_refused_in_one_line_naming_a_key_or_trains(pairs, tmp_path_factory):
    items = [f"{k}={v}" for k, v in pairs]
    where = f"(fuzzer seed {SEED}: rerun with SUBNETDP_FUZZ_SEED={SEED}) overrides {items}"
    given_keys = [k for k, _ in pairs]
    try:
        cfg = compose("resnet18_digits", BASE + items, PM.registries)
        preflight(cfg, int(cfg.launch.nproc), PM)
    except SubnetdpError as e:
        msg = str(e)
        assert "\n" not in msg and len(msg) < 2000, f"{where}: not one line: {msg!r}"
        assert _names_a_given_key(e, given_keys), f"{where}: names none of {given_keys}: {msg}"
        OUTCOMES["refused: " + type(e).__name__] += 1
        return
    except Exception as e:  # anything else is a traceback the user would see
        raise AssertionError(f"{where}: {type(e).__name__} escaped validation: {e}") from e
    if OUTCOMES["trained one step"] + OUTCOMES["stopped: non-finite"] >= TRAINED:
        OUTCOMES["accepted by validation"] += 1
        return
    run_dir = tmp_path_factory.mktemp("fuzz")
    # One step, whatever the fuzzer set; run.dir/run.name last so the run stays in this test's folder.
    # In this one process: comm local, one rank, so coverage 1 (what C means for one rank).
    one = ["comm.name=local", "launch.nproc=1", "masker.coverage=1", "fsdp.shard_size=1", "train.steps=1",
           "eval.batches=1", f"run.dir={run_dir}", "run.name=f", "resume=never", "eval.every=0"]
    cfg = compose("resnet18_digits", BASE + items + one, PM.registries)
    try:
        run = train(cfg, LaunchEnv(0, 1, 0, 1, "test"), PM)
    except NonFiniteError:
        OUTCOMES["stopped: non-finite"] += 1
        return
    assert run.step == 1, where
    OUTCOMES["trained one step"] += 1

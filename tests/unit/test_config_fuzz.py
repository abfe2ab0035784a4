"""Property-based fuzzing of the whole validation path: ``load_config`` then ``preflight``.

Random keys (the schema's own and made-up ones) with random values (NaN, infinities, huge and
negative numbers, empty strings, unicode, lists and mappings where scalars belong) go through what
``subnetdp train`` runs before any worker starts. The property: a clean one-line error that names
one of the keys given, or a config that trains. A few accepted configs (``TRAINED``) really train one
step in this process; the others count as accepted by validation. Examples are fixed by a seed
(printed in every failure; ``SUBNETDP_FUZZ_SEED=N`` explores others), and the number of examples
bounds the time (about a minute here; raise SUBNETDP_FUZZ_EXAMPLES to explore more).

Every range and choice a schema field declares (``doc(..., lo=, hi=, choices=)``) is fuzzed from the
declaration itself, so a newly declared range is covered without a new test: values inside are never
refused by the range, values outside (and each open or closed end) are refused in one line that names
the key, the value and the valid range.
"""

from __future__ import annotations

import collections
import copy
import math
import os
import warnings

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from subnetdp.core.config import declared_keys
from subnetdp.core.contracts import LaunchEnv
from subnetdp.core.fields import Bounds
from subnetdp.train.configure import load_config, validate
from subnetdp.core.errors import ConfigError, NonFiniteError, SubnetdpError
from subnetdp.train.loop import train
from subnetdp.train.setup import preflight
from tests.helpers import plugin_manager

SEED = int(os.environ.get("SUBNETDP_FUZZ_SEED", "16"))
EXAMPLES = int(os.environ.get("SUBNETDP_FUZZ_EXAMPLES", "60"))
TRAINED = 3  # accepted configs that really train one step; the rest stop after validation
BASE = ["launch.nproc=2", "launch.threads_per_rank=1", "train.progress=false", "optim.warmup_steps=0",
        "checkpoint.enabled=false", "eval.bn_recalibrate_batches=0", "train.log_every=1000"]
PM = plugin_manager()


def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


KNOWN = _leaves(OmegaConf.to_container(load_config("resnet18_digits", BASE, PM.registries)))  # type: ignore[arg-type]
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
        cfg = load_config("resnet18_digits", BASE + items, PM.registries)
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
           "optim.warmup_steps=0",
           "eval.batches=1", f"run.dir={run_dir}", "run.name=f", "resume=never", "eval.every=0"]
    cfg = load_config("resnet18_digits", BASE + items + one, PM.registries)
    try:
        run = train(cfg, LaunchEnv(0, 1, 0, 1, "test"), PM)
    except NonFiniteError:
        OUTCOMES["stopped: non-finite"] += 1
        return
    assert run.state.step == 1, where
    OUTCOMES["trained one step"] += 1


# --------------------------------------------------------------------------- declared ranges and choices

COMPOSED = load_config("resnet18_digits", BASE, PM.registries)
DECLARED = declared_keys(COMPOSED, PM.registries)
WORD = st.from_regex(r"[a-z]{1,4}_[a-z]{1,6}", fullmatch=True)  # never a YAML keyword (null, true, ...)


def _kind(key: str) -> type:
    """int, float or list: the field's type, read from its composed default (an empty optional is an int)."""
    default = OmegaConf.select(COMPOSED, key)
    return type(default) if isinstance(default, (int, float)) else list if default is not None else int


def _ends(b: Bounds, kind: type) -> tuple[list, list]:
    """The values at and just beyond each end: (inside, outside)."""
    step = 1 if kind is int else 1e-3
    inside, outside = [], []
    for end, is_open, beyond in ((b.lo, b.lo_open, -step), (b.hi, b.hi_open, step)):
        if end is None:
            continue
        (outside if is_open else inside).append(kind(end) if kind is int else float(end))
        outside.append(kind(end) + beyond if kind is int else float(end) + beyond)
    return inside, outside


def _number(b: Bounds, kind: type, inside: bool) -> st.SearchStrategy:
    """A number inside the declared range, or outside it (below ``lo`` or above ``hi``)."""
    num = st.integers if kind is int else (lambda lo=None, hi=None: st.floats(lo, hi, allow_nan=False, allow_infinity=False))
    if inside:
        lo = b.lo if b.lo is not None else -10**6
        hi = b.hi if b.hi is not None else lo + 10**6
        lo, hi = (int(lo) + (1 if b.lo_open else 0), int(hi) - (1 if b.hi_open else 0)) if kind is int else (lo, hi)
        return num(lo, hi).filter(lambda v: not b.outside(v))
    sides = []
    if b.lo is not None:
        sides.append(num(int(b.lo) - 10**6, int(b.lo) - 1) if kind is int else num(b.lo - 1e6, b.lo).filter(b.outside))
    if b.hi is not None:
        sides.append(num(int(b.hi) + 1, int(b.hi) + 10**6) if kind is int else num(b.hi, b.hi + 1e6).filter(b.outside))
    return st.one_of(sides)


def _case(key: str) -> st.SearchStrategy:
    """(key, a value, whether the declaration accepts it)."""
    b = DECLARED[key]
    if b.choices:
        return st.one_of(st.sampled_from(b.choices).map(lambda c: (key, c, True)),
                         WORD.filter(lambda w: w not in b.choices).map(lambda w: (key, w, False)))
    kind = _kind(key)
    wrap = (lambda v: [v]) if kind is list else (lambda v: v)
    return st.booleans().flatmap(lambda ok: _number(b, float if kind is list else kind, ok).map(lambda v: (key, wrap(v), ok)))


def _refusal(key: str, value: object, typed: bool) -> ConfigError | None:
    """The ConfigError for ``key=value``, typed on the command line (the whole path) or set on the
    composed config and checked again (the same checks, without re-reading every file)."""
    try:
        if typed:
            load_config("resnet18_digits", BASE + [f"{key}={value!r}" if not isinstance(value, str) else f"{key}={value}"],
                        PM.registries)
        else:
            cfg = copy.deepcopy(COMPOSED)
            OmegaConf.update(cfg, key, value)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # threads above this machine's cores: a warning, not a refusal
                validate(cfg, PM.registries)
    except ConfigError as e:
        return e
    return None


def _check_declared(key: str, value: object, inside: bool, typed: bool = True) -> None:
    b = DECLARED[key]
    e = _refusal(key, value, typed)
    if e is None:
        assert inside, f"{key}={value!r} is outside {b.text()}, yet accepted"
        return
    msg = str(e)
    assert "\n" not in msg and len(msg) < 2000, msg
    declared = e.key == key and (e.problem.startswith("valid choices") or e.problem.endswith(b.must()))
    assert not (inside and declared), f"{key}={value!r} is inside {b.text()}, yet refused: {msg}"
    if not inside:
        assert declared, f"{key}={value!r} is outside {b.text()}: refused for another reason: {msg}"
        assert b.fix in msg and (b.choices or b.text() in msg), msg


@pytest.mark.parametrize("key", sorted(DECLARED))
def test_each_declared_range_accepts_its_closed_ends_and_refuses_beyond_them(key):
    b = DECLARED[key]
    if b.choices:
        for choice in b.choices:
            _check_declared(key, choice, True, typed=False)
        _check_declared(key, "not_" + b.choices[0], False, typed=False)
        return
    kind = _kind(key)
    inside, outside = _ends(b, float if kind is list else kind)
    wrap = (lambda v: [v]) if kind is list else (lambda v: v)
    for v in inside:
        _check_declared(key, wrap(v), True, typed=False)
    for v in outside:
        _check_declared(key, wrap(v), False, typed=False)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False,
          print_blob=True, database=None)
@given(case=st.sampled_from(sorted(DECLARED)).flatmap(_case))
@seed(SEED)
def test_fuzzed_values_of_declared_ranges_are_refused_exactly_outside_them(case):
    _check_declared(*case)

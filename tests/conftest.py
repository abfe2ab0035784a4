import gc
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# What one test may leave in its temporary directory. The suite runs on machines with little free
# disk beside the 6 GB virtual environment: a spawned worker hands back digests and samples, not
# models, and a run keeps only the checkpoints its test needs.
TMP_LIMIT_BYTES = 500 * 2**20


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


@pytest.fixture(autouse=True)
def _temporary_directory_stays_small(request, tmp_path):
    # Depends on tmp_path so that it is measured before tmp_path's own teardown removes it.
    yield
    path = tmp_path
    size = _size(path)
    assert size <= TMP_LIMIT_BYTES, (f"{request.node.nodeid} left {size / 2**20:.0f} MiB in {path} (limit "
                                     f"{TMP_LIMIT_BYTES / 2**20:.0f} MiB): hand back digests or samples, not whole models")


# Folders and files whose tests spawn process groups, run torchrun, kill ranks or install packages:
# each takes more than ~8 s, so the quick tier (`-m "not slow"`) leaves them out. Marking by place
# keeps a new test there in the slow tier without anyone remembering the decorator.
_SLOW_DIRS = ("tests/dist/", "tests/e2e/")
_SLOW_FILES = ("tests/plugins/test_plugin_compat.py", "tests/plugins/test_plugin_template.py")
_SLOW_TESTS = ("tests/unit/test_planner.py::test_budget_keeps_a_margin_and_ranks_the_whole_model_with_checkpointing_first",
               "tests/unit/test_planner.py::test_budget_search_uniform_and_per_rank",
               "tests/unit/test_cli_output.py::test_a_piped_run_prints_whole_log_lines_and_no_bar",
               "tests/unit/test_faults.py::test_kill_while_pruning_leaves_no_half_checkpoint_and_the_leftover_is_cleaned",
               "tests/plugins/test_plugin_guide.py::test_adapter_built_from_the_guide_trains_on_two_gloo_ranks",
               "tests/plugins/test_conformance.py::test_every_masker_plans_validly_purely_and_stably_below_full_coverage")


def _slow(nodeid: str) -> bool:
    path = nodeid.split("::", 1)[0]
    return path.startswith(_SLOW_DIRS) or path in _SLOW_FILES or nodeid in _SLOW_TESTS


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _slow(item.nodeid):
            item.add_marker(pytest.mark.slow)


# Under pytest-xdist (scripts/test.sh: -n 2 --dist loadgroup) these run one at a time on one worker, as without
# it: they start launchers and process groups that fill both cores, kill, stall or signal them, and bound how
# long a death, a stall or a signal may take. Everything else (the in-process tests, and the spawned 2- and
# 4-rank equality tests of tests/dist, which bound nothing but a hard timeout) runs beside them on the other.
_ONE_AT_A_TIME = ("tests/e2e/", "tests/dist/test_stalled_peer.py", "tests/dist/test_inprocess_comm.py",
                  "tests/dist/test_inprocess_regroup.py", "tests/dist/test_stop_agreement.py")
# End-to-end runs that only launch 2 workers (on torchrun's standalone rendezvous or a free port) and bound
# nothing but a hard timeout, as the tests of tests/dist: they run in either lane (the one-at-a-time lane
# bounded the suite: 867 s against the other's 766 s, measured with --durations=0).
_EITHER_LANE = ("tests/e2e/test_launchers.py", "tests/e2e/test_examples_own_loop.py", "tests/e2e/test_k8s_example.py")


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # a hook of pytest-xdist, a dev dependency
def pytest_xdist_make_scheduler(config, log):
    # pytest-xdist 3.8's own xdist_group marks do not group under pytest 9 (the nodeid they rename is
    # read-only there): the scheduler itself maps those tests to one unit of work.
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneAtATime(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "one-at-a-time" if path.startswith(_ONE_AT_A_TIME) and not path.startswith(_EITHER_LANE) else nodeid

    return OneAtATime(config, log)


def pytest_sessionstart(session):
    # With PYTHONDONTWRITEBYTECODE set (as on the development machines), Python caches no bytecode, so
    # every process the suite starts (a few hundred launchers, workers and CLI runs) compiled the
    # project's modules again, about 0.15 s of CPU each. Compiled once here (compileall writes despite
    # that variable and skips what is up to date), they are read by every process; a checkout that
    # cannot be written to is left as it is.
    if sys.dont_write_bytecode:
        import compileall

        root = Path(__file__).resolve().parents[1]
        for folder in ("subnetdp", "tests"):
            try:
                compileall.compile_dir(root / folder, quiet=2)
            except OSError:
                pass


def pytest_collection_finish(session):
    # What collecting imported (torch, the plugins, every test module) lives as long as the session:
    # frozen out of the cycle collector, whose full collections would walk it all again, and again.
    # Measured on 116 quick unit tests: 10 full collections took 8.1 s, frozen 18 took 3.5 s.
    gc.freeze()

"""What the informational commands print: whole sentences, whole lines, stated assumptions and units."""

from __future__ import annotations

import io
import re
import sys

from subnetdp.cli import main, recipe_summary
from subnetdp.core.config import config_root
from subnetdp.plan.budget import format_budget
from subnetdp.plan.report import format_report, plan_report
from tests.helpers import plugin_manager, small_config


def test_recipes_lists_each_recipe_by_its_whole_first_sentence(capsys):
    assert main(["recipes"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # wrapped lines joined back
    recipes = sorted((config_root() / "recipes").glob("*.yaml"))
    for path in recipes:
        about = recipe_summary(path.read_text())
        assert about.endswith(".") and f"{path.stem} {about}" in out, (path.stem, about)
    # A first line that runs on into the next one is read to the end of its sentence.
    assert recipe_summary("# ResNet-18 on CIFAR-10, block-level SDP at coverage 0.5 (every block held by\n"
                          "# 2 of the 4 ranks). The usual schedule: SGD, e.g. 200 epochs.\n#\n# Data: ...\n") == \
        "ResNet-18 on CIFAR-10, block-level SDP at coverage 0.5 (every block held by 2 of the 4 ranks)."


def test_plan_states_what_its_estimate_assumes():
    cfg = small_config("train.batch_size=2", "data.seq_len=32", "train.precision=bf16", recipe="llama_tiny_stdlib")
    text = format_report(plan_report(cfg, 2, plugin_manager()))
    header = text.splitlines()[:3]
    assert header[2] == ("estimates assume: bf16 (train.precision), micro-batch 2 per rank (train.batch_size; "
                         "train.grad_accum=1 micro-batches per step, one at a time in memory), sequence length 32 "
                         "(data.seq_len), activation checkpointing off (train.activation_checkpointing=0), adamw "
                         "optimizer state (optim.name)"), header


def test_budget_answer_shows_the_budget_in_gib_and_every_search_line_whole():
    invalid = ("masker.capacity gives units nobody owns: " + ", ".join(f"layers.{i}" for i in range(1, 40, 2))
               + " (raise the smallest coverage)")
    result = {"memory": "24GB", "budgets": [24 * 10**9] * 2, "fits": True, "coverage": 0.5,
              "max_peak_bytes": 20 * 2**30, "next_coverage": None, "overrides": ["masker.coverage=0.5"],
              "tried": [{"overrides": {"masker.coverage": 1.0, "masker.capacity": [0.5, 0.25]}, "probe": None,
                         "invalid": invalid}]}
    lines = format_budget(result).splitlines()
    assert lines[0] == ("memory budget per rank: 22.35 GiB (--memory 24GB: GB and MB are decimal, 10^9 and 10^6 "
                        "bytes; GiB and MiB are 2^30 and 2^20, as GPU memory is counted)")
    assert lines[1].endswith(f"invalid ({invalid})")
    assert lines[2].startswith("answer: masker.coverage=0.5 fits every rank's 22.35 GiB (max peak 20.00 GiB)")
    result["memory"] = "24GiB"
    result["budgets"] = [24 * 2**30] * 2
    assert format_budget(result).splitlines()[0] == "memory budget per rank: 24.00 GiB"


def test_the_readme_examples_are_what_the_program_prints(capsys, tmp_path, monkeypatch):
    """Every ``$ subnetdp ...`` line in the README's example blocks, run, prints the line below it."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    examples = re.findall(r"^\$ subnetdp (.+)\n(subnetdp: .+)$", readme, re.MULTILINE)
    assert len(examples) >= 2, examples
    monkeypatch.chdir(tmp_path)  # a run that was not refused would write here, not into the checkout
    for command, shown in examples:
        main(shlex.split(command))
        printed = capsys.readouterr().err.strip().splitlines()
        assert printed and printed[-1] == shown, (command, printed)


def test_a_piped_run_prints_whole_log_lines_and_no_bar(tmp_path):
    """``train.progress=auto`` (the default) on a pipe: plain log lines on stdout, no carriage returns."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "subnetdp", "train", "resnet18_digits", "train.steps=2",
                           "train.log_every=1", "train.batch_size=4", "optim.warmup_steps=0", "eval.batches=1",
                           "eval.bn_recalibrate_batches=0", "launch.threads_per_rank=1", f"run.dir={tmp_path}",
                           "launch.nproc=2",  # the launcher and its workers on the pipe, 2 of the recipe's 4 are enough
                           "run.name=piped"], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each plain line starts with its time (a batch job's log says when each step ended).
    steps = [ln for ln in proc.stdout.splitlines() if " step " in ln and "loss" in ln]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step ", ln) for ln in steps), steps
    assert [ln.split()[3] for ln in steps] == ["1", "2"]
    assert "\r" not in proc.stdout + proc.stderr  # no bar redrawn in place


def test_the_program_ends_frozen_out_of_the_collector_and_main_in_a_test_process_does_not():
    """Both ways of starting the program (the ``subnetdp`` script, ``python -m subnetdp``) end with what
    is alive frozen out of the cycle collector, which spares every worker the shutdown's full
    collections, and a training process imports with the collector paused; :func:`main`, called in this
    long-lived process, freezes nothing."""
    import gc
    import subprocess
    import sys
    from importlib.metadata import entry_points

    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "subnetdp"]
    report = "import atexit, gc; atexit.register(lambda: print('frozen', gc.get_freeze_count()))"
    starts = {"script": f"{report}; import sys; sys.argv = ['subnetdp', '--version']; "
                        f"from {script.module} import {script.attr}; raise SystemExit({script.attr}())",
              "-m": f"{report}; import runpy, sys; sys.argv = ['subnetdp', '--version']; "
                    "runpy.run_module('subnetdp', run_name='__main__')"}
    for how, code in starts.items():
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("subnetdp "), (how, proc.stderr[-2000:])
        assert int(proc.stdout.split("frozen ")[-1]) > 0, (how, proc.stdout[-500:])
    before = gc.get_freeze_count()
    assert main(["recipes"]) == 0 and gc.get_freeze_count() == before
    # `subnetdp train` imports torch and its plugins with the collector paused (they make no garbage), and
    # it collects again once they are loaded (a long run's garbage is collected).
    watch = ("import gc, sys; seen = []\n"
             "from subnetdp.cli import program\n"
             "gc.callbacks.append(lambda phase, info: phase == 'start' and seen.append("
             "'subnetdp.plugins.models.resnet.adapter' in sys.modules))\n"
             "code = program(['train', 'resnet18_digits', '--print-config'])\n"
             "print('enabled', gc.isenabled(), 'before', seen.count(False), 'after', seen.count(True))\n"
             "raise SystemExit(code)")
    proc = subprocess.run([sys.executable, "-c", watch], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "masker:" in proc.stdout, proc.stderr[-2000:]
    enabled, _, before, _, after = proc.stdout.split("enabled ")[-1].split()
    assert (enabled, before) == ("True", "0") and int(after) > 0, proc.stdout[-300:]


class _CountedWrites(io.RawIOBase):
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.writes.append(bytes(b))
        return len(b)


def test_an_unbuffered_console_gets_each_line_in_one_write(monkeypatch):
    # PYTHONUNBUFFERED (as on these machines): print writes a line's text and its newline apart, and the
    # lines of workers sharing a console ran into each other. whole_lines makes a line one write.
    from subnetdp.cli import whole_lines

    for fix in (False, True):
        raw = _CountedWrites()
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, write_through=True))
        if fix:
            whole_lines()
        print("subnetdp: rank 0: another worker was lost", flush=True)
        print("subnetdp: rank 2: another worker was lost", flush=True)
        assert raw.writes == ([b"subnetdp: rank 0: another worker was lost\n", b"subnetdp: rank 2: another worker was lost\n"]
                              if fix else [b"subnetdp: rank 0: another worker was lost", b"\n",
                                           b"subnetdp: rank 2: another worker was lost", b"\n"]), raw.writes

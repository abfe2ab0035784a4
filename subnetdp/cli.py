"""``subnetdp`` command line: train, plan, launch, eval, export, plugins, prepare-text."""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import textwrap
import warnings
from typing import Sequence

from subnetdp.core.errors import PeerLost, SubnetdpError


def _split_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """The optional leading recipe, then ``key=value`` overrides."""
    recipe = None
    rest = list(args)
    if rest and "=" not in rest[0] and not rest[0].startswith("~"):
        recipe = rest.pop(0)
    for item in rest:
        if "=" not in item and not item.startswith("~"):
            raise SubnetdpError(f"'{item}' is not a key=value override or a ~key deletion "
                                "(a recipe may only come first)")
    return recipe, rest


def cmd_train(ns: argparse.Namespace) -> int:
    from subnetdp.train.command import train_command

    recipe, overrides = _split_args(ns.args)
    return train_command(recipe, overrides, print_config=ns.print_config, plugins_loaded=_collect_again)


def cmd_launch(ns: argparse.Namespace) -> int:
    from subnetdp.core.errors import ConfigError
    from subnetdp.launchers.nodes import node_overrides
    from subnetdp.train.command import launch_command

    if ns.nproc < 1:
        raise ConfigError("--nproc", ns.nproc, "must be at least 1", "give the number of workers, e.g. --nproc 2")
    recipe, overrides = _split_args(ns.args)
    overrides = overrides + node_overrides(ns)  # --nnodes and the like are launch.* keys
    return launch_command(recipe, overrides, ns.launcher, ns.nproc, mpirun=ns.mpirun,
                          launcher_args=ns.launcher_args.split(), dry_run=ns.dry_run, node_rank=ns.node_rank)


def cmd_plan(ns: argparse.Namespace) -> int:
    from subnetdp.train.configure import load_config
    from subnetdp.train.picture import plan_picture
    from subnetdp.core.plan import MaskPlan
    from subnetdp.plan.report import format_report, plan_report
    from subnetdp.core.errors import ConfigError
    from subnetdp.core.plugins import PluginManager

    recipe, overrides = _split_args(ns.args)
    pm = PluginManager()
    cfg = load_config(recipe, overrides, pm.registries)
    world = int(cfg.launch.nproc if ns.world_size is None else ns.world_size)
    if world < 1:
        raise ConfigError("--world-size", world, "must be at least 1", "plan for the ranks you will start, e.g. -n 4")
    if ns.nodes is not None:  # the ranks' nodes, as torchrun numbers them: owners spread across nodes
        from subnetdp.core.plan import check_nodes

        cfg.masker.nodes = check_nodes(ns.nodes, world, "--nodes")
    if ns.memory:
        from subnetdp.plan.budget import budget_search, format_budget, parse_margin, parse_memory

        budgets, margin = parse_memory(ns.memory, world), parse_margin(ns.margin)
        result = {"memory": ns.memory, **budget_search(cfg, world, pm, budgets, margin)}
        report = result.get("report")
        if ns.json:
            print(json.dumps(result, indent=2))
            return 0
        if report is not None:
            print(format_report(report) + "\n")
        print(format_budget(result))
        return 0 if result.get("fits") else 1
    report = plan_report(cfg, world, pm, estimate=not ns.no_estimate)
    if ns.png:
        plan = MaskPlan.from_dict(report)
        plan_picture(plan.as_image(), [u["name"] for u in report["units"]], plan.owner_counts()).save(ns.png)
    print(json.dumps(report, indent=2) if ns.json else format_report(report))
    return 0


def cmd_plugins(ns: argparse.Namespace) -> int:
    from subnetdp.core.plugins import PluginManager, format_table

    pm = PluginManager()
    rows = pm.describe()
    if ns.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows, ["name", "kind", "package", "version", "plugin", "hooks"]))
        if pm.disabled:
            print(f"\ndisabled: {', '.join(pm.disabled)}")
        for problem in pm.broken.values():
            print(f"\nbroken: {problem.line}")
    return 0


def _version() -> str:
    # The package's own version (the one source pyproject reads), right even in an editable
    # install whose metadata was written before a version change.
    from subnetdp import __version__

    return __version__


def cmd_recipes(ns: argparse.Namespace) -> int:
    from subnetdp.core.config import config_root

    rows = [(path.stem, recipe_summary(path.read_text())) for path in sorted((config_root() / "recipes").glob("*.yaml"))]
    width = max(len(n) for n, _ in rows)
    for name, about in rows:
        lines = textwrap.wrap(about, max(40, 100 - width - 2)) or [""]
        print(f"{name:<{width}}  {lines[0]}")
        for line in lines[1:]:
            print(f"{'':<{width}}  {line}")
    print("\nrun one with: subnetdp train NAME [key=value ...]; see it resolved with --print-config")
    return 0


def recipe_summary(text: str) -> str:
    """A recipe's first sentence, from the comment paragraph at its top (whole, never cut mid-sentence)."""
    paragraph: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        words = line.lstrip("#").strip()
        if not words:
            if paragraph:
                break
            continue
        paragraph.append(words)
    joined = " ".join(paragraph)
    # A sentence ends at ". " followed by a capital letter or a digit (not "e.g. x" or "0.5 coverage").
    match = re.search(r"(?<=[.!?])\s+(?=[A-Z0-9])", joined)
    return joined[:match.start()] if match else joined


def cmd_prepare_text(ns: argparse.Namespace) -> int:
    from subnetdp.tools.prepare_text import prepare_text_command

    return prepare_text_command(ns)


def cmd_eval(ns: argparse.Namespace) -> int:
    if ns.tasks:
        return _eval_tasks(ns)
    from subnetdp.evaluate.export import evaluate_checkpoint

    loaded, metrics = evaluate_checkpoint(ns.path, data=ns.data)
    if ns.json:
        print(json.dumps({"checkpoint": str(loaded.path), "step": loaded.manifest["step"], "eval": metrics}))
    else:
        print(f"{loaded.path} (step {loaded.manifest['step']}): "
              + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return 0


def _eval_tasks(ns: argparse.Namespace) -> int:
    from subnetdp.evaluate.tasks import evaluate_checkpoint_tasks
    from subnetdp.train.downstream import scalars, table

    tasks = [t.strip() for t in ns.tasks.split(",") if t.strip()]
    limit = float(ns.limit) if ns.limit else None
    if limit is not None and limit >= 1:
        limit = int(limit)
    loaded, results, written = evaluate_checkpoint_tasks(
        ns.path, tasks, ns.include_path or [], limit, ns.num_fewshot, ns.batch_size, ns.device, ns.offline,
        data=ns.data)
    if ns.json:
        print(json.dumps({"checkpoint": str(loaded.path), "step": loaded.manifest["step"], "lm_eval": scalars(results),
                          "written": str(written)}))
    else:
        print(f"{loaded.path} (step {loaded.manifest['step']}), lm-eval:\n{table(results)}\nwrote {written}")
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    if ns.format == "hf":
        from subnetdp.evaluate.hf import export_hf

        out, files = export_hf(ns.checkpoint, ns.out, data=ns.data)
        print(f"wrote {', '.join(files)} to {out}; load with "
              f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})"
              + ("" if "tokenizer.json" in files else " (the run's tokenizer is unknown: no tokenizer files)"))
        return 0
    from subnetdp.evaluate.export import export

    out = export(ns.checkpoint, ns.out, recalibrate=not ns.no_recalibrate, data=ns.data)
    print(f"wrote {out / 'model.safetensors'} and {out / 'reference.json'}; rebuild with "
          f"subnetdp.evaluate.export.load_reference({str(out)!r})")
    return 0


_DATA_HELP = ("the data to evaluate (or recalibrate) on, replacing the checkpoint's data section, e.g. "
              "data.root=DIR; without it the checkpoint's data is used when reading it cannot run code")


def _add_checkpoint_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint's union model",
                       description="Evaluate the union model of a checkpoint, or of a run directory's newest "
                                   "checkpoint, in one process (BatchNorm recalibrated as in the run).")
    p.add_argument("path", metavar="RUN_DIR|CHECKPOINT")
    p.add_argument("data", nargs="*", metavar="data.KEY=VALUE", help=_DATA_HELP)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--tasks", default="", metavar="T1,T2",
                   help="run lm-evaluation-harness tasks (e.g. arc_easy,boolq,hellaswag,openbookqa,sciq) on the "
                        "union model instead; scores go to RUN_DIR/lm_eval/ and TensorBoard (needs subnetdp[eval])")
    p.add_argument("--include-path", action="append", metavar="DIR",
                   help="a folder of lm-eval task YAML files (your own tasks, local data); repeatable")
    p.add_argument("--limit", default=None, metavar="N", help="at most N documents per task (a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument("--offline", action="store_true",
                   help="never download task data: use the datasets cache and local files only")
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("export", help="export a checkpoint as the plain reference model or a Hugging Face model",
                       description="Write the union model as the reference architecture's plain state_dict "
                                   "(OUT/model.safetensors) and the options to rebuild it (OUT/reference.json); "
                                   "rebuild with subnetdp.evaluate.export.load_reference(OUT). With --format hf (LLaMA): "
                                   "a Hugging Face model directory (config.json, model.safetensors, tokenizer) "
                                   "that transformers' AutoModelForCausalLM.from_pretrained(OUT) loads.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint directory, or a run directory (newest)")
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("data", nargs="*", metavar="data.KEY=VALUE", help=_DATA_HELP)
    p.add_argument("--no-recalibrate", action="store_true",
                   help="keep the averaged BatchNorm statistics instead of recalibrating them")
    p.add_argument("--format", choices=("subnetdp", "hf"), default="subnetdp",
                   help="subnetdp: the reference architecture's state_dict (default); hf: Hugging Face "
                        "transformers model directory")
    p.set_defaults(func=cmd_export)


def _recipe_args(p: argparse.ArgumentParser) -> None:
    """The positional ``[RECIPE] [key=value ...]`` of train, launch and plan."""
    p.add_argument("args", nargs="*", metavar="[RECIPE] [key=value ...]",
                   help="a recipe file or built-in recipe name, then config overrides")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """The project's warnings as one ``subnetdp: warning:`` line, from one process only.

    A worker of ``launch.nproc=N`` stays silent about them (its launcher printed them in its own
    checks), and so do ranks other than 0 under torchrun, mpirun or srun. Other libraries'
    warnings keep Python's format.
    """
    import os

    from subnetdp.launchers.lifetime import PARENT_ENV

    if "subnetdp" not in str(filename):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
        return
    if os.environ.get(PARENT_ENV) or os.environ.get("RANK", "0") != "0":
        return
    print(f"subnetdp: warning: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="subnetdp", description="Subnetwork Data Parallelism for PyTorch.")
    parser.add_argument("--version", action="version", version=f"subnetdp {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("train", help="one training run",
                       description="Train with SDP. Under torchrun, rank and world size come from the "
                                   "environment; started plainly with launch.nproc=N (N > 1) it starts N "
                                   "local workers itself.")
    _recipe_args(p)
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (defaults, plugin files, recipe, overrides) and exit")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("launch", help="start a recipe under torchrun, mpirun or srun",
                       description="Start N workers of `subnetdp train RECIPE [key=value ...]` under a launcher, "
                                   "printing the exact command first. mpirun is the one beside this Python "
                                   "(the mpich wheel's), unless --mpirun names another.")
    p.add_argument("--launcher", choices=("torchrun", "mpirun", "srun"), default="torchrun")
    p.add_argument("--nproc", type=int, required=True, help="number of processes")
    p.add_argument("--mpirun", default=None, metavar="PATH", help="the mpirun to use (default: beside python)")
    p.add_argument("--launcher-args", default="", metavar="'ARGS'", help="extra launcher options as one string, written with '=': --launcher-args='--bind-to core'")
    p.add_argument("--dry-run", action="store_true", help="print the command without running it")
    from subnetdp.launchers.nodes import add_node_arguments

    add_node_arguments(p)
    _recipe_args(p)
    p.set_defaults(func=cmd_launch)
    p = sub.add_parser("plan", help="the mask plan, memory and bytes per rank, without training",
                       description="Show the mask plan of a config for N ranks: ranks x units table, owner "
                                   "counts, connectivity and spectral gap, parameters per rank, and the "
                                   "peak memory and bytes per step of one training step, estimated by a "
                                   "dry run under FakeTensorMode (nothing is allocated).")
    _recipe_args(p)
    p.add_argument("--world-size", "-n", type=int, default=None, help="number of ranks (default: launch.nproc)")
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="the ranks span N nodes (masker.nodes): owners are placed across nodes and the report "
                        "gives the node losses survived beside the rank losses")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--png", metavar="FILE", help="also write the ranks x units figure to FILE")
    p.add_argument("--no-estimate", action="store_true", help="skip the dry run (plan only)")
    p.add_argument("--memory", metavar="BUDGET", default=None,
                   help="find the largest coverage whose estimated peak fits BUDGET per rank (24GiB), or one budget "
                        "per rank (80GiB,80GiB,24GiB,24GiB: heterogeneous ranks, masker.capacity); says what "
                        "would fit when nothing does")
    p.add_argument("--margin", metavar="SHARE", default="0.1",  # budget.DEFAULT_MARGIN (not imported: --help stays quick)
                   help="share of each --memory budget kept back for what the estimate does not count (the CUDA "
                        "context, communicator buffers, fragmentation): 0.1 or 10%% (default 0.1)")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("recipes", help="list the built-in recipes",
                       description="List the built-in recipes (configs/recipes) with their first comment line; "
                                   "run one with `subnetdp train NAME`.")
    p.set_defaults(func=cmd_recipes)
    p = sub.add_parser("plugins", help="list installed plugins",
                       description="List every registered plugin: name, kind, package, version, hooks.")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plugins)
    from subnetdp.tools.prepare_text import add_prepare_text_arguments

    p = sub.add_parser("prepare-text", help="tokenise local text into token shards",
                       description="Tokenise .txt/.jsonl/.parquet files (or the Python standard library, or "
                                   "downloaded FineWeb) into FineWeb-layout token shards for data.name=tokens.")
    add_prepare_text_arguments(p)
    p.set_defaults(func=cmd_prepare_text)
    _add_checkpoint_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra and hasattr(ns, "args") and not any(a.startswith("-") for a in extra):
        ns.args = list(ns.args) + extra  # key=value overrides written after an option (plan ... -n 4 a=b)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    warnings.simplefilter("default", UserWarning)
    warnings.showwarning = _show_warning
    from subnetdp.train.stopping import Interrupted

    try:
        return int(ns.func(ns) or 0)
    except Interrupted as e:  # a signal stopped the run at a step boundary: one line, no traceback
        if e.message:
            print(f"subnetdp: {e.message}", file=sys.stderr, flush=True)
        return e.exit_code
    except PeerLost as e:  # the survivor's files are written: leave now, without waiting on the dead peer
        print(f"subnetdp: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)  # interpreter exit would wait on the failed collectives' work objects
    except SubnetdpError as e:
        print(f"subnetdp: error: {e}", file=sys.stderr, flush=True)
        return 2


_COLLECTOR_PAUSED = False  # by program(), for the imports of `subnetdp train`


def _collect_again() -> None:
    """`subnetdp train` has loaded torch and its plugins: what they made lives as long as the process,
    so it is frozen out of the cycle collector, which runs again from here (when program() paused it)."""
    global _COLLECTOR_PAUSED
    if _COLLECTOR_PAUSED:
        _COLLECTOR_PAUSED = False
        gc.freeze()
        gc.enable()


def whole_lines() -> None:
    """Each line of this process's console reaches it in one write. Unbuffered (``PYTHONUNBUFFERED``,
    ``-u``), ``print`` writes its text and its newline apart, and the lines of the workers and
    supervisors sharing one console interleave mid-line (measured: one survivor's line ran on into
    another's). Line-buffered, a line is one write, which a pipe keeps whole."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "write_through", False) and hasattr(stream, "reconfigure"):
            stream.reconfigure(write_through=False, line_buffering=True)


def program(argv: Sequence[str] | None = None) -> int:
    """The ``subnetdp`` program (and ``python -m subnetdp``): :func:`main`, in a process that ends with it.

    The cycle collector is kept off the objects of torch and the plugins, which live as long as the
    process: ``subnetdp train`` (every worker and launcher) imports them with the collector paused until
    its plugins are loaded (its collections during those imports cost 0.35-0.5 s of CPU per process and
    find no garbage), and when :func:`main` returns what is alive is frozen: the interpreter's shutdown
    otherwise walks it all in several full collections, 0.4 to 0.8 s of CPU more. The run's files are
    closed by then; objects still freed at shutdown are freed by their reference counts. Not in
    :func:`main`, which tests call in their own long-lived process.
    """
    global _COLLECTOR_PAUSED
    whole_lines()
    if list(sys.argv[1:] if argv is None else argv)[:1] == ["train"] and gc.isenabled():
        gc.disable()
        _COLLECTOR_PAUSED = True
    try:
        return main(argv)
    finally:
        _collect_again()  # a run stopped before its plugins were loaded
        gc.freeze()


if __name__ == "__main__":
    raise SystemExit(program())

"""Downstream evaluation of a language model with lm-evaluation-harness, in-process.

``subnetdp eval RUN_DIR --tasks arc_easy,boolq`` and ``eval.tasks`` during training both come here:
the union model is wrapped in :class:`SubnetdpLM`, a subclass of lm-eval's ``TemplateLM`` (itself an
``lm_eval.api.model.LM``), and handed to ``lm_eval.evaluator.evaluate`` as it is: no conversion, no
server. The model only has to map tokens ``(B, T)`` to next-token logits ``(B, T, V)``; the text is
encoded with the run's own tokenizer (``DataModule.tokenizer()``).

Task data: lm-eval's built-in tasks read Hugging Face data sets, downloaded on first use into the
``datasets`` cache (``HF_HOME``, ``HF_DATASETS_CACHE``). Offline (``--offline``, ``eval.offline``, or
``HF_HUB_OFFLINE=1``) only the cache and local files are used; a task whose data is missing then stops
with one line naming the task and its data set. A task of your own is a YAML file in lm-eval's task
format in a folder given with ``--include-path`` (``eval.include_path``); with ``dataset_path: json``
and ``dataset_kwargs: {data_files: ...}`` it reads local files. See docs/downstream.md.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from subnetdp.core.errors import ConfigError, SubnetdpError, suggest

INSTALL_HINT = "pip install 'subnetdp[eval]'"
DOWNLOAD_ERRORS = ("Couldn't reach", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectionError",
                   "Name or service not known", "doesn't exist on the Hub", "DatasetNotFoundError")


def check_config(cfg: Any, registries: dict[str, Any]) -> None:
    """``eval.tasks`` needs lm-eval and a dataset with a tokenizer (task names are checked by the
    loop's set-up, which loads them; the ranges of ``eval.task_*`` are declared with the fields)."""
    tasks = list(cfg.eval.tasks)
    if not tasks:
        return
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("eval.tasks", tasks, "needs lm-evaluation-harness, which is not installed",
                          "pip install 'subnetdp[eval]', or eval.tasks=[]")
    if not registries["data"].get(cfg.data.name).has_tokenizer():
        raise ConfigError("eval.tasks", tasks, f"data '{cfg.data.name}' has no tokenizer to turn task text into tokens",
                          "use a language-model dataset such as data.name=tokens, or eval.tasks=[]")


def require_lm_eval() -> None:
    """Raise a one-line error when lm-eval is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise SubnetdpError(f"downstream evaluation needs lm-evaluation-harness: {INSTALL_HINT}") from None


def set_offline(offline: bool) -> None:
    """Forbid downloads of task data (the Hugging Face hub and ``datasets`` read these flags)."""
    if not offline:
        return
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import sys

    # Flags already read at import time are updated in place.
    for module, attr in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                         ("datasets.config", "HF_DATASETS_OFFLINE")):
        if module in sys.modules:
            setattr(sys.modules[module], attr, True)


def _lm_class() -> type:
    from subnetdp.train.lm_eval_model import SubnetdpLM  # lm-eval is imported only when it is asked for

    return SubnetdpLM


def make_lm(model: torch.nn.Module, tokenizer: Any, device: torch.device | str, max_length: int,
            batch_size: int = 16) -> Any:
    """The union model behind lm-eval's model API (``lm_eval.api.model.LM``)."""
    require_lm_eval()
    return _lm_class()(model, tokenizer, torch.device(device), max_length, batch_size)


def task_manager(tasks: Sequence[str], include_path: str | Sequence[str] | None = None) -> Any:
    """An lm-eval ``TaskManager`` that knows ``tasks``; an unknown name is a one-line error.

    When every task is found in ``include_path`` the built-in index (thousands of YAML files, tens of
    seconds to scan) is skipped.
    """
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    paths = [include_path] if isinstance(include_path, str) else list(include_path or [])
    paths = [str(Path(p).expanduser()) for p in paths if p]
    for p in paths:
        if not Path(p).is_dir():
            raise SubnetdpError(f"--include-path / eval.include_path {p!r}: no such directory of task YAML files")
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=paths or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise SubnetdpError(f"unknown lm-eval task '{unknown[0]}' (--tasks / eval.tasks)"
                            + suggest(unknown[0], manager.all_tasks)
                            + "; `lm_eval ls tasks` lists them, and --include-path adds your own YAML tasks")
    return manager


def _dataset_of(manager: Any, name: str) -> str:
    entry = manager.task_index.get(name)
    cfg = (entry.cfg or {}) if entry is not None else {}
    path, sub = cfg.get("dataset_path"), cfg.get("dataset_name")
    return f"'{path}'" + (f" (config '{sub}')" if sub else "") if path else "its data set"


def load_tasks(manager: Any, tasks: Sequence[str]) -> dict[str, Any]:
    """Every task built with its data, one by one, so a missing download names its task."""
    merged: dict[str, Any] = {"tasks": {}, "groups": {}, "group_map": {}}
    for name in tasks:
        try:
            loaded = manager.load([name])
        except Exception as e:  # datasets and the hub raise many kinds for "not here, cannot fetch"
            text = f"{type(e).__name__}: {e}"
            if any(s in text for s in DOWNLOAD_ERRORS):
                raise SubnetdpError(
                    f"lm-eval task '{name}' needs a download: its data {_dataset_of(manager, name)} is not in the "
                    f"local datasets cache and cannot be fetched ({str(e).splitlines()[0][:160]}); download it "
                    "once where the network is reachable (docs/downstream.md), or point the task at local files "
                    "with a YAML in --include-path") from None
            raise SubnetdpError(f"lm-eval task '{name}' could not be loaded: {text.splitlines()[0][:300]}") from None
        for key in merged:
            merged[key].update(loaded[key])
    return merged


def run_tasks(lm: Any, loaded: dict[str, Any], limit: int | float | None = None,
              num_fewshot: int | None = None, seed: int = 1234, bootstrap_iters: int = 1000) -> dict[str, Any]:
    """lm-eval's ``evaluate`` over tasks from :func:`load_tasks`; returns its result dictionary
    (``results``, ``versions``, ``n-shot`` ...)."""
    from lm_eval.evaluator import evaluate

    for task in loaded["tasks"].values():
        # As lm-eval's simple_evaluate does: num_fewshot overrides, except where a task pins 0.
        default = task.get_config("num_fewshot")
        if num_fewshot is not None and default != 0:
            task.set_config(key="num_fewshot", value=int(num_fewshot))
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    started = time.time()
    results = evaluate(lm=lm, task_dict=loaded, limit=limit or None, bootstrap_iters=bootstrap_iters,
                       log_samples=False)
    results["config"] = {"model": "subnetdp union model", "limit": limit, "num_fewshot": num_fewshot,
                         "batch_size": getattr(lm, "batch_size", None), "device": str(getattr(lm, "_device", "")),
                         "seconds": time.time() - started}
    return results


def scalars(results: dict[str, Any]) -> dict[str, float]:
    """``{"<task>/<metric>": value}`` for every finite number in the results (filters kept apart)."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, _, filt = key.partition(",")
            name = f"{task}/{metric}" + (f"_{filt}" if filt and filt != "none" else "")
            if math.isfinite(float(value)):
                out[name] = float(value)
    return out


def table(results: dict[str, Any]) -> str:
    """The results as lm-eval prints them: one Markdown row per task, filter and metric.

    (Formatted here: lm-eval's ``make_table`` loses its column names with the ``pytablewriter`` that
    installs beside the pinned ``python-dateutil``.)
    """
    header = ["Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr"]
    rows = []
    higher = results.get("higher_is_better", {})
    for task, metrics in results.get("results", {}).items():
        first = True
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            arrow = {True: "↑", False: "↓"}.get(higher.get(task, {}).get(metric), " ")
            rows.append([metrics.get("alias", task) if first else "",
                         str(results.get("versions", {}).get(task, "")) if first else "", filt,
                         str(results.get("n-shot", {}).get(task, "")) if first else "", metric, arrow,
                         f"{value:.4f}", "±" if isinstance(stderr, (int, float)) else "",
                         f"{stderr:.4f}" if isinstance(stderr, (int, float)) else "N/A"])
            first = False
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    right = {1, 3, 6, 8}

    def line(cells: list[str]) -> str:
        return "|" + "|".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + "|"

    rule = "|" + "|".join(("-" * (w - 1) + ":") if i in right else "-" * w for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule] + [line(r) for r in rows])


def save_results(run_dir: Path, step: int, results: dict[str, Any]) -> Path:
    """``RUN_DIR/lm_eval/step_XXXXXXXX.json``: lm-eval's results of the evaluation after ``step``."""
    import json

    out = Path(run_dir) / "lm_eval" / f"step_{step:08d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    keep = {k: results[k] for k in ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples",
                                    "config") if k in results}
    out.write_text(json.dumps({"step": step, **keep}, indent=2, default=str), encoding="utf-8")
    return out


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SubnetdpError(f"--device {device}: CUDA is not available here; use --device cpu")
    return torch.device(device)

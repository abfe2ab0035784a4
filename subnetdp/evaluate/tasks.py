"""``subnetdp eval CHECKPOINT --tasks ...``: lm-evaluation-harness on a checkpoint's union model.

The union model comes from the checkpoint's files (:func:`~subnetdp.evaluate.export.load_union`), the
tokenizer from the run's data (:func:`~subnetdp.evaluate.hf.run_tokenizer`), and the harness glue is
the one the training loop uses for ``eval.tasks`` (:mod:`subnetdp.train.downstream`). The scores go
into the run directory and its TensorBoard, beside the in-run ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from subnetdp.core.errors import SubnetdpError
from subnetdp.core.plugins import PluginManager
from subnetdp.evaluate.export import load_union
from subnetdp.train.checkpoints import files as ck


def evaluate_checkpoint_tasks(path: str | Path, tasks: Sequence[str], include_path: Sequence[str] = (),
                              limit: float | None = None, num_fewshot: int | None = None, batch_size: int = 16,
                              device: str = "auto", offline: bool = False, pm: Any = None,
                              data: Sequence[str] = ()) -> tuple[Any, dict, Path]:
    """lm-eval on a checkpoint's union model; the scores go into its run directory and TensorBoard.

    ``data``: ``data.key=value`` overrides, as for :func:`~subnetdp.evaluate.export.evaluate_checkpoint`
    (the tokenizer is the data's).

    Everything that can be wrong (lm-eval missing, an unknown task, a task whose data needs a download,
    a model without a tokenizer) fails before the model is loaded.
    """
    from subnetdp.evaluate.hf import run_tokenizer
    from subnetdp.train.downstream import (load_tasks, make_lm, require_lm_eval, resolve_device, run_tasks,
                                           set_offline, task_manager)

    set_offline(offline)
    require_lm_eval()
    dev = resolve_device(device)
    manager = task_manager(tasks, include_path)
    loaded_tasks = load_tasks(manager, tasks)  # task data is checked before the model is loaded
    pm = pm or PluginManager()
    loaded = load_union(path, pm, data)
    tok = run_tokenizer(loaded, pm)
    if tok is None:
        raise SubnetdpError(f"data '{loaded.cfg.data.name}' does not say which tokenizer made its tokens "
                            "(DataModule.tokenizer()): lm-eval needs one to turn text into tokens")
    model = loaded.model.to(dev).eval()
    lm = make_lm(model, tok, dev, int(loaded.spec.seq_len) or 2048, batch_size)
    results = run_tasks(lm, loaded_tasks, limit, num_fewshot, seed=loaded.cfg.seed)
    ckpt = ck.resolve_checkpoint(Path(path))
    step = int(loaded.manifest["step"])
    written = write_results(ckpt.parent.parent, step, results)
    return loaded, results, written


def write_results(run_dir: Path, step: int, results: dict[str, Any]) -> Path:
    """``RUN_DIR/lm_eval/step_XXXXXXXX.json``, and ``lm_eval/<task>/<metric>`` scalars at ``step`` in the
    run's TensorBoard and ``metrics.jsonl`` (as a run's own in-run evaluation writes them)."""
    from subnetdp.train.downstream import save_results, scalars
    from subnetdp.train.runlog import RunLogger

    out = save_results(run_dir, step, results)
    values = {f"lm_eval/{k}": v for k, v in scalars(results).items()}
    log = RunLogger(Path(run_dir), 0, True)
    log.scalars(step, values)
    log.jsonl({"step": step, **values})
    log.close()
    return out

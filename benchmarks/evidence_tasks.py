"""The two tasks of the evidence study (``benchmarks/evidence.py``), importable by other benchmarks.

- ``llama8``: a LLaMA deep enough for block masking to mean something: 8 blocks, width 128, 4 heads
  (2 key/value heads), SwiGLU hidden 352, a 4,096-token byte-level BPE trained on the Python
  standard library's own source (``data.tokenizer=bpe``, no download), sequence 256, AdamW.
- ``resnet18``: torchvision ResNet-18 (CIFAR stem, 1 input channel) on scikit-learn's ``digits``
  resized to 32 x 32, SGD with momentum.

Each task is the built-in recipe plus the overrides below, run through ``subnetdp train`` with
``launch.nproc`` local gloo workers. Use::

    from benchmarks.evidence_tasks import TASKS
    task = TASKS["llama8"]
    cmd = task.command(["masker.coverage=0.5"], steps=task.steps)   # argv for subprocess

The per-rank batch and the step counts are sized for 2 CPU cores (``docs/evidence.md`` says how).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Task:
    """One study task: a recipe, its overrides and how its quality is read.

    Attributes:
        name: the task's name in tables and file names.
        recipe: the built-in recipe (``configs/recipes/<recipe>.yaml``).
        overrides: ``key=value`` overrides on top of the recipe (the task's definition).
        metric: the union model's eval metric reported as quality (``loss`` or ``accuracy``).
        higher_is_better: whether a larger ``metric`` is better.
        world_size: local gloo workers (``launch.nproc``).
        steps: DDP's number of iterations in the full study.
        quick_steps: the same in ``--quick``.
        eval_every: validation interval of the full study (the curves); FLOP-matched runs, which
            take more steps, validate proportionally less often per step, at the same compute.
        quick_eval_every: the same in ``--quick``.
    """

    name: str
    recipe: str
    overrides: tuple[str, ...]
    metric: str
    higher_is_better: bool
    world_size: int
    steps: int
    quick_steps: int
    eval_every: int
    quick_eval_every: int = 0
    description: str = ""
    data_cache: bool = False  # the data module takes data.cache_dir (the token corpus is built there once)
    coverages: tuple[float, ...] = field(default=(0.5,))

    def overrides_for(self, steps: int, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
        """The task's overrides, the step count and ``extra`` (later ones win). A run shorter than the
        task's warm-up (``--quick``) warms up over the whole run: a longer warm-up is refused."""
        warmup = [int(o.split("=", 1)[1]) for o in self.overrides if o.startswith("optim.warmup_steps=")]
        shorter = [f"optim.warmup_steps={steps}"] if warmup and warmup[-1] > steps else []
        return [*self.overrides, f"launch.nproc={self.world_size}", f"train.steps={steps}", *shorter, *extra]

    def command(self, extra: list[str] | tuple[str, ...] = (), steps: int | None = None) -> list[str]:
        """``argv`` of ``subnetdp train`` for this task (the console script beside this Python)."""
        exe = Path(sys.executable).parent / "subnetdp"
        return [str(exe), "train", self.recipe, *self.overrides_for(self.steps if steps is None else steps, extra)]


LLAMA8 = Task(
    name="llama8",
    recipe="llama_tiny_stdlib",
    overrides=("model.dim=128", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2",
               "model.hidden_dim=352", "data.tokenizer=bpe", "data.bpe_vocab_size=4096", "data.seq_len=256",
               "data.stdlib_max_mb=4.0", "train.batch_size=2", "optim.lr=3.0e-3", "optim.warmup_steps=10",
               "eval.batches=4", "eval.batch_size=16", "launch.threads_per_rank=1"),
    metric="loss", higher_is_better=False, data_cache=True, world_size=4, steps=80, quick_steps=8, eval_every=20, quick_eval_every=4,
    description="LLaMA, 8 blocks x width 128 (4 heads, 2 KV heads, SwiGLU 352), BPE 4,096 on the Python "
                "standard library, sequence 256, 4 workers x 2 sequences, AdamW 3e-3 cosine",
)

RESNET18 = Task(
    name="resnet18",
    recipe="resnet18_digits",
    overrides=("data.image_size=32", "train.batch_size=4", "optim.lr=0.02", "optim.warmup_steps=5",
               "eval.bn_recalibrate_batches=10", "eval.batch_size=120", "eval.batches=2", "launch.threads_per_rank=1"),
    metric="accuracy", higher_is_better=True, world_size=4, steps=30, quick_steps=6, eval_every=15, quick_eval_every=3,
    description="ResNet-18 (CIFAR stem) on digits at 32 x 32, 4 workers x 4 images, SGD 0.02 momentum 0.9 cosine",
)

TASKS: dict[str, Task] = {t.name: t for t in (LLAMA8, RESNET18)}

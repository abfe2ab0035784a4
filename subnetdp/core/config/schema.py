"""The run's config schema: OmegaConf structured dataclasses of the non-plugin sections, with each
field's doc, range and choices (``doc``), and the plugin groups' shared schemas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from subnetdp.core.contracts import CommConfig, DataConfig, MaskerConfig, ModelConfig
from subnetdp.core.fields import doc

PLUGIN_GROUPS = ("model", "masker", "comm", "data")
MAX_THREADS_PER_RANK = 1024  # launch.threads_per_rank: more cores than any one node gives a rank


@dataclass
class SyncConfig:
    """``sync.*``: owner-group buckets; ``mode=local_steps`` synchronises every ``every`` steps
    (docs/local_steps.md)."""

    bucket_cap_mb: float = doc('gradient bucket size (MiB) of the owner-group all-reduces', 25.0, lo=0.0, lo_open=True)
    max_groups: int = doc('most distinct owner sets before the synchroniser falls back to dense averaging', 64, lo=1)
    mode: str = doc('every_step or local_steps (owners average parameter deltas every sync.every steps, DiLoCo-style)', "every_step",
                    choices=("every_step", "local_steps"))
    every: int = doc('local_steps: inner steps per synchronisation (H)', 16, lo=1, fix="1 synchronises after every step")
    outer_lr: float = doc('local_steps: outer SGD learning rate (1 with momentum 0 = plain averaging, the default; DiLoCo: 0.7)', 1.0,
                          lo=0.0, lo_open=True, fix="1 with sync.outer_momentum=0 is plain averaging")
    outer_momentum: float = doc('local_steps: outer Nesterov momentum (DiLoCo: 0.9, for runs of many outer steps)', 0.0,
                                lo=0, hi=1, hi_open=True, fix="0 turns outer momentum off; DiLoCo uses 0.9")
    outer_on_host: bool = doc('local_steps: keep the outer state (anchor, momentum) in host memory', False)
    stop_every_step: bool = doc('local_steps: agree on a stop signal after every step (one world all-reduce a step) '
                                'instead of at synchronisations, where a stop waits up to sync.every - 1 steps', False)
    warmup_steps: int = doc('local_steps: steps synchronised after every step before local steps begin (DiLoCo '
                            'warm-starts from a per-step-trained model); a multiple of sync.every', 0, lo=0,
                            fix="0 starts local steps at the first step")


@dataclass
class OptimConfig:
    name: str = doc('torch.optim by name: sgd, adamw, adam', "sgd", choices=("sgd", "adamw", "adam"))
    # 0 would train nothing: a run that cannot learn is a typo, not a setting.
    lr: float = doc('peak learning rate', 0.1, lo=0.0, lo_open=True, fix="use e.g. 0.1 for SGD or 1e-3 for AdamW")
    momentum: float = doc('SGD momentum', 0.9, lo=0.0, hi=1.0, fix="0 turns momentum off; 0.9 is usual")
    nesterov: bool = doc('SGD Nesterov momentum', False)
    betas: list[float] = doc('Adam/AdamW betas (two numbers in [0, 1))', factory=lambda: [0.9, 0.999])
    eps: float = doc('Adam/AdamW epsilon', 1e-8, lo=0.0, lo_open=True, fix="1e-8 is usual")
    # At most 1: a coefficient above it outweighs any gradient (SGD's L2 term) or shrinks the weights
    # by more than lr per step (AdamW's decoupled decay); published recipes use 1e-4 to 0.1.
    weight_decay: float = doc('weight decay (at most 1)', 5e-4, lo=0.0, hi=1.0,
                              fix="0 turns weight decay off; 5e-4 (SGD) or 0.1 (AdamW) is usual")
    schedule: str = doc('cosine or constant, after linear warm-up', "cosine", choices=("cosine", "constant"))
    warmup_steps: int = doc('linear warm-up steps (at most train.steps)', 0, lo=0, fix="0 starts at the full learning rate")
    clip_grad_norm: float = doc("clip the averaged gradient's global norm to this (0 = off)", 0.0, lo=0.0,
                                fix="0 turns clipping off")


@dataclass
class TrainConfig:
    steps: int = doc('optimizer steps', 100, lo=1)
    flop_matched: bool = doc("train round(train.steps / r) steps instead, r = the plan's training FLOPs per step "
                             "over the full model's (subnetdp plan shows both): the compute of train.steps "
                             "full-model steps, the schedule stretched to span them", False)
    batch_size: int = doc('batch size per rank (per micro-batch)', 32, lo=1)
    grad_accum: int = doc('micro-batches per optimizer step', 1, lo=1)
    precision: str = doc("fp32 or bf16 (autocast; FSDP2's MixedPrecisionPolicy when sharded)", "fp32",
                         choices=("fp32", "bf16"))
    activation_checkpointing: int = doc('k: recompute every k-th materialised block in backward; 0 = off', 0, lo=0,
                                        fix="0 turns it off, 1 checkpoints every block")
    compile: bool = doc('torch.compile each materialised block', False)
    compile_backend: str = doc('inductor, aot_eager or eager', "inductor", choices=("inductor", "aot_eager", "eager"))
    device: str = doc('auto, cpu or cuda (cuda needs comm.name=nccl)', "auto", choices=("auto", "cpu", "cuda"))
    log_every: int = doc('steps between log lines (and world-mean losses)', 10, lo=1)
    # Steps count from 1; one past train.steps measures the last step.
    memory_step: int = doc("the step whose tensor memory (and FSDP's bytes) is measured (steps count from 1; "
                           "beyond train.steps: the last; a world re-formed in-process counts from its first)", 2, lo=1, fix="2 is the default (the first step warms up)")
    progress: Optional[bool] = doc("progress bar on rank 0: true, false, or null (the default): only when its output "
                                   "is a terminal (a pipe, a file or a batch job gets plain log lines); log lines "
                                   "are printed either way", None)
    on_nonfinite: str = doc('stop or skip: what an inf/NaN loss or gradient does', "stop", choices=("stop", "skip"))
    grad_alignment_every: int = doc("every N steps: cosine of SDP's averaged gradient with the full-batch DDP gradient (0 = off)", 0,
                                    lo=0, fix="0 turns the probe off")


@dataclass
class EvalConfig:
    every: int = doc('steps between union-model evaluations (0 = at the end only)', 0, lo=0,
                     fix="0 evaluates only at the end")
    batches: int = doc('evaluation batches (0 = the whole held-out split)', 0, lo=0,
                       fix="0 evaluates the whole held-out split")
    batch_size: int = doc('evaluation batch size', 256, lo=1, fix="256 is the default")
    bn_recalibrate_batches: int = doc('training batches that recalibrate BatchNorm statistics of the union model', 20,
                                      lo=0, fix="0 keeps the averaged statistics")
    # Downstream tasks of lm-evaluation-harness on the union model at every evaluation (language
    # models; needs subnetdp[eval]); see docs/downstream.md.
    tasks: list[str] = doc('lm-evaluation-harness tasks run on the union model at every evaluation (language models; subnetdp[eval])', factory=list)
    include_path: str = doc('a folder of lm-eval task YAML files (your own tasks, local data)', "")
    task_limit: float = doc('at most this many documents per task (a fraction if < 1; 0 = all)', 0.0, lo=0.0,
                            fix="0 evaluates every document")
    num_fewshot: Optional[int] = doc("few-shot examples per task (empty: each task's own)", None, lo=0,
                                     fix="0 asks for none; leave it empty for each task's own")
    task_batch_size: int = doc('batch size of the lm-eval requests', 16, lo=1)
    offline: bool = doc('never download task data: the datasets cache and local files only', False)
    block_union: str = doc('block-level forward masking: the union evaluated with each residual branch x its training keep rate k(u)/W (rescaled) or as it is (x1), and a re-plan that raises a rate scales the branch by old/new rate or not; docs/evidence.md', "rescaled",
                           choices=("rescaled", "x1"))
    breakdown: bool = doc("at the last step also evaluate the union at x1 and rescaled and every rank's own subnetwork (summary.json eval_union)", False)


@dataclass
class LaunchConfig:
    nproc: int = doc('local workers started by subnetdp train', 1, lo=1)
    # A fixed cap, not the cores of the machine that composes (a login node for srun): more than any
    # node has cores for one rank, so above it the number is a typo.
    threads_per_rank: int = doc(f'torch threads per rank (0 = the cores shared evenly; at most {MAX_THREADS_PER_RANK})', 0,
                                lo=0, hi=MAX_THREADS_PER_RANK, fix="0 shares the cores evenly among the local ranks")
    nodes: int = doc('nodes of a subnetdp launch job, launch.nproc workers each (the largest number of an elastic job)', 1,
                     lo=1, fix="1 runs on this node alone")
    min_nodes: int = doc('fewest nodes an elastic job goes on with (0 = launch.nodes: not elastic; needs resume=auto)', 0,
                         lo=0, fix="0 makes the job fixed at launch.nodes")
    max_restarts: int = doc("restarts of the worker group after a failure or a lost node (torchrun, subnetdp launch, launch.nproc=N; needs resume=auto)", 0,
                            lo=0, fix="0 ends the job at the first failure")
    on_failure: str = doc("subnetdp train launch.nproc=N: after a worker dies, restart the workers (torch's elastic agent) or "
                          "continue: the workers run under subnetdp's supervisor, which restarts nobody, and the survivors "
                          "go on in-process at the smaller world (docs/inprocess.md)", "restart", choices=("restart", "continue"))
    replace: int = doc("launch.on_failure=continue: dead workers the supervisor replaces by a fresh worker, which joins the "
                       "survivors at a step boundary and is healed from its units' owners over the network: the world grows "
                       "back to launch.nproc (docs/inprocess.md)", 0, lo=0, fix="0 replaces nobody: the survivors go on at the smaller world")
    node_rank: int = doc("subnetdp train launch.nodes=N launch.on_failure=continue: this node's place, 0 on the node of "
                         "launch.rdzv_endpoint (its supervisor hosts the job's store), 1..N-1 on the others", 0, lo=0,
                         fix="0 on the node of launch.rdzv_endpoint, 1..launch.nodes-1 on the others")
    rdzv_endpoint: str = doc("HOST:PORT where the nodes' torchrun agents (or, with launch.on_failure=continue, subnetdp's "
                             "supervisors) meet: a free port on the node started first", "")
    rdzv_id: str = doc("the job's rendezvous id, the same on every node (empty: subnetdp-RUN.NAME)", "")
    rdzv_conf: str = doc("torchrun's --rdzv-conf, e.g. last_call_timeout=30,join_timeout=600", "")
    # SLURM and Kubernetes wait 30 s between SIGTERM and SIGKILL by default; a checkpoint of a large
    # model can take longer, hence a longer default here (the launcher says what it waits for).
    stop_timeout_s: float = doc('after SIGINT/SIGTERM, seconds the local workers get to finish their step and checkpoint '
                                'before the launcher kills them', 120.0, lo=1.0, hi=86400.0,
                                fix="120 is the default")


@dataclass
class RunDirConfig:
    dir: str = doc('where run directories go', "runs", writes=True)
    name: str = doc("the run directory's name: one folder name of printable characters (empty: made on rank 0 "
                    "with a timestamp)", "")
    tensorboard: bool = doc('write TensorBoard events', True)
    overwrite: bool = doc('delete what run.dir/run.name holds before a new run starts there (resume=never); '
                          'without it such a run is refused', False, writes=True)


@dataclass
class CheckpointConfig:
    """``checkpoint.*``: see docs/checkpoints.md."""

    enabled: bool = doc('write checkpoints (docs/checkpoints.md)', True)
    every: int = doc('steps between checkpoints (0 = only at the end)', 0, lo=0, fix="0 saves only at the end")
    keep: int = doc('newest complete checkpoints kept (0 = all)', 2, lo=0, fix="0 keeps every checkpoint")
    final: str = doc('auto, always or never: the checkpoint after the last step (auto: when checkpoint.every > 0, resume is not never, or train.steps >= 1000)', "auto",
                     choices=("auto", "always", "never"),
                     fix="auto writes the final checkpoint for long or resumable runs (docs/checkpoints.md)")
    survivors: bool = doc("when a peer dies, every survivor writes its units as of its last finished step, so a "
                          "restart with resume=auto loses no finished step (docs/checkpoints.md)", True)


@dataclass
class RecoveryConfig:
    """``recovery.*``: see docs/verify.md."""

    # 100: hashing a rank's units costs about one pass over its parameters and optimizer state on the
    # host (docs/verify.md measures under 1% of step time at 100); every checkpoint is verified as well.
    verify_every: int = doc('steps between checks that the owners of every unit hold bit-identical values and optimizer '
                            'state (and before every checkpoint); 0 = never (docs/verify.md)', 100, lo=0,
                            fix="0 turns the owners' verification off")


@dataclass
class FSDPConfig:
    """``fsdp.*``: FSDP2 sharding inside each replica (docs/fsdp.md)."""

    shard_size: int = doc(
        'S: ranks that hold one subnetwork shard it with FSDP2 (world = replicas x S); 1 = no FSDP',
        1, lo=1, fix="1 turns FSDP off")
    reshard_after_forward: bool = doc('ZeRO-3; false keeps the gathered block until backward (ZeRO-2)', True)
    reduce_each_micro_batch: bool = doc(
        'with train.grad_accum > 1; false: one reduce-scatter per step, more memory',
        True)


@dataclass
class RunConfig:
    """The non-plugin sections. Plugin groups (``model``, ``masker``, ``comm``, ``data``) are
    mounted from the selected plugin's ``Config`` at composition time."""

    seed: int = doc('every random choice derives from it (model init, data order, plans)', 0)
    sync: SyncConfig = field(default_factory=SyncConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    run: RunDirConfig = field(default_factory=RunDirConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    resume: str = doc('never, auto (newest checkpoint of run.dir/run.name) or a checkpoint PATH', "never")


SHARED_PLUGIN_SCHEMAS = {"model": ModelConfig, "masker": MaskerConfig, "comm": CommConfig, "data": DataConfig}


_SECTIONS = {c.__name__: c for c in (SyncConfig, OptimConfig, TrainConfig, EvalConfig, LaunchConfig, RunDirConfig,
                                     CheckpointConfig, FSDPConfig, RecoveryConfig)}

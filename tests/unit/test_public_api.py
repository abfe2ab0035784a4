"""The public surface is frozen: ``import subnetdp`` (what a plugin author uses) and the CLI's commands.

A change to either must be deliberate: update ``FROZEN_API`` / ``FROZEN_CLI`` below in the same
commit, and say why. ``python -m tests.unit.test_public_api`` prints the current surface.
"""

from __future__ import annotations

import argparse
import inspect
import json

import subnetdp
from subnetdp.cli import build_parser


def api_surface() -> dict[str, list[str]]:
    """Each public name: for a class, its public methods and properties with their signatures."""
    out: dict[str, list[str]] = {}
    for name in sorted(subnetdp.__all__):
        obj = getattr(subnetdp, name)
        if inspect.isclass(obj):
            members = []
            for attr, value in sorted(vars(obj).items()):
                if attr.startswith("_") and attr != "__init__":
                    continue
                fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
                if isinstance(value, property):
                    members.append(f"{attr}: property")
                elif inspect.isfunction(fn):
                    members.append(f"{attr}{inspect.signature(fn)}")
            out[name] = members
        elif callable(obj):
            out[name] = [f"{name}{inspect.signature(obj)}"]
        else:
            out[name] = [type(obj).__name__]
    return out


def cli_surface() -> dict[str, list[str]]:
    """Each command: its positional arguments and option strings."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for command, p in sorted(sub.choices.items()):
        args = []
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            args.append("/".join(a.option_strings) if a.option_strings else f"<{a.metavar or a.dest}>")
        out[command] = sorted(args)
    return out


FROZEN_API: dict[str, list[str]] = {
    'CheckpointError': [
    ],
    'CommConfig': [
        "__init__(self, name: 'str' = '???', init_method: 'str' = 'env://', timeout_s: 'float' = 600.0) -> None",
    ],
    'Communicator': [
        "__init__(self, cfg: 'Any', env: 'LaunchEnv') -> 'None'",
        "all_gather_object(self, obj: 'Any') -> 'list[Any]'",
        'all_reduce(self, tensor: "\'torch.Tensor\'", group: \'Sequence[int]\', async_op: \'bool\' = False) -> \'Handle\'',
        "barrier(self) -> 'None'",
        'broadcast(self, tensor: "\'torch.Tensor\'", src: \'int\', group: \'Sequence[int] | None\' = None) -> \'None\'',
        "check_environment(self) -> 'None'",
        "check_launcher(cls, launcher: 'str', nproc: 'int') -> 'None'",
        "check_machine(cls, name: 'str') -> 'None'",
        "check_world_size(cls, world_size: 'int') -> 'None'",
        'device: property',
        "device_type(cls, cfg: 'Any') -> 'str'",
        "init(self) -> 'None'",
        'local_rank: property',
        "new_group(self, ranks: 'Sequence[int]') -> 'None'",
        'rank: property',
        "shutdown(self) -> 'None'",
        'world: property',
        'world_size: property',
    ],
    'ConfigError': [
        "__init__(self, key: 'str', value: 'object', problem: 'str', fix: 'str' = '') -> 'None'",
    ],
    'DataConfig': [
        "__init__(self, name: 'str' = '???', root: 'str' = '', image_size: 'int' = 0) -> None",
    ],
    'DataModule': [
        "__init__(self, cfg: 'Any', seed: 'int' = 0) -> 'None'",
        "check(self) -> 'None'",
        "eval_loader(self, batch_size: 'int') -> 'Iterable[Any]'",
        'example_batch(self, spec: \'DataSpec\', batch_size: \'int\') -> "tuple[\'torch.Tensor\', \'torch.Tensor\']"',
        "has_tokenizer(cls) -> 'bool'",
        "planning_spec(self) -> 'tuple[DataSpec, str]'",
        "spec(self) -> 'DataSpec'",
        "tokenizer(self) -> 'Any'",
        'train_loader(self, rank: \'int\', world_size: \'int\', batch_size: \'int\') -> "\'ResumableLoader\'"',
        "unsafe_to_open(cls, cfg: 'Any') -> 'str | None'",
    ],
    'DataSpec': [
        "__init__(self, in_channels: 'int' = 0, image_size: 'int' = 0, num_classes: 'int' = 0, vocab_size: 'int' = 0, seq_len: 'int' = 0) -> None",
    ],
    'DoneHandle': [
        "wait(self) -> 'None'",
    ],
    'GROUP_BY': [
        'tuple',
    ],
    'Handle': [
        "wait(self) -> 'None'",
    ],
    'HiddenSite': [
        '__init__(self, module: "\'nn.Module\'", dim: \'int\', where: \'str\' = \'input\') -> None',
    ],
    'LaunchEnv': [
        "__init__(self, rank: 'int' = 0, world_size: 'int' = 1, local_rank: 'int' = 0, local_world_size: 'int' = 1, launcher: 'str' = 'none') -> None",
    ],
    'MaskPlan': [
        "__init__(self, world_size: 'int', owned: 'list[list[int]]', num_units: 'int', nodes: 'int' = 1, node_of: 'tuple[int, ...]' = ()) -> None",
        "as_image(self) -> 'np.ndarray'",
        "cost_per_rank(self, partition: 'Partition') -> 'list[float]'",
        "digest(self) -> 'str'",
        "effective_coverage(self, partition: 'Partition', group_by: 'str' = 'auto') -> 'dict[str, list[float]]'",
        "failures_survived(self) -> 'int'",
        'from_dict(cls, d: \'dict\') -> "\'MaskPlan\'"',
        "k(self, unit: 'int') -> 'int'",
        "mixing_matrix(self, partition: 'Partition') -> 'np.ndarray'",
        "node_failures_survived(self, nodes: 'int | None' = None) -> 'int'",
        "owner_counts(self) -> 'list[int]'",
        "owner_sets(self) -> 'list[tuple[int, ...]]'",
        "owners(self, unit: 'int') -> 'tuple[int, ...]'",
        "params_per_rank(self, partition: 'Partition') -> 'list[int]'",
        "rank_nodes(self) -> 'tuple[int, ...]'",
        'replicas(self, shard_size: \'int\') -> "\'MaskPlan\'"',
        'replicated(self, shard_size: \'int\') -> "\'MaskPlan\'"',
        "spectral_gap(self, partition: 'Partition') -> 'float'",
        "to_dict(self, partition: 'Partition | None' = None, group_by: 'str' = 'auto') -> 'dict'",
        "to_json(self, partition: 'Partition | None' = None) -> 'str'",
        "unit_graph_components(self) -> 'int'",
        "validate(self, min_owners: 'int' = 1, names: 'Sequence[str] | None' = None, hint: 'Callable[[], str] | None' = None) -> 'None'",
        "warn_coverage(self, partition: 'Partition', requested: 'float', group_by: 'str' = 'auto', tol: 'float' = 0.05) -> 'list[str]'",
        'without(self, members: \'Sequence[int]\', min_owners: \'int\' = 1) -> "\'MaskPlan\'"',
    ],
    'Masker': [
        'plan(self, partition: \'Partition\', world_size: \'int\', seed: \'int\') -> "\'MaskPlan\'"',
    ],
    'MaskerConfig': [
        "__init__(self, name: 'str' = '???', granularity: 'str' = 'block', regime: 'str' = 'forward', coverage: 'float' = 0.5, min_owners: 'int' = 1, group_by: 'str' = 'auto', rescale: 'Optional[bool]' = None, units_per_layer: 'int' = 8, refresh_every: 'int' = 1, resample_every: 'int' = 0, capacity: 'list' = <factory>, nodes: 'Optional[int]' = None) -> None",
    ],
    'ModelAdapter': [
        'blocks(self, submodel: "\'nn.Module\'") -> "list[\'nn.Module\']"',
        'branch_output_layers(self, model: "\'nn.Module\'") -> "dict[str, list[\'nn.Module\']]"',
        'build(self, spec: \'DataSpec\') -> "\'nn.Module\'"',
        # A member of a world grown back at a join drops the units it gained in place (optional: None builds anew).
        'drop_units(self, submodel: "\'nn.Module\'", owned: \'Sequence[int]\', partition: \'Partition\') -> \'Optional[ParamMap]\'',
        "has_hf_export(cls) -> 'bool'",
        'hf_export(self, model: "\'nn.Module\'", options: \'dict[str, Any]\', bos: \'Optional[int]\' = None, eos: \'Optional[int]\' = None) -> "tuple[dict[str, Any], dict[str, \'torch.Tensor\']]"',
        'hidden_sites(self, model: "\'nn.Module\'") -> \'list[HiddenSite]\'',
        'init_module(self, name: \'str\', module: "\'nn.Module\'") -> \'None\'',
        "inputs(self, batch: 'Any') -> 'Any'",
        'loss(self, output: \'Any\', batch: \'Any\') -> "\'torch.Tensor\'"',
        'materialize(self, model: "\'nn.Module\'", owned: \'Sequence[int]\', partition: \'Partition\') -> "tuple[\'nn.Module\', ParamMap]"',
        "metrics(self, outputs: 'Sequence[Any]', batches: 'Sequence[Any]') -> 'dict[str, float]'",
        'partition(self, model: "\'nn.Module\'", granularity: \'str\', spec: \'DataSpec\') -> \'Partition\'',
        'reference_model(options: \'dict[str, Any]\') -> "\'nn.Module\'"',
        "reference_options(self, spec: 'DataSpec') -> 'Optional[dict[str, Any]]'",
        'reference_state_dict(self, model: "\'nn.Module\'") -> "dict[str, \'torch.Tensor\']"',
        'residual_branches(self, model: "\'nn.Module\'") -> "dict[str, list[\'nn.Module\']]"',
        'training_loss(self, model: "\'nn.Module\'", batch: \'Any\') -> "\'torch.Tensor\'"',
    ],
    'ModelConfig': [
        "__init__(self, name: 'str' = '???', variant: 'str' = '', stochastic_depth: 'float' = 0.0, hidden_dropout: 'float' = 0.0) -> None",
    ],
    'NonFiniteError': [
    ],
    'ParamMap': [
        "__init__(self, pieces: 'dict[str, list[Piece]]', unit_of: 'dict[str, int | None]') -> None",
        "global_names(self) -> 'list[str]'",
        'identity(cls, names: \'Iterable[str]\', unit_of: \'dict[str, int | None]\') -> "\'ParamMap\'"',
    ],
    'NullCommunicator': [
        "all_gather_object(self, obj: 'Any') -> 'list[Any]'",
        'all_reduce(self, tensor: "\'torch.Tensor\'", group: \'Sequence[int]\', async_op: \'bool\' = False) -> \'Handle\'',
        "barrier(self) -> 'None'",
        'broadcast(self, tensor: "\'torch.Tensor\'", src: \'int\', group: \'Sequence[int] | None\' = None) -> \'None\'',
        'device: property',
        "init(self) -> 'None'",
        "new_group(self, ranks: 'Sequence[int]') -> 'None'",
    ],
    'Partition': [
        '__init__(self, granularity: \'str\', units: \'list[Unit]\', shared: \'list[str]\', shared_buffers: \'list[str]\' = <factory>, shapes: \'dict[str, tuple[int, ...]]\' = <factory>, dtypes: "dict[str, \'torch.dtype\']" = <factory>) -> None',
        "groups(self) -> 'dict[str, list[Unit]]'",
        "shared_numel(self) -> 'int'",
        'tensor_info(model: "\'nn.Module\'") -> "tuple[dict[str, tuple[int, ...]], dict[str, \'torch.dtype\']]"',
        "unit_numel(self, unit: 'Unit') -> 'int'",
    ],
    'PeerLost': [
        "__init__(self, message: 'str', lost: 'Iterable[int]' = ()) -> 'None'",
    ],
    'Piece': [
        "__init__(self, global_name: 'str', dim: 'int | None' = None, global_start: 'int' = 0, global_stop: 'int' = 0, local_start: 'int' = 0, local_stop: 'int' = 0) -> None",
    ],
    'PlanError': [
    ],
    'RankMismatchError': [
    ],
    'Registry': [
        "__init__(self, kind: 'str') -> 'None'",
        "add(self, name: 'str', cls: 'type') -> 'None'",
        "create(self, name: 'str', *args: 'Any', **kwargs: 'Any') -> 'Any'",
        "get(self, name: 'str', key: 'str | None' = None) -> 'type'",
        "names(self) -> 'list[str]'",
    ],
    'ResumableLoader': [
        "load_state_dict(self, state: 'dict[str, int]') -> 'None'",
        "state_dict(self) -> 'dict[str, int]'",
    ],
    'RunContext': [
        '__init__(self, cfg: "\'DictConfig\'", env: \'LaunchEnv\', comm: \'Communicator\', plugins: \'Any\', adapter: \'ModelAdapter\', data: \'DataModule\', spec: \'DataSpec\', run_dir: \'Path\', lock: \'Any\' = None, tasks: \'Any\' = None, flop_match: \'Optional[dict]\' = None, step_flops: \'Optional[float]\' = None) -> None',
        'rank: property',
        'run_name: property',
        'steps: property',
        'world_size: property',
    ],
    'RunResult': [
        "__init__(self, summary: 'dict[str, Any]', eval_metrics: 'dict[str, float]' = <factory>, eval_union: 'dict[str, Any]' = <factory>, alignment: 'list[dict[str, float]]' = <factory>, step: 'int' = 0) -> None",
    ],
    'SubnetdpError': [
    ],
    'TensorSlice': [
        "__init__(self, name: 'str', dim: 'int | None' = None, start: 'int' = 0, stop: 'int' = 0) -> None",
    ],
    'TrainStateView': [
        'model: property',
        'optimizer: property',
        'partition: property',
        'plan: property',
        'pmap: property',
        'scheduler: property',
        'step: property',
    ],
    'Unit': [
        "__init__(self, id: 'int', name: 'str', group: 'str', cost: 'float', slices: 'tuple[TensorSlice, ...]', buffers: 'tuple[TensorSlice, ...]' = ()) -> None",
    ],
    'doc': [
        "doc(text: 'str', default: 'Any' = MISSING, *, factory: 'Any' = MISSING, lo: 'float | None' = None, hi: 'float | None' = None, lo_open: 'bool' = False, hi_open: 'bool' = False, choices: 'Sequence[str]' = (), fix: 'str' = '', writes: 'bool' = False) -> 'Any'",
    ],
    'group_units': [
        "group_units(partition: 'Partition', group_by: 'str' = 'auto') -> 'dict[str, list[int]]'",
    ],
    'hookimpl': [
        "hookimpl(function: '_F | None' = None, hookwrapper: 'bool' = False, optionalhook: 'bool' = False, tryfirst: 'bool' = False, trylast: 'bool' = False, specname: 'str | None' = None, wrapper: 'bool' = False) -> '_F | Callable[[_F], _F]'",
    ],
    'plain_name_problem': [
        "plain_name_problem(name: 'Any') -> 'str | None'",
    ],
    'rank_coverages': [
        "rank_coverages(mcfg: 'Any', world_size: 'int') -> 'list[float]'",
    ],
    'suggest': [
        "suggest(name: 'str', choices: 'Iterable[str]') -> 'str'",
    ],
    'units_kept': [
        "units_kept(coverage: 'float', k: 'int') -> 'int'",
    ],
}
FROZEN_CLI: dict[str, list[str]] = {
    'eval': [
        '--batch-size',
        '--device',
        '--include-path',
        '--json',
        '--limit',
        '--num-fewshot',
        '--offline',
        '--tasks',
        '<RUN_DIR|CHECKPOINT>',
        '<data.KEY=VALUE>',
    ],
    'export': [
        '--format',
        '--no-recalibrate',
        '<CHECKPOINT>',
        '<OUT>',
        '<data.KEY=VALUE>',
    ],
    'launch': [
        '--dry-run',
        '--launcher',
        '--launcher-args',
        '--max-restarts',
        '--mpirun',
        '--nnodes',
        '--node-rank',
        '--nproc',
        '--rdzv-conf',
        '--rdzv-endpoint',
        '--rdzv-id',
        '<[RECIPE] [key=value ...]>',
    ],
    'plan': [
        '--json',
        '--margin',
        '--memory',
        '--no-estimate',
        '--nodes',
        '--png',
        '--world-size/-n',
        '<[RECIPE] [key=value ...]>',
    ],
    'plugins': [
        '--json',
    ],
    'prepare-text': [
        '--bpe-train-mb',
        '--fineweb',
        '--max-mb',
        '--name',
        '--out',
        '--shard-tokens',
        '--stdlib',
        '--text-field',
        '--tokenizer',
        '--tokenizer-file',
        '--val-fraction',
        '--vocab-size',
        '<FILE_OR_DIR>',
    ],
    'recipes': [
    ],
    'train': [
        '--print-config',
        '<[RECIPE] [key=value ...]>',
    ],
}


def test_the_public_api_is_the_frozen_one():
    assert api_surface() == FROZEN_API


def test_the_cli_is_the_frozen_one():
    assert cli_surface() == FROZEN_CLI


def test_the_plugin_template_imports_only_the_public_api():
    import ast
    from pathlib import Path

    template = Path(__file__).parents[2] / "examples" / "plugin-template" / "src"
    files = sorted(template.rglob("*.py"))
    assert files
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("subnetdp."):
                raise AssertionError(f"{f.name} imports {node.module}: the template uses `from subnetdp import ...`")
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("subnetdp.") for a in node.names), f.name


if __name__ == "__main__":
    print(json.dumps({"api": api_surface(), "cli": cli_surface()}, indent=1))

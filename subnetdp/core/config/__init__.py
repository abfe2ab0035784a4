"""Configuration: OmegaConf structured schemas, composition and validation with clear errors.

One concept a module: :mod:`.schema` (the run's sections), :mod:`.composition` (layers, overrides,
merging), :mod:`.checks` (what a composed config must satisfy), :mod:`.docs` (the key table).
Everything the former single module held is importable from here as before.
"""

from subnetdp.core.config.schema import (  # noqa: F401
    PLUGIN_GROUPS, MAX_THREADS_PER_RANK, SyncConfig, OptimConfig, TrainConfig, EvalConfig, LaunchConfig,
    RunDirConfig, CheckpointConfig, FSDPConfig, RecoveryConfig, RunConfig, SHARED_PLUGIN_SCHEMAS, _SECTIONS,
)
from subnetdp.core.config.checks import (  # noqa: F401
    _shown, _check_declared, validate, check_ignored, _check_regularizers, NAME_MAX, _check_run_name,
    check_world, INT64_MAX, FLOAT32_MAX, leaves, check_numbers, check_data_fits_model, MAX_IMAGE_SIDE,
    check_image_size, warn_threads,
)
from subnetdp.core.config.composition import (  # noqa: F401
    config_root, resolve_recipe, first_lines, clipped, _load_yaml, parse_overrides, delete_keys, _resolve,
    _check_keys, _check_leaf, _merge, compose, _selector, check_sections, to_yaml, digest, default_run_name,
    env_flag,
)
from subnetdp.core.config.docs import (  # noqa: F401
    documented_keys, declared_keys, key_table,
)
from subnetdp.core.config.settings import Settings  # noqa: F401,E402

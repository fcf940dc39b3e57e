"""The run's configuration: the typed schema Hydra fills (``schema``), the checks types cannot express
(``checks``), what Hydra needs registered (``registration``) and the per-key ``--help`` (``help``). Everything a
caller needs is importable from ``composer3d.config``."""

from composer3d.config.checks import (
    pipeline_microbatches,
    resolve_degrees,
    resolve_model_config,
    validate,
    validate_data,
    validate_for_device,
)
from composer3d.config.registration import register_configs
from composer3d.config.schema import (
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    EvalConfig,
    Float8Config,
    LaunchConfig,
    LoggingConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
    TrainLoopConfig,
)
from composer3d.errors import ConfigError

__all__ = [
    "CheckpointConfig", "CompileConfig", "ConfigError", "DataConfig", "EvalConfig",
    "Float8Config", "LaunchConfig", "LoggingConfig", "MemoryConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
    "PrecisionConfig", "RunConfig", "TrainConfig", "TrainLoopConfig", "pipeline_microbatches", "register_configs",
    "resolve_degrees", "resolve_model_config", "validate", "validate_data", "validate_for_device",
]

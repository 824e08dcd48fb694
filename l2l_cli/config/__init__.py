"""The config: its schema (the single home of defaults) and its validation (one check per group)."""

from l2l_cli.config.schema import (
    BatchConfig,
    DistConfig,
    EpsConfig,
    HardwareConfig,
    L2LConfig,
    ModeConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    TaskConfig,
    TrainerConfig,
    register,
    to_container,
)
from l2l_cli.config.validate import (
    ConfigError,
    Problem,
    check_eps_path,
    effective_clip,
    effective_precision,
    effective_stash,
    validate,
)

__all__ = [
    "BatchConfig", "ConfigError", "DistConfig", "EpsConfig", "HardwareConfig", "L2LConfig", "ModeConfig", "ModelConfig",
    "OptimConfig", "PrecisionConfig", "Problem", "TaskConfig", "TrainerConfig", "check_eps_path", "effective_clip",
    "effective_precision", "effective_stash", "register", "to_container", "validate",
]  # fmt: skip

"""The config's schema: the dataclasses, the single home of defaults. Its validation, which runs every
part's own checks and the cross-group rules, is :mod:`l2l_cli.config.validate` (imported where it runs,
so that the parts it checks can use the schema without importing their checker)."""

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

__all__ = [
    "BatchConfig",
    "DistConfig",
    "EpsConfig",
    "HardwareConfig",
    "L2LConfig",
    "ModeConfig",
    "ModelConfig",
    "OptimConfig",
    "PrecisionConfig",
    "TaskConfig",
    "TrainerConfig",
    "register",
    "to_container",
]

"""Training: configs and presets, the optimizer recipe, the loop, checkpoints and resume (`hype train`)."""

from hype.train.config import (
    CheckpointConfig,
    DataConfig,
    LossConfig,
    OptimConfig,
    TrainConfig,
    list_train_configs,
    load_train_config,
)
from hype.train.loop import InitError, Trainer, TrainingDiverged, default_out, effective_model_config, train
from hype.train.metrics import format_summary, read_metrics
from hype.train.state import ResumeError, latest_checkpoint, list_checkpoints

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LossConfig",
    "OptimConfig",
    "ResumeError",
    "TrainConfig",
    "Trainer",
    "InitError",
    "TrainingDiverged",
    "default_out",
    "effective_model_config",
    "format_summary",
    "latest_checkpoint",
    "list_checkpoints",
    "list_train_configs",
    "load_train_config",
    "read_metrics",
    "train",
]

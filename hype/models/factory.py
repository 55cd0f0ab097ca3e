"""Build models from a config object, a dict (checkpoints), a YAML path or a shipped config name.

Names resolve to `<configs>/models/<name>.yaml` through `hype.config.resolve_preset`: the packaged
presets, or a folder in `$HYPE_CONFIG_DIR` (read at call time) that adds or overrides names.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from hype.config import list_presets, resolve_preset
from hype.models.config import ModelConfig
from hype.models.contrastive import ContrastiveModel

ConfigLike = ModelConfig | dict[str, Any] | str | Path


def list_model_configs() -> list[str]:
    """Names accepted by `create_model` / `load_model_config`, sorted."""
    return list_presets("models")


def load_model_config(config: ConfigLike) -> ModelConfig:
    """A validated `ModelConfig` from a config, a dict (e.g. `model.config.to_dict()`), a path or a name."""
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, dict):
        return ModelConfig.from_dict(config)
    if not isinstance(config, (str, Path)):
        raise TypeError(f"expected a ModelConfig, dict, path or config name, got {type(config).__name__}")
    # A preset name or a YAML path, found like every other preset (unknown names list the available ones).
    return ModelConfig.from_yaml(resolve_preset("models", config, "model"))


def create_model(config: ConfigLike, device: str | torch.device | None = None) -> ContrastiveModel:
    """Build a randomly initialized `ContrastiveModel` (never downloads weights).

    With `device`, parameters are created directly on it (`"meta"` gives a weightless model for
    counting parameters or deferred loading).
    """
    cfg = load_model_config(config)
    device = torch.device(device) if device is not None else None
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = ContrastiveModel(cfg)
    return model if device is None else model.to(device)

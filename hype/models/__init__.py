"""Contrastive image-text models in every geometry of the seeds (CLIP, MERU, EuCLIP, oblique).

`create_model("meru-vit-b16")` builds a `ContrastiveModel` from `configs/models/<name>.yaml`.
"""

from hype.models.config import (
    ConfigError,
    LossConfig,
    ModelConfig,
    ObliqueConfig,
    PreprocessConfig,
    ScalarsConfig,
    TextConfig,
    VisionConfig,
)
from hype.models.contrastive import ContrastiveModel
from hype.models.factory import create_model, list_model_configs, load_model_config
from hype.models.towers import (
    MultiTokenTextTower,
    MultiTokenVisionTower,
    build_image_tower,
    build_text_tower,
    sincos_2d_table,
)

__all__ = [
    "ConfigError",
    "ContrastiveModel",
    "LossConfig",
    "ModelConfig",
    "MultiTokenTextTower",
    "MultiTokenVisionTower",
    "ObliqueConfig",
    "PreprocessConfig",
    "ScalarsConfig",
    "TextConfig",
    "VisionConfig",
    "build_image_tower",
    "build_text_tower",
    "create_model",
    "list_model_configs",
    "load_model_config",
    "sincos_2d_table",
]

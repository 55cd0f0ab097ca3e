"""Converters of released checkpoints into hype's one checkpoint format (safetensors + config). DESIGN §3.

- `convert_meru`: MERU ViT-S/B/L-16 (facebookresearch/meru) -> `meru-vit-{s,b,l}16`.
- `convert_hype_release`: HYPE's ViT-L/14 hyperbolic CLIP (naver-ai/hype) -> `hype-meru-vit-l14`.

Released `.pt/.pth` files are opened with `torch.load(weights_only=True)` only: pickled code is refused,
never run. The output loads with `hype.checkpoint.load_checkpoint`.
"""

from hype.convert._common import ConversionError, ConversionReport, Rule
from hype.convert.hype_release import (
    convert_hype_release,
    hype_release_rules,
    hype_release_state_dict_to_hype,
)
from hype.convert.meru import convert_meru, meru_rules, meru_state_dict_to_hype
from hype.io.weights import load_source, unwrap_state_dict

__all__ = [
    "ConversionError",
    "ConversionReport",
    "Rule",
    "convert_hype_release",
    "convert_meru",
    "hype_release_rules",
    "hype_release_state_dict_to_hype",
    "load_source",
    "meru_rules",
    "meru_state_dict_to_hype",
    "unwrap_state_dict",
]

"""HYPE's released hyperbolic CLIP (naver-ai/hype `ckpt.pt`) -> hype's `hype-meru-vit-l14`. DESIGN §3.

The release is a flat state dict of naver-ai/hype `model.CLIP` (loaded there with
`model.load_state_dict(torch.load(path))`): an OpenCLIP-style ViT-L/14 under `visual.*` (conv1 without
bias, `ln_pre`, heads = width / 64, `proj` (1024, 768)), the text tower at the top level
(`token_embedding`, `positional_embedding`, `transformer.resblocks.*`, `ln_final`, `text_projection`)
and the 0-dim log-scalars `logit_scale`, `curvature`, `alpha_img`, `alpha_txt`. Activations are
nn.GELU; every LayerNorm uses eps = finfo(dtype).eps (2^-23 in fp32), which the config reproduces with
`ln_eps: 1.1920928955078125e-07`. Images are squashed to 224 x 224 (`Resize((224, 224))`, bilinear, no
center crop), which the converted model's preprocess config keeps, and normalized with OpenAI's
mean/std. Its `encode_image` / `encode_text` return α-scaled tangent vectors; hype's `encode_*` also
apply the exponential map, which HYPE's `hyperbolic.expm` applies before every distance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from hype.convert._common import (
    ConversionError,
    ConversionReport,
    Rule,
    architecture_mismatches,
    build_model,
    causal_mask_check,
    check_hyperbolic,
    count_blocks,
    finish,
    map_state_dict,
    other_layout_hint,
    prepare_output,
    target_shapes,
)
from hype.io.weights import load_source, unwrap_state_dict
from hype.models import ModelConfig, load_model_config

Tensor = torch.Tensor

DEFAULT_CONFIG = "hype-meru-vit-l14"
WHAT = "HYPE's release (naver-ai/hype)"
FP32_EPS = torch.finfo(torch.float32).eps
# The release's `model_init` passes `model.visual.image_size`, the tuple (224, 224), to its
# `image_transform`: `Resize((224, 224), interpolation=BICUBIC)` then a no-op `CenterCrop((224, 224))`, i.e.
# both sides to the model's size (no crop: a non-square photo is squashed), bicubic.
RELEASE_PREPROCESS = {"resize_mode": "squash", "interpolation": "bicubic"}

# open_clip ResidualAttentionBlock parameter names (the release uses the same module layout).
_BLOCK = [
    "ln_1.weight",
    "ln_1.bias",
    "attn.in_proj_weight",
    "attn.in_proj_bias",
    "attn.out_proj.weight",
    "attn.out_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
]


def hype_release_rules(config: ModelConfig) -> list[Rule]:
    """Source (HYPE release) -> target (hype) key rules for `config`'s depths."""
    rules = [
        Rule(f"visual.{k}", f"visual.{k}")
        for k in ("conv1.weight", "class_embedding", "positional_embedding", "ln_pre.weight", "ln_pre.bias")
    ]
    for i in range(config.vision.layers):
        rules += [
            Rule(f"visual.transformer.resblocks.{i}.{k}", f"visual.transformer.resblocks.{i}.{k}")
            for k in _BLOCK
        ]
    rules += [Rule(f"visual.{k}", f"visual.{k}") for k in ("ln_post.weight", "ln_post.bias", "proj")]
    # The text tower sits at the top level of the release (OpenAI CLIP layout) and under `text.` here.
    rules += [Rule(k, f"text.{k}") for k in ("token_embedding.weight", "positional_embedding")]
    for i in range(config.text.layers):
        rules += [
            Rule(f"transformer.resblocks.{i}.{k}", f"text.transformer.resblocks.{i}.{k}") for k in _BLOCK
        ]
    rules += [Rule(k, f"text.{k}") for k in ("ln_final.weight", "ln_final.bias", "text_projection")]
    rules += [
        Rule("logit_scale", "log_logit_scale"),
        Rule("curvature", "log_curv"),
        Rule("alpha_img", "log_alpha_img"),
        Rule("alpha_txt", "log_alpha_txt"),
    ]
    return rules


def hype_release_architecture(sd: Mapping[str, Tensor]) -> dict[str, int | None]:
    """The config values a HYPE-release state dict determines (None where its key is absent)."""

    def dim(key: str, axis: int) -> int | None:
        t = sd.get(key)
        return int(t.shape[axis]) if t is not None and -t.dim() <= axis < t.dim() else None

    return {
        "vision.width": dim("visual.conv1.weight", 0),
        "vision.patch_size": dim("visual.conv1.weight", -1),
        "vision.layers": count_blocks(sd, "visual.transformer.resblocks.") or None,
        "vision.num_positions": dim("visual.positional_embedding", 0),
        "text.width": dim("token_embedding.weight", 1),
        "text.vocab_size": dim("token_embedding.weight", 0),
        "text.context_length": dim("positional_embedding", 0),
        "text.layers": count_blocks(sd, "transformer.resblocks.") or None,
        "embed_dim": dim("visual.proj", 1),
    }


def resolve_hype_config(
    sd: Mapping[str, Tensor], model_config: ModelConfig | str | Path | dict | None, source: str
) -> tuple[ModelConfig, str, list[str]]:
    """(config, how it was chosen, notes); the default is `hype-meru-vit-l14`, checked against `sd`."""
    found = hype_release_architecture(sd)
    if found["vision.width"] is None or found["text.width"] is None:
        keys = ", ".join(list(sd)[:6])
        hint = other_layout_hint(sd, "hype-release")
        raise ConversionError(
            f"{source}: not a HYPE release state dict: no visual.conv1.weight / token_embedding.weight "
            f"(first keys: {keys or 'none'}).{hint}"
        )
    config = load_model_config(DEFAULT_CONFIG if model_config is None else model_config)
    check_hyperbolic(config, source)
    config = dataclasses.replace(
        config, preprocess=dataclasses.replace(config.preprocess, **RELEASE_PREPROCESS)
    )
    problems = architecture_mismatches(found, config)
    if problems:
        raise ConversionError(
            f"{source}: the checkpoint does not have the architecture of model config {config.name!r}: "
            f"{'; '.join(problems)}. Pass --model-config with a config that matches."
        )
    notes = []
    for tower in ("vision", "text"):
        eps = getattr(config, tower).ln_eps
        if eps != FP32_EPS:
            notes.append(
                f"config {tower}.ln_eps is {eps:g}, but the release's LayerNorms use the fp32 eps "
                f"{FP32_EPS:g}; embeddings will differ slightly"
            )
    if config.vision.head_width != 64:
        notes.append(f"the release uses heads = width / 64, the config head_width {config.vision.head_width}")
    return config, "default" if model_config is None else "given", notes


def hype_release_state_dict_to_hype(
    sd: Mapping[str, Tensor],
    model_config: ModelConfig | str | Path | dict | None = None,
    *,
    source: str = "<state dict>",
    ignore_keys: Iterable[str] = (),
) -> tuple[ModelConfig, dict[str, Tensor], dict[str, object]]:
    """(config, hype state dict, details) from the release's state dict; works on meta tensors."""
    config, origin, notes = resolve_hype_config(sd, model_config, source)
    # A stored causal mask (OpenAI layout: float, -inf above the diagonal) is verified, not loaded.
    checks = {"attn_mask": causal_mask_check(config.text.context_length)}
    mapped, ignored = map_state_dict(
        sd,
        hype_release_rules(config),
        target_shapes(config),
        source=source,
        what=WHAT,
        checks=checks,
        ignore=ignore_keys,
    )
    return config, mapped, {"config_origin": origin, "ignored_keys": ignored, "notes": notes}


def convert_hype_release(
    ckpt: str | Path,
    out: str | Path,
    *,
    model_config: ModelConfig | str | Path | dict | None = None,
    ignore_keys: Iterable[str] = (),
    overwrite: bool = False,
) -> ConversionReport:
    """Convert HYPE's released checkpoint to a hype safetensors checkpoint at `out` (atomically).

    `load_checkpoint(out).encode_image(x)` equals `expm(release.encode_image(x), curvature)` of the
    release (space components), and likewise for text.
    """
    ckpt, out = Path(ckpt), Path(out)
    prepare_output(ckpt, out, overwrite)
    sd, top_level = unwrap_state_dict(load_source(ckpt), ckpt)
    config, mapped, details = hype_release_state_dict_to_hype(
        sd, model_config, source=str(ckpt), ignore_keys=ignore_keys
    )
    model, scalar_notes = build_model(config, mapped)
    details["notes"] = [*details["notes"], *scalar_notes]
    return finish("HYPE release", ckpt, out, model, sd, top_level, details)

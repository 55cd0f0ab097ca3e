"""MERU's and HyCoCLIP's released checkpoints -> hype. DESIGN §2.1, §3.

facebookresearch/meru (meru_vit_{s,b,l}.pth, clip_vit_{s,b,l}.pth) and PalAvik/hycoclip, built on MERU's code
(hycoclip_vit_{s,b}.pth, meru_vit_{s,b}.pth, clip_vit_{s,b}.pth), share one layout: HyCoCLIP's model is
MERU's (same modules, encoders and scalars; only its training differs), and the CLIP baselines are the
same towers without the curvature and α scalars (`meru-clip-vit-*16`, cosine geometry).

MERU stores `{"model": state_dict}` (its `CheckpointManager`) of `meru.models.MERU`:
- `visual.*`: a timm VisionTransformer (class-token pooling, no head, nn.LayerNorm eps 1e-5, no
  LayerNorm before the blocks, patch embedding with bias, frozen 2-D sin-cos positions);
- `textual.*`: MERU's CLIP-style causal text transformer (`token_embed`, `posit_embed`, `resblocks`
  of nn.MultiheadAttention + c_fc/GELU/c_proj, `ln_final`, a stored bool causal `attn_mask`);
- `visual_proj` / `textual_proj`: nn.Linear(width, embed_dim, bias=False);
- `logit_scale`, `curv`, `visual_alpha`, `textual_alpha`: 0-dim logs of the scalars;
- `pixel_mean` / `pixel_std` (3, 1, 1): MERU normalizes [0, 1] images inside the model; in hype the
  same mean/std live in the config's `preprocess`.
These map one-to-one onto the `meru-vit-{s,b,l}16` configs (open_clip towers; see `meru_rules`).
The number of attention heads is not recorded in a state dict: it comes from the config.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
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

MERU_CONFIGS = ("meru-vit-s16", "meru-vit-b16", "meru-vit-l16")
CLIP_BASELINE_CONFIGS = ("meru-clip-vit-s16", "meru-clip-vit-b16", "meru-clip-vit-l16")
WHAT = "MERU / HyCoCLIP (facebookresearch/meru, PalAvik/hycoclip)"

# Per-block renames: timm ViT block -> open_clip ResidualAttentionBlock.
_VISION_BLOCK = {
    "norm1.weight": "ln_1.weight",
    "norm1.bias": "ln_1.bias",
    "attn.qkv.weight": "attn.in_proj_weight",  # both (3W, W) with rows q, k, v: no reordering needed
    "attn.qkv.bias": "attn.in_proj_bias",
    "attn.proj.weight": "attn.out_proj.weight",
    "attn.proj.bias": "attn.out_proj.bias",
    "norm2.weight": "ln_2.weight",
    "norm2.bias": "ln_2.bias",
    "mlp.fc1.weight": "mlp.c_fc.weight",
    "mlp.fc1.bias": "mlp.c_fc.bias",
    "mlp.fc2.weight": "mlp.c_proj.weight",
    "mlp.fc2.bias": "mlp.c_proj.bias",
}
# MERU's text blocks already use CLIP's names.
_TEXT_BLOCK = [
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


def meru_rules(config: ModelConfig) -> list[Rule]:
    """Source (MERU) -> target (hype) key rules for `config`'s depths."""
    rules = [
        Rule("visual.patch_embed.proj.weight", "visual.conv1.weight"),
        Rule("visual.patch_embed.proj.bias", "visual.conv1.bias"),
        Rule("visual.cls_token", "visual.class_embedding", "squeeze", lead=2),  # (1, 1, W) -> (W,)
        Rule("visual.pos_embed", "visual.positional_embedding", "squeeze", lead=1),  # (1, N, W) -> (N, W)
    ]
    for i in range(config.vision.layers):
        for src, dst in _VISION_BLOCK.items():
            rules.append(Rule(f"visual.blocks.{i}.{src}", f"visual.transformer.resblocks.{i}.{dst}"))
    rules += [
        Rule("visual.norm.weight", "visual.ln_post.weight"),
        Rule("visual.norm.bias", "visual.ln_post.bias"),
        Rule("visual_proj.weight", "visual.proj", "transpose"),  # Linear (E, W) -> x @ (W, E)
        Rule("textual.token_embed.weight", "text.token_embedding.weight"),
        Rule("textual.posit_embed", "text.positional_embedding"),
    ]
    for i in range(config.text.layers):
        for name in _TEXT_BLOCK:
            rules.append(Rule(f"textual.resblocks.{i}.{name}", f"text.transformer.resblocks.{i}.{name}"))
    rules += [
        Rule("textual.ln_final.weight", "text.ln_final.weight"),
        Rule("textual.ln_final.bias", "text.ln_final.bias"),
        Rule("textual_proj.weight", "text.text_projection", "transpose"),
        Rule("logit_scale", "log_logit_scale"),
    ]
    if config.geometry == "hyperbolic":  # the CLIP baselines have no curvature or α
        rules += [
            Rule("curv", "log_curv"),
            Rule("visual_alpha", "log_alpha_img"),
            Rule("textual_alpha", "log_alpha_txt"),
        ]
    return rules


def _pixel_stats_check(t: Tensor) -> str | None:
    if tuple(t.shape) not in ((3, 1, 1), (3,)) or not t.is_floating_point():
        return f"has shape {tuple(t.shape)} and dtype {t.dtype}, expected a (3, 1, 1) float tensor"
    return None


def meru_architecture(sd: Mapping[str, Tensor]) -> dict[str, int | None]:
    """The config values a MERU state dict determines (None where its key is absent)."""

    def dim(key: str, axis: int) -> int | None:
        t = sd.get(key)
        return int(t.shape[axis]) if t is not None and -t.dim() <= axis < t.dim() else None

    return {
        "vision.width": dim("visual.patch_embed.proj.weight", 0),
        "vision.patch_size": dim("visual.patch_embed.proj.weight", -1),
        "vision.layers": count_blocks(sd, "visual.blocks.") or None,
        "vision.num_positions": dim("visual.pos_embed", 1),
        "text.width": dim("textual.token_embed.weight", 1),
        "text.vocab_size": dim("textual.token_embed.weight", 0),
        "text.context_length": dim("textual.posit_embed", 0),
        "text.layers": count_blocks(sd, "textual.resblocks.") or None,
        "embed_dim": dim("visual_proj.weight", 0),
    }


def _describe(found: Mapping[str, int | None]) -> str:
    return ", ".join(f"{k} {v}" for k, v in found.items() if v is not None)


def resolve_meru_config(
    sd: Mapping[str, Tensor], model_config: ModelConfig | str | Path | dict | None, source: str
) -> tuple[ModelConfig, str]:
    """(config, how it was chosen): the given one, checked against the state dict, or the shipped
    `meru-vit-*16` config (`meru-clip-vit-*16` for a CLIP baseline: no `curv`) whose ViT width, depth and
    patch size match."""
    found = meru_architecture(sd)
    # A CLIP baseline has none of the hyperbolic scalars; one missing alone is a damaged MERU checkpoint.
    baseline = not any(k in sd for k in ("curv", "visual_alpha", "textual_alpha"))
    shipped = CLIP_BASELINE_CONFIGS if baseline else MERU_CONFIGS
    if found["vision.width"] is None or found["text.width"] is None:
        keys = ", ".join(list(sd)[:6])
        raise ConversionError(
            f"{source}: not a MERU state dict: no visual.patch_embed.proj.weight / "
            f"textual.token_embed.weight (first keys: {keys or 'none'}).{other_layout_hint(sd, 'meru')}"
        )
    if model_config is not None:
        config = load_model_config(model_config)
        if not baseline:
            check_hyperbolic(config, source)
        elif config.geometry != "clip":
            raise ConversionError(
                f"{source}: a CLIP baseline (no curv or α in the checkpoint) needs a clip-geometry config, "
                f"not {config.name!r} ({config.geometry}); omit --model-config or pass e.g. meru-clip-vit-b16"
            )
        problems = architecture_mismatches(found, config)
        if problems:
            raise ConversionError(
                f"{source}: the checkpoint does not have the architecture of model config {config.name!r}: "
                f"{'; '.join(problems)}. Omit --model-config to infer it, or pass a config that matches."
            )
        return config, "given"
    matches = []
    for name in shipped:
        config = load_model_config(name)
        if not architecture_mismatches(found, config):
            matches.append(config)
    if len(matches) != 1:
        raise ConversionError(
            f"{source}: no shipped MERU config ({', '.join(shipped)}) matches this checkpoint "
            f"({_describe(found)}). Pass --model-config with a YAML config describing it (copy "
            "configs/models/meru-vit-b16.yaml and edit the vision/text sections; heads are not stored "
            "in a checkpoint)."
        )
    v = matches[0].vision
    return matches[0], f"inferred: ViT width {v.width}, depth {v.layers}, patch {v.patch_size}"


def _with_pixel_stats(config: ModelConfig, sd: Mapping[str, Tensor]) -> tuple[ModelConfig, list[str]]:
    """The config with MERU's in-model normalization moved into `preprocess` (it already matches for
    the released models: ImageNet mean/std)."""
    if "pixel_mean" not in sd or "pixel_std" not in sd:
        return config, ["no pixel_mean/pixel_std in the checkpoint; the config's mean/std are kept"]
    mean = [float(x) for x in sd["pixel_mean"].double().flatten()]
    std = [float(x) for x in sd["pixel_std"].double().flatten()]
    p = config.preprocess

    def same(a: list[float], b: tuple[float, ...]) -> bool:
        return all(abs(x - y) <= 1e-6 for x, y in zip(a, b, strict=True))

    if same(mean, p.mean) and same(std, p.std):
        return config, []
    data = config.to_dict()
    # The buffers are fp32: the shortest decimal that rounds to the same fp32 value gives back the
    # constant as written in MERU's code (0.485, not 0.48500001430511475).
    data["preprocess"]["mean"] = [float(str(np.float32(x))) for x in mean]
    data["preprocess"]["std"] = [float(str(np.float32(x))) for x in std]
    note = f"image mean/std taken from the checkpoint: mean {data['preprocess']['mean']}, std " + str(
        data["preprocess"]["std"]
    )
    return ModelConfig.from_dict(data, source=f"{config.name} + checkpoint pixel_mean/pixel_std"), [note]


def meru_state_dict_to_hype(
    sd: Mapping[str, Tensor],
    model_config: ModelConfig | str | Path | dict | None = None,
    *,
    source: str = "<state dict>",
    ignore_keys: Iterable[str] = (),
) -> tuple[ModelConfig, dict[str, Tensor], dict[str, object]]:
    """(config, hype state dict, details) from a MERU state dict, without building the model.

    Works on meta tensors too, so the full-size layouts can be checked without their memory.
    """
    config, origin = resolve_meru_config(sd, model_config, source)
    checks = {
        "textual.attn_mask": causal_mask_check(config.text.context_length),
        "pixel_mean": _pixel_stats_check,
        "pixel_std": _pixel_stats_check,
    }
    mapped, ignored = map_state_dict(
        sd,
        meru_rules(config),
        target_shapes(config),
        source=source,
        what=WHAT,
        checks=checks,
        ignore=ignore_keys,
    )
    config, notes = _with_pixel_stats(config, sd)
    return config, mapped, {"config_origin": origin, "ignored_keys": ignored, "notes": notes}


def convert_meru(
    ckpt: str | Path,
    out: str | Path,
    *,
    model_config: ModelConfig | str | Path | dict | None = None,
    ignore_keys: Iterable[str] = (),
    overwrite: bool = False,
) -> ConversionReport:
    """Convert a released MERU checkpoint to a hype safetensors checkpoint at `out` (atomically).

    `load_checkpoint(out)` then returns a `ContrastiveModel` whose `encode_image` / `encode_text` give
    MERU's `encode_image(project=True)` / `encode_text(project=True)` embeddings (images normalized by
    the model's `preprocess` instead of inside the model).
    """
    ckpt, out = Path(ckpt), Path(out)
    prepare_output(ckpt, out, overwrite)
    sd, top_level = unwrap_state_dict(load_source(ckpt), ckpt)
    config, mapped, details = meru_state_dict_to_hype(
        sd, model_config, source=str(ckpt), ignore_keys=ignore_keys
    )
    model, scalar_notes = build_model(config, mapped)
    details["notes"] = [*details["notes"], *scalar_notes]
    kind = "MERU" if config.geometry == "hyperbolic" else "MERU/HyCoCLIP CLIP baseline"
    return finish(kind, ckpt, out, model, sd, top_level, details)

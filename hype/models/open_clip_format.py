"""open_clip's model format, both ways: configs and state-dict keys. DESIGN §6.

hype's towers are open_clip's own (`hype.models.towers`), so a CLIP that open_clip builds from a config
and a `ContrastiveModel` built from the translated config hold the same modules; only three things
differ, and this module owns all three:

- **the config**: open_clip's `model_cfg` (`embed_dim`, `quick_gelu`, `vision_cfg`, `text_cfg`, ...)
  and `preprocess_cfg` (`mean`, `std`, `interpolation`, `resize_mode`) <-> `ModelConfig`. Only what
  hype's towers build translates; a config using anything else (timm or Hugging Face towers, attentional
  pooling, layer scale, SigLIP's bias and tokenizer, ...) is refused with the list of what it uses.
- **the keys**: open_clip's `CLIP` keeps the text tower at the top level (`token_embedding`,
  `positional_embedding`, `transformer.*`, `ln_final`, `text_projection`), `CustomTextCLIP` under
  `text.*`, and hype always under `text.*`; open_clip's `logit_scale` is hype's `log_logit_scale` (both
  store the log). The EuCLIP fork adds `curvature`, `alpha_img`, `alpha_txt` for the hyperbolic
  geometries, stored as logs like `logit_scale` (hype's `log_curv`, `log_alpha_img`, `log_alpha_txt`),
  and removes the final LayerNorms with `"final_norm": "none"` in a tower's config.
- **the architecture name**: a config equal to one of open_clip's built-in configs gets that name
  (`ViT-B-32`), which is what DataComp's tools pass to `open_clip.create_model_and_transforms`.

Imports open_clip only inside functions that need its registry, so the rest of `hype.models` stays as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from hype.io.weights import ModelFileError
from hype.models.config import OPENAI_MEAN, OPENAI_STD, ModelConfig

Tensor = torch.Tensor

# The fork's model configs append this to a built-in name when both towers lose their final LayerNorm.
NO_FINAL_LN = "-no-final-ln"

# open_clip text-tower keys that live at the top level of a `CLIP` state dict (under `text.` in hype's).
_TEXT_TOP_LEVEL = ("token_embedding.", "positional_embedding", "transformer.", "ln_final.", "text_projection")
# hype's scalar parameters -> the open_clip / EuCLIP-fork key holding the same log value.
SCALAR_KEYS = {
    "log_logit_scale": "logit_scale",
    "log_curv": "curvature",
    "log_alpha_img": "alpha_img",
    "log_alpha_txt": "alpha_txt",
}
# Entries OpenAI's archives carry besides the weights (open_clip drops them too).
OPENAI_EXTRAS = ("input_resolution", "context_length", "vocab_size")
# open_clip's causal text mask is a non-persistent buffer, absent from state dicts but kept by TorchScript
# archives of open_clip models; both towers rebuild it, so it is dropped.
_REBUILT = ("attn_mask", "text.attn_mask")

# Tower options hype builds, and options that only matter for training or for features hype refuses
# anyway. Every other key must hold open_clip's default value.
_VISION_BUILT = {"layers", "width", "head_width", "mlp_ratio", "patch_size", "image_size", "no_ln_pre"}
_TEXT_BUILT = {"context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio"}
_IGNORED = {
    "patch_dropout",
    "output_tokens",
    "attn_pooler_queries",
    "attn_pooler_heads",
    "hf_model_pretrained",
    "hf_proj_type",
    "hf_pooler_type",
    "timm_model_pretrained",
    "timm_pool",
    "timm_proj",
    "timm_proj_bias",
    "timm_drop",
    "timm_drop_path",
    "pad_id",
    "eos_id",
    "tokenizer_mode",
}
_TOP_BUILT = {"embed_dim", "quick_gelu", "vision_cfg", "text_cfg", "custom_text", "init_logit_scale"}


class UnsupportedArchitecture(ModelFileError):
    """An open_clip config using tower features hype's models do not build."""


# --- configs -------------------------------------------------------------------------------------


def builtin_config(arch: str) -> dict[str, Any] | None:
    """open_clip's model config for a built-in name (or the fork's `<name>-no-final-ln`), else None."""
    from open_clip.factory import get_model_config

    cfg = get_model_config(arch)
    if cfg is None and arch.endswith(NO_FINAL_LN):
        base = get_model_config(arch[: -len(NO_FINAL_LN)])
        if base is not None:
            cfg = dict(base)
            for tower in ("vision_cfg", "text_cfg"):
                cfg[tower] = {**cfg[tower], "final_norm": "none"}
    return None if cfg is None else _plain(cfg)


def builtin_names() -> list[str]:
    from open_clip import list_models

    return list(list_models())


def builtin_name(model_cfg: Mapping[str, Any]) -> str | None:
    """The built-in open_clip architecture whose config equals `model_cfg` (defaults filled in), if any."""
    want = _normalized(model_cfg)
    names = builtin_names()
    # Prefer the plain name over a `-quickgelu` twin when both would match (they never both do: the
    # quick_gelu flag differs), and the shortest name among aliases.
    for name in sorted(names, key=len):
        cfg = builtin_config(name)
        if cfg is not None and _normalized(cfg) == want:
            return name
    return None


def unsupported_features(model_cfg: Mapping[str, Any]) -> list[str]:
    """What in an open_clip config hype's towers do not build (empty: it translates exactly)."""
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    found = [f"{k}={model_cfg[k]!r}" for k in model_cfg if k not in _TOP_BUILT and k != "cast_dtype"]
    towers = (("vision_cfg", CLIPVisionCfg, _VISION_BUILT), ("text_cfg", CLIPTextCfg, _TEXT_BUILT))
    for tower, cls, built in towers:
        cfg = dict(model_cfg.get(tower) or {})
        defaults = {f: getattr(cls(), f) for f in cls.__dataclass_fields__}
        for key, value in cfg.items():
            if key in built or key in _IGNORED:
                continue
            if key == "norm_kwargs" and (value is None or set(value) <= {"eps"}):
                continue
            if key == "final_norm" and value in ("none", "layernorm", None):
                continue
            if key not in defaults:
                found.append(f"{tower}.{key} (unknown to open_clip {_open_clip_version()})")
            elif value != defaults[key] and not (key == "image_size" and _square(value)):
                found.append(f"{tower}.{key}={value!r}")
        if tower == "vision_cfg" and isinstance(cfg.get("layers"), (list, tuple)):
            found.append("vision_cfg.layers is a list (a ResNet image tower)")
        if tower == "vision_cfg" and not _square(cfg.get("image_size", 224)):
            found.append(f"vision_cfg.image_size={cfg['image_size']!r} (not square)")
    return sorted(set(found))


def model_config_from_open_clip(
    model_cfg: Mapping[str, Any],
    preprocess_cfg: Mapping[str, Any] | None = None,
    *,
    name: str,
    geometry: str = "clip",
    description: str = "",
) -> ModelConfig:
    """The `ModelConfig` building the same towers as open_clip does from `model_cfg`.

    Raises `UnsupportedArchitecture` (listing the features) for configs hype's towers cannot build.
    """
    problems = unsupported_features(model_cfg)
    if problems:
        use = (
            "hype runs open_clip's own model for it where a CLIP is enough: use the file or folder as it "
            "is with `hype score --clip SRC` or `hype eval --model SRC`"
            if geometry == "clip"
            else f"stock open_clip has no {geometry!r} geometry either"
        )
        raise UnsupportedArchitecture(
            f"open_clip architecture {name!r} uses features hype's towers do not build: "
            f"{', '.join(problems)}. hype translates ViT image towers with open_clip's causal text "
            "transformer (OpenAI CLIP, DataComp and LAION ViT models) into its own model, which converting "
            f"(`hype convert open-clip`) and `hype train --init` need; {use}"
        )
    v, t = dict(model_cfg["vision_cfg"]), dict(model_cfg["text_cfg"])
    size = v.get("image_size", 224)
    size = size[0] if isinstance(size, (list, tuple)) else size
    p = dict(preprocess_cfg or {})
    data = {
        "name": name,
        "description": description or f"open_clip {name}",
        "geometry": geometry,
        "embed_dim": model_cfg["embed_dim"],
        "quick_gelu": bool(model_cfg.get("quick_gelu", False)),
        "vision": {
            "image_size": size,
            "patch_size": v.get("patch_size", 16),
            "width": v.get("width", 768),
            "layers": v.get("layers", 12),
            "head_width": v.get("head_width", 64),
            "mlp_ratio": float(v.get("mlp_ratio", 4.0)),
            "final_ln": v.get("final_norm", "layernorm") != "none",
            "ln_pre": not v.get("no_ln_pre", False),
            "ln_eps": float((v.get("norm_kwargs") or {}).get("eps", 1e-5)),
        },
        "text": {
            "context_length": t.get("context_length", 77),
            "vocab_size": t.get("vocab_size", 49408),
            "width": t.get("width", 512),
            "heads": t.get("heads", 8),
            "layers": t.get("layers", 12),
            "mlp_ratio": float(t.get("mlp_ratio", 4.0)),
            "final_ln": t.get("final_norm", "layernorm") != "none",
            "ln_eps": float((t.get("norm_kwargs") or {}).get("eps", 1e-5)),
        },
        "preprocess": {
            "mean": list(p.get("mean", OPENAI_MEAN)),
            "std": list(p.get("std", OPENAI_STD)),
            "resize_mode": p.get("resize_mode", "shortest"),
            "interpolation": p.get("interpolation", "bicubic"),
        },
    }
    if "init_logit_scale" in model_cfg and geometry == "clip":
        data["scalars"] = {"logit_scale_init": math.exp(float(model_cfg["init_logit_scale"]))}
    return ModelConfig.from_dict(data, source=f"open_clip config {name}")


def open_clip_config(cfg: ModelConfig) -> dict[str, Any]:
    """`{"model_cfg", "preprocess_cfg"}` as in `open_clip_config.json`, for a model hype built.

    Raises `UnsupportedArchitecture` for what open_clip's config cannot describe (multi-token oblique
    towers, MERU's sin-cos positions and patch bias); final LayerNorm removal is the fork's `final_norm`.
    """
    v, t = cfg.vision, cfg.text
    problems = []
    if cfg.num_class_tokens != 1:
        problems.append("multi-token oblique towers")
    if v.pos_embed != "learnable":
        problems.append(f"vision.pos_embed={v.pos_embed!r} (MERU's fixed sin-cos table)")
    if v.patch_bias:
        problems.append("vision.patch_bias (MERU's timm ViT)")
    if problems:
        raise UnsupportedArchitecture(
            f"model config {cfg.name!r} cannot be written as an open_clip config: {', '.join(problems)}"
        )
    vision: dict[str, Any] = {
        "image_size": v.image_size,
        "layers": v.layers,
        "width": v.width,
        "patch_size": v.patch_size,
    }
    if v.head_width != 64:
        vision["head_width"] = v.head_width
    if v.mlp_ratio != 4.0:
        vision["mlp_ratio"] = v.mlp_ratio
    if not v.ln_pre:
        vision["no_ln_pre"] = True
    text: dict[str, Any] = {
        "context_length": t.context_length,
        "vocab_size": t.vocab_size,
        "width": t.width,
        "heads": t.heads,
        "layers": t.layers,
    }
    if t.mlp_ratio != 4.0:
        text["mlp_ratio"] = t.mlp_ratio
    for tower, c in ((vision, v), (text, t)):
        if c.ln_eps != 1e-5:
            tower["norm_kwargs"] = {"eps": c.ln_eps}
        if not c.final_ln:
            tower["final_norm"] = "none"
    model_cfg: dict[str, Any] = {"embed_dim": cfg.embed_dim}
    if cfg.quick_gelu:
        model_cfg["quick_gelu"] = True
    model_cfg |= {"vision_cfg": vision, "text_cfg": text}
    p = cfg.preprocess
    preprocess_cfg = {
        "mean": list(p.mean),
        "std": list(p.std),
        "interpolation": p.interpolation,
        "resize_mode": p.resize_mode,
    }
    return {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}


def stock_open_clip_can_build(model_cfg: Mapping[str, Any]) -> bool:
    """False for the fork's `final_norm: none` towers, which released open_clip does not know."""
    return all("final_norm" not in (model_cfg.get(t) or {}) for t in ("vision_cfg", "text_cfg"))


# --- state dicts ---------------------------------------------------------------------------------


def state_dict_from_open_clip(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """open_clip keys (`CLIP` or `CustomTextCLIP` layout, fork scalars) -> `ContrastiveModel` keys."""
    out: dict[str, Tensor] = {}
    reverse = {v: k for k, v in SCALAR_KEYS.items()}
    for key, value in sd.items():
        if key in OPENAI_EXTRAS or key in _REBUILT:
            continue
        if key in reverse:
            out[reverse[key]] = value.reshape(())  # some releases store logit_scale as shape (1,)
        elif key.startswith(_TEXT_TOP_LEVEL):
            out["text." + key] = value
        else:
            out[key] = value
    return out


def state_dict_to_open_clip(model: torch.nn.Module, *, custom_text: bool = False) -> dict[str, Tensor]:
    """A `ContrastiveModel`'s weights under open_clip's keys (`CLIP` layout unless `custom_text`)."""
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if key in SCALAR_KEYS:
            out[SCALAR_KEYS[key]] = value
        elif key.startswith("text.") and not custom_text:
            out[key[len("text.") :]] = value
        else:
            out[key] = value
    return {k: v.detach().contiguous() for k, v in out.items()}


def infer_openai_config(sd: Mapping[str, Tensor]) -> dict[str, Any]:
    """open_clip `model_cfg` of an OpenAI-layout state dict (ViT or ResNet), read off its shapes as
    open_clip's `build_model_from_openai_state_dict` does (heads = width / 64, QuickGELU)."""
    if "visual.proj" in sd:
        conv = sd["visual.conv1.weight"]
        width, patch = int(conv.shape[0]), int(conv.shape[-1])
        grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
        layers = len({k.split(".")[3] for k in sd if k.startswith("visual.transformer.resblocks.")})
        vision = {"image_size": patch * grid, "layers": layers, "width": width, "patch_size": patch}
    else:  # ModifiedResNet: blocks per stage, stem width, attention-pool grid (stride 32)
        stages = [[k for k in sd if k.startswith(f"visual.layer{b}.")] for b in (1, 2, 3, 4)]
        blocks = [len({k.split(".")[2] for k in keys}) for keys in stages]
        grid = round((sd["visual.attnpool.positional_embedding"].shape[0] - 1) ** 0.5)
        width = int(sd["visual.layer1.0.conv1.weight"].shape[0])
        vision = {"image_size": grid * 32, "layers": blocks, "width": width, "patch_size": None}
    text_width = int(sd["ln_final.weight"].shape[0])
    text_layers = len({k.split(".")[2] for k in sd if k.startswith("transformer.resblocks.")})
    return {
        "embed_dim": int(sd["text_projection"].shape[1]),
        "quick_gelu": True,
        "vision_cfg": vision,
        "text_cfg": {
            "context_length": int(sd["positional_embedding"].shape[0]),
            "vocab_size": int(sd["token_embedding.weight"].shape[0]),
            "width": text_width,
            "heads": text_width // 64,
            "layers": text_layers,
        },
    }


# --- helpers -------------------------------------------------------------------------------------


def _square(size: Any) -> bool:
    return not isinstance(size, (list, tuple)) or (len(size) == 2 and size[0] == size[1])


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _normalized(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A config with open_clip's defaults filled in and image sizes as ints, for equality tests."""
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    cfg = _plain(model_cfg)
    out = {
        "embed_dim": cfg.get("embed_dim"),
        "quick_gelu": bool(cfg.get("quick_gelu", False)),
        "custom_text": bool(cfg.get("custom_text", False)),
    }
    for k, v in cfg.items():
        if k not in out and k not in ("vision_cfg", "text_cfg", "cast_dtype", "custom_text"):
            out[k] = v
    for tower, cls in (("vision_cfg", CLIPVisionCfg), ("text_cfg", CLIPTextCfg)):
        defaults = {f: _plain(getattr(cls(), f)) for f in cls.__dataclass_fields__}
        merged = {**defaults, **(cfg.get(tower) or {})}
        size = merged.get("image_size")
        if isinstance(size, list) and len(size) == 2 and size[0] == size[1]:
            merged["image_size"] = size[0]
        merged.pop("output_tokens", None)
        out[tower] = merged
    return out


def _open_clip_version() -> str:
    import open_clip

    return getattr(open_clip, "__version__", "?")


__all__ = [
    "NO_FINAL_LN",
    "OPENAI_EXTRAS",
    "SCALAR_KEYS",
    "UnsupportedArchitecture",
    "builtin_config",
    "builtin_name",
    "builtin_names",
    "infer_openai_config",
    "model_config_from_open_clip",
    "open_clip_config",
    "state_dict_from_open_clip",
    "state_dict_to_open_clip",
    "stock_open_clip_can_build",
    "unsupported_features",
]

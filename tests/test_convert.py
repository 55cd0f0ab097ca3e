"""Converters of released MERU / HYPE checkpoints.

The released layouts are rebuilt here from the authors' code (facebookresearch/meru `meru/models.py`,
timm's VisionTransformer key names, naver-ai/hype `model.py`) with small widths, converted, loaded with
`load_checkpoint` and compared against an independent float64 forward pass written directly on the raw
source tensors (patch embedding, class token, positions, pre-norm blocks, final norm, projection, α
scaling and the exponential map). Full-size layouts are checked key by key on the meta device.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch
import yaml
from click.testing import CliRunner

from hype.checkpoint import load_checkpoint, read_checkpoint_metadata
from hype.cli import main
from hype.convert import (
    ConversionError,
    convert_hype_release,
    convert_meru,
    hype_release_state_dict_to_hype,
    meru_state_dict_to_hype,
)
from hype.models import create_model
from hype.models.config import IMAGENET_MEAN, IMAGENET_STD, OPENAI_MEAN, OPENAI_STD

F64 = torch.float64
FP32_EPS = 2.0**-23  # HYPE's LayerNorm: finfo(float32).eps

# --- tiny released layouts ----------------------------------------------------------------------

# MERU-style: ViT width 64 (4 heads of 16), 2 blocks, patch 8 at 32 px; text width 48, 4 heads, 2 blocks.
TINY_MERU = {
    "image": 32,
    "patch": 8,
    "width": 64,
    "heads": 4,
    "depth": 2,
    "text_width": 48,
    "text_heads": 4,
    "text_depth": 2,
    "context": 16,
    "vocab": 100,
    "embed": 32,
}
# HYPE-style: heads = width / 64 as in naver-ai/hype, so width 128 gives 2 heads.
TINY_HYPE = dict(TINY_MERU, image=28, patch=7, width=128, heads=2)

SCALARS = {"curv": 0.37, "alpha_img": 0.081, "alpha_txt": 0.093, "logit_scale": 42.0}


def _normal(gen: torch.Generator, *shape: int, std: float = 0.1) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _ln(gen: torch.Generator, prefix: str, width: int) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.weight": 1.0 + _normal(gen, width, std=0.2),
        f"{prefix}.bias": _normal(gen, width, std=0.1),
    }


def _clip_block(gen: torch.Generator, p: str, w: int) -> dict[str, torch.Tensor]:
    """nn.MultiheadAttention + c_fc/c_proj block (MERU's text blocks, OpenCLIP/HYPE blocks)."""
    sd = _ln(gen, f"{p}.ln_1", w)
    sd[f"{p}.attn.in_proj_weight"] = _normal(gen, 3 * w, w, std=w**-0.5)
    sd[f"{p}.attn.in_proj_bias"] = _normal(gen, 3 * w, std=0.05)
    sd[f"{p}.attn.out_proj.weight"] = _normal(gen, w, w, std=w**-0.5)
    sd[f"{p}.attn.out_proj.bias"] = _normal(gen, w, std=0.05)
    sd.update(_ln(gen, f"{p}.ln_2", w))
    sd[f"{p}.mlp.c_fc.weight"] = _normal(gen, 4 * w, w, std=w**-0.5)
    sd[f"{p}.mlp.c_fc.bias"] = _normal(gen, 4 * w, std=0.05)
    sd[f"{p}.mlp.c_proj.weight"] = _normal(gen, w, 4 * w, std=(4 * w) ** -0.5)
    sd[f"{p}.mlp.c_proj.bias"] = _normal(gen, w, std=0.05)
    return sd


def _timm_block(gen: torch.Generator, p: str, w: int) -> dict[str, torch.Tensor]:
    """timm VisionTransformer block: norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2."""
    sd = _ln(gen, f"{p}.norm1", w)
    sd[f"{p}.attn.qkv.weight"] = _normal(gen, 3 * w, w, std=w**-0.5)
    sd[f"{p}.attn.qkv.bias"] = _normal(gen, 3 * w, std=0.05)
    sd[f"{p}.attn.proj.weight"] = _normal(gen, w, w, std=w**-0.5)
    sd[f"{p}.attn.proj.bias"] = _normal(gen, w, std=0.05)
    sd.update(_ln(gen, f"{p}.norm2", w))
    sd[f"{p}.mlp.fc1.weight"] = _normal(gen, 4 * w, w, std=w**-0.5)
    sd[f"{p}.mlp.fc1.bias"] = _normal(gen, 4 * w, std=0.05)
    sd[f"{p}.mlp.fc2.weight"] = _normal(gen, w, 4 * w, std=(4 * w) ** -0.5)
    sd[f"{p}.mlp.fc2.bias"] = _normal(gen, w, std=0.05)
    return sd


def tiny_meru_state_dict(seed: int = 0, a: dict = TINY_MERU) -> dict[str, torch.Tensor]:
    """`meru.models.MERU(...).state_dict()` layout (timm ViT + MERU text encoder), tiny sizes."""
    gen = torch.Generator().manual_seed(seed)
    w, tw, n = a["width"], a["text_width"], (a["image"] // a["patch"]) ** 2 + 1
    sd = {
        "visual.cls_token": _normal(gen, 1, 1, w, std=0.5),
        "visual.pos_embed": _normal(gen, 1, n, w, std=0.5),
        "visual.patch_embed.proj.weight": _normal(gen, w, 3, a["patch"], a["patch"], std=0.05),
        "visual.patch_embed.proj.bias": _normal(gen, w, std=0.1),
    }
    for i in range(a["depth"]):
        sd.update(_timm_block(gen, f"visual.blocks.{i}", w))
    sd.update(_ln(gen, "visual.norm", w))
    sd["textual.token_embed.weight"] = _normal(gen, a["vocab"], tw, std=0.5)
    sd["textual.posit_embed"] = _normal(gen, a["context"], tw, std=0.3)
    for i in range(a["depth"]):
        sd.update(_clip_block(gen, f"textual.resblocks.{i}", tw))
    sd.update(_ln(gen, "textual.ln_final", tw))
    ctx = a["context"]
    sd["textual.attn_mask"] = torch.triu(torch.full((ctx, ctx), float("-inf")), diagonal=1).bool()
    sd["visual_proj.weight"] = _normal(gen, a["embed"], w, std=w**-0.5)
    sd["textual_proj.weight"] = _normal(gen, a["embed"], tw, std=tw**-0.5)
    sd["logit_scale"] = torch.tensor(SCALARS["logit_scale"]).log()
    sd["curv"] = torch.tensor(SCALARS["curv"]).log()
    sd["visual_alpha"] = torch.tensor(SCALARS["alpha_img"]).log()
    sd["textual_alpha"] = torch.tensor(SCALARS["alpha_txt"]).log()
    sd["pixel_mean"] = torch.tensor(IMAGENET_MEAN).view(-1, 1, 1)
    sd["pixel_std"] = torch.tensor(IMAGENET_STD).view(-1, 1, 1)
    return sd


def tiny_hype_state_dict(seed: int = 1, a: dict = TINY_HYPE) -> dict[str, torch.Tensor]:
    """naver-ai/hype `model.CLIP(...).state_dict()` layout (text tower at the top level), tiny sizes."""
    gen = torch.Generator().manual_seed(seed)
    w, tw, n = a["width"], a["text_width"], (a["image"] // a["patch"]) ** 2 + 1
    sd = {
        "visual.conv1.weight": _normal(gen, w, 3, a["patch"], a["patch"], std=0.05),
        "visual.class_embedding": _normal(gen, w, std=0.5),
        "visual.positional_embedding": _normal(gen, n, w, std=0.5),
    }
    sd.update(_ln(gen, "visual.ln_pre", w))
    for i in range(a["depth"]):
        sd.update(_clip_block(gen, f"visual.transformer.resblocks.{i}", w))
    sd.update(_ln(gen, "visual.ln_post", w))
    sd["visual.proj"] = _normal(gen, w, a["embed"], std=w**-0.5)
    sd["token_embedding.weight"] = _normal(gen, a["vocab"], tw, std=0.5)
    sd["positional_embedding"] = _normal(gen, a["context"], tw, std=0.3)
    for i in range(a["text_depth"]):
        sd.update(_clip_block(gen, f"transformer.resblocks.{i}", tw))
    sd.update(_ln(gen, "ln_final", tw))
    sd["text_projection"] = _normal(gen, tw, a["embed"], std=tw**-0.5)
    sd["logit_scale"] = torch.ones([]) * math.log(SCALARS["logit_scale"])
    sd["curvature"] = torch.ones([]) * math.log(SCALARS["curv"])
    sd["alpha_img"] = torch.ones([]) * math.log(SCALARS["alpha_img"])
    sd["alpha_txt"] = torch.ones([]) * math.log(SCALARS["alpha_txt"])
    return sd


def tiny_config(a: dict, *, name: str, hype: bool) -> dict:
    """The hype config describing a tiny layout (heads are not in a state dict: they come from here)."""
    eps = {"ln_eps": FP32_EPS} if hype else {}
    return {
        "name": name,
        "geometry": "hyperbolic",
        "embed_dim": a["embed"],
        "vision": {
            "image_size": a["image"],
            "patch_size": a["patch"],
            "width": a["width"],
            "layers": a["depth"],
            "head_width": a["width"] // a["heads"],
            "pos_embed": "learnable" if hype else "sincos",
            "ln_pre": hype,
            "patch_bias": not hype,
            **eps,
        },
        "text": {
            "context_length": a["context"],
            "vocab_size": a["vocab"],
            "width": a["text_width"],
            "heads": a["text_heads"],
            "layers": a["text_depth"],
            **eps,
        },
        # The default (OpenAI) mean/std on purpose for MERU: the converter must take ImageNet's from the
        # checkpoint's pixel_mean/pixel_std.
    }


@pytest.fixture()
def meru_yaml(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "tiny-meru.yaml"
    path.write_text(yaml.safe_dump(tiny_config(TINY_MERU, name="tiny-meru", hype=False)))
    return path


@pytest.fixture()
def hype_yaml(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "tiny-hype.yaml"
    path.write_text(yaml.safe_dump(tiny_config(TINY_HYPE, name="tiny-hype", hype=True)))
    return path


# --- independent reference forward (float64, plain tensor ops on the raw source tensors) ----------


def ref_layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def ref_gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def ref_attention(x, w_in, b_in, w_out, b_out, heads, causal):
    B, N, D = x.shape
    d = D // heads
    q, k, v = (x @ w_in.T + b_in).split(D, dim=-1)  # rows of the fused weight: q, k, v

    def split_heads(t):
        return t.reshape(B, N, heads, d).transpose(1, 2)

    q, k, v = split_heads(q), split_heads(k), split_heads(v)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, N, D)
    return out @ w_out.T + b_out


def ref_block(x, p, names, heads, eps, causal):
    """Pre-norm block: x + attn(ln1(x)); x + mlp(ln2(x)). `names` maps roles to source key suffixes."""
    g = {role: p[suffix] for role, suffix in names.items()}
    h = ref_layer_norm(x, g["ln1_w"], g["ln1_b"], eps)
    x = x + ref_attention(h, g["qkv_w"], g["qkv_b"], g["out_w"], g["out_b"], heads, causal)
    h = ref_layer_norm(x, g["ln2_w"], g["ln2_b"], eps)
    return x + ref_gelu(h @ g["fc1_w"].T + g["fc1_b"]) @ g["fc2_w"].T + g["fc2_b"]


TIMM_NAMES = {
    "ln1_w": "norm1.weight",
    "ln1_b": "norm1.bias",
    "qkv_w": "attn.qkv.weight",
    "qkv_b": "attn.qkv.bias",
    "out_w": "attn.proj.weight",
    "out_b": "attn.proj.bias",
    "ln2_w": "norm2.weight",
    "ln2_b": "norm2.bias",
    "fc1_w": "mlp.fc1.weight",
    "fc1_b": "mlp.fc1.bias",
    "fc2_w": "mlp.fc2.weight",
    "fc2_b": "mlp.fc2.bias",
}
CLIP_NAMES = {
    "ln1_w": "ln_1.weight",
    "ln1_b": "ln_1.bias",
    "qkv_w": "attn.in_proj_weight",
    "qkv_b": "attn.in_proj_bias",
    "out_w": "attn.out_proj.weight",
    "out_b": "attn.out_proj.bias",
    "ln2_w": "ln_2.weight",
    "ln2_b": "ln_2.bias",
    "fc1_w": "mlp.c_fc.weight",
    "fc1_b": "mlp.c_fc.bias",
    "fc2_w": "mlp.c_proj.weight",
    "fc2_b": "mlp.c_proj.bias",
}


def _sub(sd, prefix):
    return {k[len(prefix) :]: v.to(F64) for k, v in sd.items() if k.startswith(prefix)}


def ref_patches(images, weight, bias):
    """Patch embedding as a matmul over flattened P×P×3 patches, row-major over the grid."""
    B, C, H, W = images.shape
    D, _, P, _ = weight.shape
    g = H // P
    patches = images.reshape(B, C, g, P, g, P).permute(0, 2, 4, 1, 3, 5).reshape(B, g * g, C * P * P)
    out = patches @ weight.reshape(D, C * P * P).T
    return out if bias is None else out + bias


def ref_exp_map(feats, log_alpha, log_curv):
    """MERU lift: v = α·f, x = sinh(√c|v|) / (√c|v|) · v."""
    v = feats * math.exp(float(log_alpha))
    r = math.sqrt(math.exp(float(log_curv))) * v.norm(dim=-1, keepdim=True)
    return torch.sinh(r) / r * v


def ref_meru_image(sd, images01, a, lift=True):
    """MERU `encode_image(images in [0, 1], project=True)`; lift=False: the CLIP baseline's."""
    s = {k: v.to(F64) for k, v in sd.items() if v.is_floating_point()}
    x = (images01.to(F64) - s["pixel_mean"]) / s["pixel_std"]
    x = ref_patches(x, s["visual.patch_embed.proj.weight"], s["visual.patch_embed.proj.bias"])
    x = torch.cat([s["visual.cls_token"].expand(x.shape[0], -1, -1), x], dim=1) + s["visual.pos_embed"]
    for i in range(a["depth"]):
        x = ref_block(x, _sub(sd, f"visual.blocks.{i}."), TIMM_NAMES, a["heads"], 1e-5, causal=False)
    x = ref_layer_norm(x, s["visual.norm.weight"], s["visual.norm.bias"], 1e-5)[:, 0]
    f = x @ s["visual_proj.weight"].T
    return ref_exp_map(f, sd["visual_alpha"], sd["curv"]) if lift else f / f.norm(dim=-1, keepdim=True)


def ref_meru_text(sd, tokens, a, lift=True):
    s = {k: v.to(F64) for k, v in sd.items() if v.is_floating_point()}
    L = tokens.shape[1]
    x = s["textual.token_embed.weight"][tokens] + s["textual.posit_embed"][:L]
    for i in range(a["text_depth"]):
        x = ref_block(x, _sub(sd, f"textual.resblocks.{i}."), CLIP_NAMES, a["text_heads"], 1e-5, causal=True)
    x = ref_layer_norm(x, s["textual.ln_final.weight"], s["textual.ln_final.bias"], 1e-5)
    x = x[torch.arange(x.shape[0]), tokens.argmax(-1)]  # EOT = the highest token id
    f = x @ s["textual_proj.weight"].T
    return ref_exp_map(f, sd["textual_alpha"], sd["curv"]) if lift else f / f.norm(dim=-1, keepdim=True)


def ref_hype_image(sd, images_normalized, a):
    """naver-ai/hype `expm(encode_image(x), curvature.exp())` (x normalized with OpenAI mean/std)."""
    s = {k: v.to(F64) for k, v in sd.items()}
    x = ref_patches(images_normalized.to(F64), s["visual.conv1.weight"], None)
    cls = s["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = torch.cat([cls, x], dim=1) + s["visual.positional_embedding"]
    x = ref_layer_norm(x, s["visual.ln_pre.weight"], s["visual.ln_pre.bias"], FP32_EPS)
    for i in range(a["depth"]):
        p = _sub(sd, f"visual.transformer.resblocks.{i}.")
        x = ref_block(x, p, CLIP_NAMES, a["heads"], FP32_EPS, causal=False)
    x = ref_layer_norm(x[:, 0], s["visual.ln_post.weight"], s["visual.ln_post.bias"], FP32_EPS)
    return ref_exp_map(x @ s["visual.proj"], sd["alpha_img"], sd["curvature"])


def ref_hype_text(sd, tokens, a):
    s = {k: v.to(F64) for k, v in sd.items()}
    x = s["token_embedding.weight"][tokens] + s["positional_embedding"][: tokens.shape[1]]
    for i in range(a["text_depth"]):
        p = _sub(sd, f"transformer.resblocks.{i}.")
        x = ref_block(x, p, CLIP_NAMES, a["text_heads"], FP32_EPS, causal=True)
    x = ref_layer_norm(x, s["ln_final.weight"], s["ln_final.bias"], FP32_EPS)
    x = x[torch.arange(x.shape[0]), tokens.argmax(-1)]
    return ref_exp_map(x @ s["text_projection"], sd["alpha_txt"], sd["curvature"])


def random_tokens(a: dict, batch: int = 5, seed: int = 3) -> torch.Tensor:
    """CLIP-like token rows: text ids, then EOT (the highest id) at varying positions, then padding 0."""
    gen = torch.Generator().manual_seed(seed)
    ctx, eot = a["context"], a["vocab"] - 1
    tokens = torch.zeros(batch, ctx, dtype=torch.long)
    for row, length in enumerate([1, 4, 7, ctx - 1, 10][:batch]):
        tokens[row, :length] = torch.randint(1, eot, (length,), generator=gen)
        tokens[row, length] = eot
    return tokens


def _normalize(images01: torch.Tensor, mean, std) -> torch.Tensor:
    m = torch.tensor(mean, dtype=images01.dtype).view(-1, 1, 1)
    s = torch.tensor(std, dtype=images01.dtype).view(-1, 1, 1)
    return (images01 - m) / s


def _save(path: pathlib.Path, obj) -> pathlib.Path:
    torch.save(obj, path)
    return path


# --- MERU ---------------------------------------------------------------------------------------


def test_meru_matches_reference_forward(tmp_path, meru_yaml):
    sd = tiny_meru_state_dict()
    # MERU's CheckpointManager layout; `iteration` is training state that is reported, not converted.
    ckpt = _save(tmp_path / "meru_tiny.pth", {"model": sd, "iteration": 120000})
    report = convert_meru(ckpt, tmp_path / "out" / "meru.safetensors", model_config=meru_yaml)
    assert report.ignored_top_level == ["iteration"]
    assert report.source_tensors == len(sd)
    assert report.scalars == pytest.approx(
        {"curvature": 0.37, "alpha_img": 0.081, "alpha_txt": 0.093, "logit_scale": 42.0}, rel=1e-6
    )
    assert not list((tmp_path / "out").glob(".*tmp*")), "temporary file left behind"

    model = load_checkpoint(tmp_path / "out" / "meru.safetensors")
    # MERU normalizes inside the model; hype moves the checkpoint's mean/std into `preprocess`.
    assert model.config.preprocess.mean == pytest.approx(IMAGENET_MEAN, abs=1e-7)
    assert model.config.preprocess.std == pytest.approx(IMAGENET_STD, abs=1e-7)
    assert any("mean/std taken from the checkpoint" in n for n in report.notes)
    assert model.config.vision.ln_pre is False and model.config.vision.patch_bias is True

    gen = torch.Generator().manual_seed(7)
    images01 = torch.rand(3, 3, TINY_MERU["image"], TINY_MERU["image"], generator=gen, dtype=F64)
    tokens = random_tokens(TINY_MERU)
    want_img = ref_meru_image(sd, images01, TINY_MERU)
    want_txt = ref_meru_text(sd, tokens, TINY_MERU)
    assert want_img.norm(dim=-1).min() > 0.1 and want_txt.norm(dim=-1).min() > 0.1  # a non-trivial test

    p = model.config.preprocess
    with torch.no_grad():
        # float64 on both sides: the mapping must be exact, not merely close. The images are normalized
        # with the checkpoint's own fp32 buffers, as MERU does; the config holds the same constants
        # rounded to 8 digits (0.485, not 0.48500001...), checked above.
        m64 = load_checkpoint(tmp_path / "out" / "meru.safetensors").double()
        own = (images01 - sd["pixel_mean"].double()) / sd["pixel_std"].double()
        torch.testing.assert_close(m64.encode_image(own), want_img, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(m64.encode_text(tokens), want_txt, rtol=1e-9, atol=1e-12)
        # float32, as the model is used, with its own preprocess constants.
        got32 = model.encode_image(_normalize(images01.float(), p.mean, p.std))
        torch.testing.assert_close(got32.double(), want_img, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.encode_text(tokens).double(), want_txt, rtol=1e-4, atol=1e-5)

    meta = read_checkpoint_metadata(tmp_path / "out" / "meru.safetensors")
    assert meta["extra"]["converted_from"]["kind"] == "MERU"
    assert meta["extra"]["converted_from"]["source"] == str(ckpt)


def test_meru_accepts_api_dict_config_fp16_and_ddp_prefix(tmp_path):
    sd = tiny_meru_state_dict(seed=5)
    half = {f"module.{k}": (v.half() if v.is_floating_point() else v) for k, v in sd.items()}
    ckpt = _save(tmp_path / "half.pt", {"model": half})
    config = tiny_config(TINY_MERU, name="tiny-meru", hype=False)
    report = convert_meru(ckpt, tmp_path / "half.safetensors", model_config=config)
    assert "float16" in report.source_dtypes
    model = load_checkpoint(tmp_path / "half.safetensors")
    assert model.visual.conv1.weight.dtype == torch.float32
    expected = {k: v.half().float() if v.is_floating_point() else v for k, v in sd.items()}
    tokens = random_tokens(TINY_MERU)
    with torch.no_grad():
        torch.testing.assert_close(
            model.double().encode_text(tokens),
            ref_meru_text(expected, tokens, TINY_MERU),
            rtol=1e-9,
            atol=1e-12,
        )


def test_meru_scalars_outside_bounds_are_kept_and_reported(tmp_path, meru_yaml):
    """MERU clamps its scalars only in `forward` (training); its encoders use the stored values. The
    converted model does too: its config's bounds are widened to hold them, and the report says so."""
    sd = tiny_meru_state_dict()
    sd["curv"] = torch.tensor(0.05).log()  # below MERU's lower clamp 0.1
    out = tmp_path / "m.safetensors"
    report = convert_meru(_save(tmp_path / "m.pt", {"model": sd}), out, model_config=meru_yaml)
    assert report.stored_scalars["curvature"] == pytest.approx(0.05, rel=1e-6)
    assert report.scalars["curvature"] == pytest.approx(0.05, rel=1e-6)
    assert any("curvature" in n and "outside" in n and "curv_min" in n for n in report.notes)
    model = load_checkpoint(out).double()
    assert model.config.scalars.curv_min == pytest.approx(0.05, rel=1e-6)
    tokens = random_tokens(TINY_MERU)
    with torch.no_grad():
        torch.testing.assert_close(
            model.encode_text(tokens), ref_meru_text(sd, tokens, TINY_MERU), rtol=1e-9, atol=1e-12
        )


# --- HYPE release -------------------------------------------------------------------------------


def test_hype_release_matches_reference_forward(tmp_path, hype_yaml):
    sd = tiny_hype_state_dict()
    ckpt = _save(tmp_path / "ckpt.pt", sd)  # the release is a flat state dict
    report = convert_hype_release(ckpt, tmp_path / "hype.safetensors", model_config=hype_yaml)
    assert report.ignored_top_level == [] and report.notes == []
    assert report.scalars["curvature"] == pytest.approx(0.37, rel=1e-6)

    model = load_checkpoint(tmp_path / "hype.safetensors")
    assert model.config.preprocess.mean == pytest.approx(OPENAI_MEAN)
    assert model.config.preprocess.std == pytest.approx(OPENAI_STD)
    gen = torch.Generator().manual_seed(11)
    images01 = torch.rand(3, 3, TINY_HYPE["image"], TINY_HYPE["image"], generator=gen, dtype=F64)
    images = _normalize(images01, OPENAI_MEAN, OPENAI_STD)
    tokens = random_tokens(TINY_HYPE)
    want_img, want_txt = ref_hype_image(sd, images, TINY_HYPE), ref_hype_text(sd, tokens, TINY_HYPE)
    with torch.no_grad():
        m64 = load_checkpoint(tmp_path / "hype.safetensors").double()
        torch.testing.assert_close(m64.encode_image(images), want_img, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(m64.encode_text(tokens), want_txt, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(
            model.encode_image(images.float()).double(), want_img, rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(model.encode_text(tokens).double(), want_txt, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("curv", [12.0, 0.05])
def test_hype_release_scalars_outside_the_bounds_are_used_as_stored(tmp_path, hype_yaml, curv):
    """The release's inference uses its stored curvature, α and logit scale as they are (it clamps only
    while training): a converted release with values outside hype's bounds (curvature [0.1, 10], α <= 1,
    logit scale <= 100) embeds exactly as the release's formulas do with the stored values."""
    sd = tiny_hype_state_dict()
    stored = {"curvature": curv, "alpha_img": 1.05, "alpha_txt": 1.1, "logit_scale": 150.0}
    sd.update({k: torch.tensor(v).log() for k, v in stored.items()})
    # Smaller projections keep sqrt(c)·|α·f| far below the exponential map's overflow guard.
    sd["visual.proj"], sd["text_projection"] = sd["visual.proj"] * 0.05, sd["text_projection"] * 0.05
    out = tmp_path / "h.safetensors"
    report = convert_hype_release(_save(tmp_path / "ckpt.pt", sd), out, model_config=hype_yaml)
    assert report.scalars == pytest.approx(stored, rel=1e-6)
    assert report.stored_scalars == pytest.approx(stored, rel=1e-6)
    assert len([n for n in report.notes if "outside" in n]) == 4, report.notes
    model = load_checkpoint(out)
    assert model.logit_scale.item() == pytest.approx(150.0, rel=1e-6)
    gen = torch.Generator().manual_seed(5)
    images = torch.randn(3, 3, TINY_HYPE["image"], TINY_HYPE["image"], generator=gen, dtype=F64)
    tokens = random_tokens(TINY_HYPE)
    want_img, want_txt = ref_hype_image(sd, images, TINY_HYPE), ref_hype_text(sd, tokens, TINY_HYPE)
    with torch.no_grad():
        m64 = load_checkpoint(out).double()
        torch.testing.assert_close(m64.encode_image(images), want_img, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(m64.encode_text(tokens), want_txt, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(
            model.encode_image(images.float()).double(), want_img, rtol=1e-4, atol=1e-5
        )


def test_hype_release_preprocesses_by_squashing_as_the_release_does(tmp_path, hype_yaml):
    """The release's `model_init` builds torchvision's `Resize((224, 224), BICUBIC)` + `CenterCrop((224,
    224))` (its image_size is a tuple): a non-square photo is squashed, not center-cropped. Every
    preprocessing path hype has (the model's
    transform, the scorer's and eval's `Preprocess`, the open_clip export) does the same."""
    import numpy as np
    from PIL import Image
    from torchvision import transforms as T

    from hype.convert.open_clip import export_open_clip
    from hype.data.imageprep import Preprocess

    out = tmp_path / "h.safetensors"
    convert_hype_release(_save(tmp_path / "ckpt.pt", tiny_hype_state_dict()), out, model_config=hype_yaml)
    model = load_checkpoint(out)
    size = TINY_HYPE["image"]
    gen = np.random.default_rng(0)
    photo = Image.fromarray(gen.integers(0, 256, (38, 50, 3), dtype=np.uint8))  # 50 x 38, landscape
    bicubic = T.InterpolationMode.BICUBIC
    release = T.Compose(
        [
            T.Resize((size, size), interpolation=bicubic),
            T.CenterCrop((size, size)),
            T.ToTensor(),
            T.Normalize(OPENAI_MEAN, OPENAI_STD),
        ]
    )
    want = release(photo)
    assert torch.equal(model.preprocess(train=False)(photo), want)
    prep = Preprocess.of(model)
    torch.testing.assert_close(prep.batch([prep.pixels(photo)], "cpu")[0], want, rtol=0, atol=1e-6)
    cropped = T.Compose(
        [T.Resize(size, bicubic), T.CenterCrop(size), T.ToTensor(), T.Normalize(OPENAI_MEAN, OPENAI_STD)]
    )
    assert (cropped(photo) - want).abs().max() > 0.1  # the two geometries really differ on this photo
    export_open_clip(out, tmp_path / "exported")
    pre = json.loads((tmp_path / "exported" / "open_clip_config.json").read_text())["preprocess_cfg"]
    assert (pre["resize_mode"], pre["interpolation"]) == ("squash", "bicubic")


def test_hype_release_ln_eps_matters(tmp_path):
    """With open_clip's default eps 1e-5 instead of the release's fp32 eps the embeddings move: the
    float64 comparison above really checks the eps."""
    sd = tiny_hype_state_dict()
    config = tiny_config(TINY_HYPE, name="tiny-hype-eps", hype=True)
    config["vision"]["ln_eps"] = config["text"]["ln_eps"] = 1e-5
    report = convert_hype_release(
        _save(tmp_path / "c.pt", sd), tmp_path / "c.safetensors", model_config=config
    )
    assert any("ln_eps" in n for n in report.notes)
    model = load_checkpoint(tmp_path / "c.safetensors").double()
    tokens = random_tokens(TINY_HYPE)
    with torch.no_grad():
        diff = (model.encode_text(tokens) - ref_hype_text(sd, tokens, TINY_HYPE)).abs().max()
    assert diff > 1e-9


def test_hype_release_wrappers(tmp_path, hype_yaml):
    sd = tiny_hype_state_dict()
    ctx = TINY_HYPE["context"]
    mask = torch.empty(ctx, ctx).fill_(float("-inf")).triu_(1)  # OpenAI's stored float causal mask
    wrapped = {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in {**sd, "attn_mask": mask}.items()}}
    report = convert_hype_release(
        _save(tmp_path / "w.pt", wrapped), tmp_path / "w.safetensors", model_config=hype_yaml
    )
    assert report.ignored_top_level == ["epoch"]
    a = load_checkpoint(tmp_path / "w.safetensors").state_dict()
    convert_hype_release(
        _save(tmp_path / "flat.pt", sd), tmp_path / "flat.safetensors", model_config=hype_yaml
    )
    b = load_checkpoint(tmp_path / "flat.safetensors").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- full-size layouts (meta device: no memory) ---------------------------------------------------


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def released_meru_shapes(width: int, depth: int) -> dict[str, torch.Tensor]:
    """Key -> tensor of MERU ViT-{S,B,L}/16 as released (224 px, 512-wide 12-layer text, embed 512)."""
    sd = {
        "visual.cls_token": _meta(1, 1, width),
        "visual.pos_embed": _meta(1, 197, width),
        "visual.patch_embed.proj.weight": _meta(width, 3, 16, 16),
        "visual.patch_embed.proj.bias": _meta(width),
        "visual.norm.weight": _meta(width),
        "visual.norm.bias": _meta(width),
    }
    for i in range(depth):
        p = f"visual.blocks.{i}."
        sd.update({p + n: _meta(width) for n in ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias")})
        sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"] = _meta(3 * width, width), _meta(3 * width)
        sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"] = _meta(width, width), _meta(width)
        sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"] = _meta(4 * width, width), _meta(4 * width)
        sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"] = _meta(width, 4 * width), _meta(width)
    sd["textual.token_embed.weight"] = _meta(49408, 512)
    sd["textual.posit_embed"] = _meta(77, 512)
    for i in range(12):
        p = f"textual.resblocks.{i}."
        sd.update({p + n: _meta(512) for n in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias")})
        sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"] = _meta(1536, 512), _meta(1536)
        sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"] = _meta(512, 512), _meta(512)
        sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = _meta(2048, 512), _meta(2048)
        sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = _meta(512, 2048), _meta(512)
    sd["textual.ln_final.weight"], sd["textual.ln_final.bias"] = _meta(512), _meta(512)
    sd["visual_proj.weight"], sd["textual_proj.weight"] = _meta(512, width), _meta(512, 512)
    sd.update({k: _meta() for k in ("logit_scale", "curv", "visual_alpha", "textual_alpha")})
    # Buffers whose values the converter inspects are real (small) tensors.
    sd["textual.attn_mask"] = torch.ones(77, 77, dtype=torch.bool).triu(1)
    sd["pixel_mean"] = torch.tensor(IMAGENET_MEAN).view(-1, 1, 1)
    sd["pixel_std"] = torch.tensor(IMAGENET_STD).view(-1, 1, 1)
    return sd


@pytest.mark.parametrize(
    ("width", "depth", "name"),
    [
        *((384, 12, f"meru{k}-vit-s16") for k in ("", "-clip")),
        *((768, 12, f"meru{k}-vit-b16") for k in ("", "-clip")),
        (1024, 24, "meru-vit-l16"),
        (1024, 24, "meru-clip-vit-l16"),
    ],
)
def test_released_meru_layouts_map_completely(width, depth, name):
    """MERU's and HyCoCLIP's releases; a CLIP baseline (no curvature or α) is inferred as meru-clip-*."""
    sd = released_meru_shapes(width, depth)
    if "-clip-" in name:
        sd = {k: v for k, v in sd.items() if k not in ("curv", "visual_alpha", "textual_alpha")}
    config, mapped, details = meru_state_dict_to_hype(sd)  # no config: inferred from width and depth
    assert config.name == name and details["config_origin"].startswith("inferred")
    assert details["notes"] == []  # ImageNet mean/std already in the shipped config
    target = create_model(name, device="meta").state_dict()
    assert mapped.keys() == target.keys()
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in target.items()}


def test_released_hype_layout_maps_completely():
    sd = {
        "visual.conv1.weight": _meta(1024, 3, 14, 14),
        "visual.class_embedding": _meta(1024),
        "visual.positional_embedding": _meta(257, 1024),
        "visual.ln_pre.weight": _meta(1024),
        "visual.ln_pre.bias": _meta(1024),
        "visual.ln_post.weight": _meta(1024),
        "visual.ln_post.bias": _meta(1024),
        "visual.proj": _meta(1024, 768),
        "token_embedding.weight": _meta(49408, 768),
        "positional_embedding": _meta(77, 768),
        "ln_final.weight": _meta(768),
        "ln_final.bias": _meta(768),
        "text_projection": _meta(768, 768),
        **{k: _meta() for k in ("logit_scale", "curvature", "alpha_img", "alpha_txt")},
    }
    for prefix, w, depth in (
        ("visual.transformer.resblocks.", 1024, 24),
        ("transformer.resblocks.", 768, 12),
    ):
        for i in range(depth):
            p = f"{prefix}{i}."
            sd.update({p + n: _meta(w) for n in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias")})
            sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"] = _meta(3 * w, w), _meta(3 * w)
            sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"] = _meta(w, w), _meta(w)
            sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = _meta(4 * w, w), _meta(4 * w)
            sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = _meta(w, 4 * w), _meta(w)
    config, mapped, details = hype_release_state_dict_to_hype(sd)
    assert config.name == "hype-meru-vit-l14" and details["notes"] == []
    assert config.vision.heads == 16 and config.vision.ln_eps == FP32_EPS == config.text.ln_eps
    target = create_model("hype-meru-vit-l14", device="meta").state_dict()
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in target.items()}


# --- refusals and errors ------------------------------------------------------------------------


class _Payload:
    """A pickled object whose unpickling would create a file: proves nothing was executed."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_pickled_objects_are_refused_without_running_them(tmp_path):
    marker = tmp_path / "executed"
    ckpt = _save(tmp_path / "evil.pth", {"model": tiny_meru_state_dict(), "extra": _Payload(marker)})
    with pytest.raises(ConversionError, match="pickled Python objects.*will not execute"):
        convert_meru(ckpt, tmp_path / "x.safetensors")
    with pytest.raises(ConversionError, match="pickled"):
        convert_hype_release(ckpt, tmp_path / "x.safetensors")
    assert not marker.exists()
    assert not (tmp_path / "x.safetensors").exists()


def test_unreadable_and_foreign_files(tmp_path, meru_yaml):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"definitely not a checkpoint")
    with pytest.raises(ConversionError, match=r"junk\.pt: not a .*PyTorch checkpoint"):
        convert_meru(junk, tmp_path / "o.safetensors")
    with pytest.raises(ConversionError, match="not found"):
        convert_meru(tmp_path / "absent.pt", tmp_path / "o.safetensors")
    with pytest.raises(ConversionError, match="expected a dict of tensors"):
        convert_meru(_save(tmp_path / "list.pt", [torch.zeros(1)]), tmp_path / "o.safetensors")
    hype_ckpt = _save(tmp_path / "hype.pt", tiny_hype_state_dict())
    with pytest.raises(ConversionError, match="hype convert hype-release"):
        convert_meru(hype_ckpt, tmp_path / "o.safetensors")
    meru_ckpt = _save(tmp_path / "meru.pt", {"model": tiny_meru_state_dict()})
    with pytest.raises(ConversionError, match="hype convert meru"):
        convert_hype_release(meru_ckpt, tmp_path / "o.safetensors")


def test_missing_and_unexpected_keys_are_named(tmp_path, meru_yaml):
    sd = tiny_meru_state_dict()
    del sd["visual.blocks.1.mlp.fc2.bias"]
    del sd["textual_alpha"]
    sd["visual.head.weight"] = torch.zeros(10, 64)
    ckpt = _save(tmp_path / "bad.pt", {"model": sd})
    with pytest.raises(ConversionError) as e:
        convert_meru(ckpt, tmp_path / "o.safetensors", model_config=meru_yaml)
    msg = str(e.value)
    assert str(ckpt) in msg
    assert "missing keys (2): visual.blocks.1.mlp.fc2.bias, textual_alpha" in msg
    assert "unexpected keys (1): visual.head.weight" in msg
    assert "--ignore-key" in msg
    assert not (tmp_path / "o.safetensors").exists()


def test_ignore_key_drops_only_unexpected_keys(tmp_path, meru_yaml):
    sd = tiny_meru_state_dict()
    sd["visual.head.weight"] = torch.zeros(10, 64)
    ckpt = _save(tmp_path / "extra.pt", {"model": sd})
    report = convert_meru(
        ckpt, tmp_path / "o.safetensors", model_config=meru_yaml, ignore_keys=["visual.head.*"]
    )
    assert report.ignored_keys == ["visual.head.weight"]
    # A pattern cannot hide a missing key.
    del sd["curv"]
    with pytest.raises(ConversionError, match="missing keys \\(1\\): curv"):
        convert_meru(
            _save(tmp_path / "m.pt", {"model": sd}),
            tmp_path / "o2.safetensors",
            model_config=meru_yaml,
            ignore_keys=["*"],
        )


def test_wrong_shapes_name_key_and_both_shapes(tmp_path, meru_yaml):
    sd = tiny_meru_state_dict()
    sd["visual_proj.weight"] = torch.zeros(32, 65)
    sd["textual.ln_final.bias"] = torch.zeros(47)
    with pytest.raises(ConversionError) as e:
        convert_meru(
            _save(tmp_path / "s.pt", {"model": sd}), tmp_path / "o.safetensors", model_config=meru_yaml
        )
    msg = str(e.value)
    assert "visual_proj.weight has shape (32, 65), expected (32, 64)" in msg
    assert "textual.ln_final.bias has shape (47,), expected (48,)" in msg


def test_non_causal_mask_is_refused(tmp_path, meru_yaml):
    sd = tiny_meru_state_dict()
    sd["textual.attn_mask"] = torch.zeros_like(sd["textual.attn_mask"])
    with pytest.raises(ConversionError, match="textual.attn_mask is not the causal text mask"):
        convert_meru(
            _save(tmp_path / "n.pt", {"model": sd}), tmp_path / "o.safetensors", model_config=meru_yaml
        )


def test_config_mismatch_and_uninferable_size(tmp_path):
    ckpt = _save(tmp_path / "tiny.pt", {"model": tiny_meru_state_dict()})
    with pytest.raises(ConversionError, match=r"meru-vit-b16.*vision\.width = 64 in the checkpoint, 768"):
        convert_meru(ckpt, tmp_path / "o.safetensors", model_config="meru-vit-b16")
    with pytest.raises(ConversionError, match="no shipped MERU config.*--model-config"):
        convert_meru(ckpt, tmp_path / "o.safetensors")
    with pytest.raises(ConversionError, match="geometry 'clip'"):
        convert_meru(ckpt, tmp_path / "o.safetensors", model_config="clip-vit-b16")
    # A config whose layout differs (ln_pre, no patch bias) is caught even at matching sizes.
    config = tiny_config(TINY_MERU, name="tiny-wrong", hype=False)
    config["vision"].update(ln_pre=True, patch_bias=False)
    with pytest.raises(ConversionError) as e:
        convert_meru(ckpt, tmp_path / "o.safetensors", model_config=config)
    assert "visual.patch_embed.proj.bias -> visual.conv1.bias" in str(e.value)
    assert "visual.ln_pre.weight" in str(e.value)


def test_output_is_protected(tmp_path, meru_yaml):
    ckpt = _save(tmp_path / "m.pt", {"model": tiny_meru_state_dict()})
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(ConversionError, match="already exists; pass --overwrite"):
        convert_meru(ckpt, out, model_config=meru_yaml)
    assert out.read_bytes() == b"keep me"
    convert_meru(ckpt, out, model_config=meru_yaml, overwrite=True)
    assert load_checkpoint(out).config.name == "tiny-meru"
    with pytest.raises(ConversionError, match="overwrite the source"):
        convert_meru(ckpt, ckpt, model_config=meru_yaml, overwrite=True)


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_meru_and_hype_release(tmp_path, meru_yaml, hype_yaml):
    runner = CliRunner()
    ckpt = _save(tmp_path / "meru.pth", {"model": tiny_meru_state_dict()})
    out = tmp_path / "meru.safetensors"
    args = ["convert", "meru", str(ckpt), "--out", str(out), "--model-config", str(meru_yaml)]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    for text in ("Converted MERU checkpoint", "curvature      0.37", "image 0.081", "logit scale    42"):
        assert text in result.output
    assert load_checkpoint(out).config.name == "tiny-meru"

    result = runner.invoke(main, args)  # exists now
    assert result.exit_code == 1 and "--overwrite" in result.output

    result = runner.invoke(main, [*args, "--overwrite", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["kind"] == "MERU" and summary["scalars"]["alpha_txt"] == pytest.approx(0.093)

    hype_ckpt = _save(tmp_path / "ckpt.pt", tiny_hype_state_dict())
    result = runner.invoke(
        main,
        [
            "convert",
            "hype-release",
            str(hype_ckpt),
            "--out",
            str(tmp_path / "h.safetensors"),
            "--model-config",
            str(hype_yaml),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Converted HYPE release checkpoint" in result.output

    result = runner.invoke(
        main, ["convert", "meru", str(hype_ckpt), "--out", str(tmp_path / "z.safetensors")]
    )
    assert result.exit_code == 1 and "Error:" in result.output and "hype-release" in result.output
    result = runner.invoke(main, ["convert", "--help"])
    assert result.exit_code == 0 and "meru" in result.output and "hype-release" in result.output


def test_a_hype_checkpoint_is_recognized(tmp_path, meru_yaml):
    ckpt = _save(tmp_path / "m.pt", {"model": tiny_meru_state_dict()})
    out = tmp_path / "m.safetensors"
    convert_meru(ckpt, out, model_config=meru_yaml)
    for convert in (convert_meru, convert_hype_release):
        with pytest.raises(ConversionError, match="already a hype checkpoint.*load_checkpoint"):
            convert(out, tmp_path / "again.safetensors")


def test_torch_load_is_refused_on_a_torch_with_the_weights_only_bypass(tmp_path, monkeypatch, meru_yaml):
    """torch.load(weights_only=True) could run code before torch 2.6 (CVE-2025-32434): on such a torch a
    .pt file is refused before torch.load sees it, with the upgrade to make; safetensors still load."""
    ckpt = _save(tmp_path / "m.pt", {"model": tiny_meru_state_dict()})
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(ConversionError, match=r"m\.pt: .*torch 2\.5\.1\+cpu.*CVE-2025-32434.*torch>=2\.6"):
        convert_meru(ckpt, tmp_path / "o.safetensors", model_config=meru_yaml)
    assert not (tmp_path / "o.safetensors").exists()
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    convert_meru(ckpt, tmp_path / "o.safetensors", model_config=meru_yaml)


def _zip_with(members: dict[str, bytes]) -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


MALFORMED_SOURCES = {
    "5 bytes": b"abcde",
    "empty": b"",
    "pickle cut short": b"\x80\x02}q\x00(X\x01\x00\x00\x00a",
    "zip of garbage": _zip_with({"a/data.pkl": b"garbage", "a/version": b"3"}),
    "torchscript of garbage": _zip_with(
        {"a/data.pkl": b"\x80\x02garbage", "a/constants.pkl": b"", "a/code/x.py": b""}
    ),
    "safetensors header cut": b"\x40\x00\x00\x00\x00\x00\x00\x00{",
    "safetensors bad entry": b"\x0c\x00\x00\x00\x00\x00\x00\x00" + b'{"t": 5}    ',
}


@pytest.mark.parametrize("name", list(MALFORMED_SOURCES))
@pytest.mark.parametrize("command", ["meru", "hycoclip", "hype-release", "open-clip"])
def test_a_malformed_source_is_the_commands_clear_error(tmp_path, name, command):
    src = tmp_path / "bad.pt"
    src.write_bytes(MALFORMED_SOURCES[name])
    result = CliRunner().invoke(
        main, ["convert", command, str(src), "--out", str(tmp_path / "o.safetensors")]
    )
    assert result.exit_code == 1 and f"Error: {src}: " in result.output, (result.output, result.exception)
    assert not (tmp_path / "o.safetensors").exists()


# --- HyCoCLIP's release (PalAvik/hycoclip): HyCoCLIP, MERU and CLIP baselines in MERU's layout --------


def test_hycoclip_release_kinds_convert_and_match_the_reference_forward(tmp_path, meru_yaml):
    """`hype convert hycoclip`: HyCoCLIP's (and its MERU's) checkpoints are MERU's layout; its CLIP
    baseline is the same towers without curvature and α (cosine geometry, `meru-clip-vit-*16`)."""
    runner = CliRunner()
    sd = tiny_meru_state_dict(seed=11)
    ckpt = _save(tmp_path / "hycoclip_vit_tiny.pth", {"model": sd, "iteration": 500000})
    out = tmp_path / "hycoclip.safetensors"
    result = runner.invoke(
        main, ["convert", "hycoclip", str(ckpt), "--out", str(out), "--model-config", str(meru_yaml)]
    )
    assert result.exit_code == 0 and "curvature      0.37" in result.output, result.output

    clip_sd = {k: v for k, v in sd.items() if k not in ("curv", "visual_alpha", "textual_alpha")}
    clip_yaml = tmp_path / "tiny-meru-clip.yaml"
    clip_yaml.write_text(
        yaml.safe_dump(
            {**yaml.safe_load(meru_yaml.read_text()), "name": "tiny-meru-clip", "geometry": "clip"}
        )
    )
    clip_ckpt = _save(tmp_path / "clip_vit_tiny.pth", {"model": clip_sd})
    clip_out = tmp_path / "clip.safetensors"
    args = ["convert", "hycoclip", str(clip_ckpt), "--out", str(clip_out)]
    result = runner.invoke(main, [*args, "--model-config", str(clip_yaml), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["kind"] == "MERU/HyCoCLIP CLIP baseline" and summary["scalars"] == {
        "logit_scale": pytest.approx(42.0)
    }
    # A hyperbolic config for a checkpoint without curvature is refused with the fix.
    result = runner.invoke(main, [*args, "--overwrite", "--model-config", str(meru_yaml)])
    assert result.exit_code == 1 and "meru-clip-vit-b16" in result.output

    gen = torch.Generator().manual_seed(8)
    images01 = torch.rand(3, 3, TINY_MERU["image"], TINY_MERU["image"], generator=gen, dtype=F64)
    tokens = random_tokens(TINY_MERU)
    own = (images01 - sd["pixel_mean"].double()) / sd["pixel_std"].double()
    with torch.no_grad():
        for path, lift in ((out, True), (clip_out, False)):
            m64 = load_checkpoint(path).double()
            want_img, want_txt = (
                ref_meru_image(sd, images01, TINY_MERU, lift),
                ref_meru_text(sd, tokens, TINY_MERU, lift),
            )
            torch.testing.assert_close(m64.encode_image(own), want_img, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(m64.encode_text(tokens), want_txt, rtol=1e-9, atol=1e-12)
        clip = load_checkpoint(clip_out).double()
        # The baseline's logit: the stored scale (fp32 log 42) times the cosine, as CLIPBaseline computes it.
        torch.testing.assert_close(
            clip.logit_scale * clip.geometry.pairwise(clip.encode_image(own), clip.encode_text(tokens)),
            42.0
            * ref_meru_image(sd, images01, TINY_MERU, False)
            @ ref_meru_text(sd, tokens, TINY_MERU, False).T,
            rtol=1e-7,
            atol=0,
        )


def test_hycoclip_wrong_layout_or_truncated_file_is_a_clear_error(tmp_path):
    """A HYPE-release file given to `hype convert hycoclip` names the right command; a release file cut
    short (an interrupted download) is a one-line error naming it; neither writes the output."""
    runner, out = CliRunner(), tmp_path / "o.safetensors"
    wrong = _save(tmp_path / "hype_release.pt", tiny_hype_state_dict())
    result = runner.invoke(main, ["convert", "hycoclip", str(wrong), "--out", str(out)])
    assert result.exit_code == 1 and "hype convert hype-release" in result.output, result.output
    full = _save(tmp_path / "full.pth", {"model": tiny_meru_state_dict(), "iteration": 500000}).read_bytes()
    cut = tmp_path / "hycoclip_vit_s.pth"
    cut.write_bytes(full[: len(full) // 2])
    result = runner.invoke(main, ["convert", "hycoclip", str(cut), "--out", str(out)])
    assert result.exit_code == 1 and f"Error: {cut}: " in result.output, (result.output, result.exception)
    assert result.output.count("\n") == 1 and not out.exists()


def test_a_converted_hycoclip_scores_a_pool(tmp_path, tmp_path_factory, meru_yaml):
    """`hype score --meru <converted HyCoCLIP>`: the converted file is a hype MERU checkpoint."""
    from test_score_support import models, run_cli, score_args, world

    a = dict(TINY_MERU, vocab=49408, context=77)  # the real tokenizer's ids and length
    config = yaml.safe_load(meru_yaml.read_text())
    config["text"].update(vocab_size=49408, context_length=77)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    ckpt = _save(tmp_path / "hycoclip_vit_tiny.pth", {"model": tiny_meru_state_dict(seed=12, a=a)})
    convert_meru(ckpt, tmp_path / "hycoclip.safetensors", model_config=tmp_path / "c.yaml")
    result = run_cli(
        score_args(
            world(tmp_path_factory),
            tmp_path / "hycoclip.safetensors",
            models(tmp_path_factory)[1],
            tmp_path / "run",
        )
    )
    assert result.exit_code == 0, result.output
    import pyarrow.dataset as ds

    scores = ds.dataset(tmp_path / "run" / "scores", format="parquet").to_table().to_pandas()
    assert len(scores) > 100
    for col in ("eps_i", "eps_t", "neg_d_l", "cos_theta"):
        assert scores[col].notna().all() and (scores[col].abs() < 1e6).all() and scores[col].std() > 0

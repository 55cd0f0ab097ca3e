"""hype.models: configs, towers, ContrastiveModel, factory. CPU-only, no weights, no network."""

from __future__ import annotations

import dataclasses
import json
import math
import socket

import open_clip
import pytest
import torch
import yaml
from PIL import Image
from torch import nn

from hype.geometry import GEOMETRIES
from hype.models import (
    ConfigError,
    ContrastiveModel,
    ModelConfig,
    create_model,
    list_model_configs,
    load_model_config,
    sincos_2d_table,
)

TINY = [
    "tiny-clip",
    "tiny-elliptic",
    "tiny-euclidean",
    "tiny-euclidean-squared",
    "tiny-hyperbolic",
    "tiny-hyperbolic-squared",
    "tiny-oblique",
    "tiny-oblique-multi",
]
CAPTIONS = ["a red square", "two small blue circles on a white background", "photo", "a green triangle"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def tokens_tiny() -> torch.Tensor:
    return open_clip.tokenizer.SimpleTokenizer(context_length=32)(CAPTIONS)


def _images(n: int = 3, size: int = 64) -> torch.Tensor:
    return torch.randn(n, 3, size, size)


def _build(name: str) -> ContrastiveModel:
    torch.manual_seed(0)
    return create_model(name)


# --- tiny models: shapes, manifolds, similarity, gradients ------------------------------------------


def test_tiny_configs_are_shipped():
    assert set(TINY) <= set(list_model_configs())


@pytest.mark.parametrize("name", TINY)
def test_embeddings_lie_on_the_manifold(name, tokens_tiny):
    model = _build(name).eval()
    g = model.geometry
    images = _images()
    with torch.no_grad():
        img, txt = model.encode_image(images), model.encode_text(tokens_tiny)
        feats_img, feats_txt = model.visual(images), model.text(tokens_tiny)
        sim = model.similarity(img, txt)
    n = model.config.embed_dim
    assert img.shape == (3, n) and txt.shape == (len(CAPTIONS), n)
    assert img.dtype == txt.dtype == torch.float32
    assert torch.isfinite(img).all() and torch.isfinite(txt).all()
    assert sim.shape == (3, len(CAPTIONS))
    assert torch.equal(sim, g.pairwise(img, txt, curv=model.curv))
    assert torch.isfinite(sim).all()

    if g.name in ("clip", "elliptic"):
        for e in (img, txt):
            torch.testing.assert_close(e.norm(dim=-1), torch.ones(len(e)))
    elif g.name == "oblique":
        k = model.config.oblique.num_spheres
        for e in (img, txt):
            norms = e.reshape(len(e), k, n // k).norm(dim=-1)
            torch.testing.assert_close(norms, torch.ones(len(e), k))
        assert sim.abs().max() <= k + 1e-4
    elif g.name.startswith("euclidean"):
        # No normalization: the tower output scaled by 1/sqrt(n).
        torch.testing.assert_close(img, feats_img / math.sqrt(n))
        torch.testing.assert_close(txt, feats_txt / math.sqrt(n))
        assert (sim <= 0).all()
    else:  # hyperbolic: exp map of α·features, logit -d_L (or -d_L^2) <= 0, d(x, x) = 0
        assert g.uses_curvature and model.curv is not None
        c = model.curv.item()
        r = math.sqrt(c) * (model.alpha_img * feats_img).norm(dim=-1)
        expected = torch.sinh(r) / (math.sqrt(c) * r)  # |x| = sinh(√c |v|)/√c for v = α f
        torch.testing.assert_close(img.norm(dim=-1), expected * (model.alpha_img * feats_img).norm(dim=-1))
        assert (sim <= 0).all()
        self_sim = g.rowwise(img, img, curv=model.curv)
        torch.testing.assert_close(self_sim, torch.zeros(3), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", TINY)
def test_gradients_reach_towers_and_scalars(name, tokens_tiny):
    model = _build(name).train()
    out = model(_images(len(CAPTIONS)), tokens_tiny)
    logits = out["logit_scale"] * model.similarity(out["image"], out["text"])
    target = torch.arange(len(CAPTIONS))
    loss = nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.T, target)
    loss.backward()

    for pname, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{pname} got no gradient"
            assert torch.isfinite(p.grad).all(), f"{pname} has a non-finite gradient"
    scalars = ["log_logit_scale"]
    if model.geometry.uses_curvature:
        scalars += ["log_curv", "log_alpha_img", "log_alpha_txt"]
    params = dict(model.named_parameters())
    for pname in scalars:
        assert params[pname].dtype == torch.float32 and params[pname].ndim == 0
        assert params[pname].grad.abs() > 0, pname
    # The first and the last trainable weights of each tower learn.
    for prefix in ("visual.", "text."):
        tower = [(n, p) for n, p in model.named_parameters() if n.startswith(prefix) and p.requires_grad]
        for pname, p in (tower[0], tower[-1]):
            assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", ["tiny-hyperbolic", "tiny-oblique", "tiny-clip"])
def test_clamp_scalars(name, tokens_tiny):
    model = _build(name)
    s = model.config.scalars
    with torch.no_grad():
        model.log_logit_scale.fill_(10.0)
        if model.log_curv is not None:
            model.log_curv.fill_(math.log(100.0))
            model.log_alpha_img.fill_(1.0)
            model.log_alpha_txt.fill_(-1.0)
    # The properties report clamped values even before the in-place clamp.
    assert model.logit_scale.item() == pytest.approx(s.logit_scale_max)
    model(_images(2), tokens_tiny[:2])  # forward clamps the parameter data
    assert model.log_logit_scale.item() == pytest.approx(math.log(s.logit_scale_max))
    assert model.logit_scale.item() <= s.logit_scale_max * (1 + 1e-6)
    if name == "tiny-oblique":
        assert s.logit_scale_max == pytest.approx(100 / 8)
    if model.log_curv is None:
        assert model.curv is None and model.alpha_img is None and model.alpha_txt is None
        return
    assert model.curv.item() == pytest.approx(10.0)
    assert model.alpha_img.item() == pytest.approx(1.0)
    assert model.alpha_txt.item() == pytest.approx(math.exp(-1.0))  # inside the bound: untouched
    with torch.no_grad():
        model.log_curv.fill_(math.log(1e-3))
    model.clamp_scalars_()
    assert model.curv.item() == pytest.approx(0.1)
    assert 0.1 - 1e-6 <= model.curv.item() <= 10 + 1e-5


def test_scalar_initial_values():
    hyp = _build("tiny-hyperbolic")
    assert hyp.logit_scale.item() == pytest.approx(1 / 0.07)
    assert hyp.curv.item() == pytest.approx(1.0)
    assert hyp.alpha_img.item() == pytest.approx(64**-0.5) and hyp.alpha_txt.item() == pytest.approx(64**-0.5)
    assert _build("tiny-euclidean-squared").logit_scale.item() == pytest.approx(1.0)
    # 1/0.07 exceeds oblique's cap 100/k for k = 8: the default starts at the cap.
    assert _build("tiny-oblique").logit_scale.item() == pytest.approx(12.5)


# --- towers --------------------------------------------------------------------------------------


def test_final_ln_false_removes_the_layernorm(tokens_tiny):
    with_ln = _build("tiny-clip").eval()
    cfg = with_ln.config
    cfg_no = dataclasses.replace(
        cfg,
        vision=dataclasses.replace(cfg.vision, final_ln=False),
        text=dataclasses.replace(cfg.text, final_ln=False),
    )
    no_ln = create_model(cfg_no).eval()
    assert isinstance(no_ln.visual.ln_post, nn.Identity) and isinstance(no_ln.text.ln_final, nn.Identity)
    assert isinstance(with_ln.visual.ln_post, nn.LayerNorm) and isinstance(
        with_ln.text.ln_final, nn.LayerNorm
    )
    missing, unexpected = no_ln.load_state_dict(with_ln.state_dict(), strict=False)
    assert missing == []
    assert sorted(unexpected) == sorted(
        ["visual.ln_post.weight", "visual.ln_post.bias", "text.ln_final.weight", "text.ln_final.bias"]
    )
    images = _images()
    with torch.no_grad():
        # Same weights, only the final LN differs: the outputs must differ.
        assert not torch.allclose(with_ln.visual(images), no_ln.visual(images))
        assert not torch.allclose(with_ln.text(tokens_tiny), no_ln.text(tokens_tiny))
    euclip = _build("tiny-euclidean-squared")
    assert isinstance(euclip.visual.ln_post, nn.Identity) and isinstance(euclip.text.ln_final, nn.Identity)


def test_sincos_positions_are_fixed_and_meru_layout():
    model = _build("tiny-hyperbolic")
    pos = model.visual.positional_embedding
    assert not pos.requires_grad and pos.shape == (1 + 8 * 8, 128)
    assert torch.equal(pos[0], torch.zeros(128))
    # Independent check of one entry per quarter: patch (row 2, column 5) of an 8 x 8 grid, dim d.
    w, q, m = 128, 32, 1 + 2 * 8 + 5
    for d in (0, 7, 31):
        omega = 10000.0 ** (-d / q)
        expected = [math.sin(2 * omega), math.cos(2 * omega), math.sin(5 * omega), math.cos(5 * omega)]
        got = [float(pos[m, j * q + d]) for j in range(4)]
        assert got == pytest.approx(expected, abs=1e-6)
    assert torch.equal(sincos_2d_table(w, 8, 1), pos.detach())
    learned = _build("tiny-clip").visual.positional_embedding
    assert learned.requires_grad


def test_multi_token_oblique(tokens_tiny):
    model = _build("tiny-oblique-multi").eval()
    k, n = 8, 64
    assert model.visual.tower.class_embedding.shape == (k, 128)
    assert model.visual.tower.positional_embedding.shape == (k + 64, 128)
    assert model.visual.tower.proj.shape == (128, n // k)  # one shared projection to sphere_dim
    assert model.text.class_embedding.shape == (k, 128)
    assert model.text.tower.positional_embedding.shape == (32 + k, 128)
    assert model.text.tower.text_projection.shape == (128, n // k)

    images = _images()
    with torch.no_grad():
        img, txt = model.encode_image(images), model.encode_text(tokens_tiny)
    for e in (img, txt):
        spheres = e.reshape(len(e), k, n // k)
        torch.testing.assert_close(spheres.norm(dim=-1), torch.ones(len(e), k))
        # Distinct class tokens give distinct spheres (random init breaks the symmetry).
        assert (spheres[:, 0] - spheres[:, 1]).abs().max() > 1e-3

    # Padding after EOT is invisible to the class tokens ...
    eot = tokens_tiny.argmax(dim=-1)
    junk = tokens_tiny.clone()
    gen = torch.Generator().manual_seed(1)
    for i, e in enumerate(eot.tolist()):
        junk[i, e + 1 :] = torch.randint(1, 49406, (junk.shape[1] - e - 1,), generator=gen)
    assert not torch.equal(junk, tokens_tiny)
    with torch.no_grad():
        torch.testing.assert_close(model.encode_text(junk), txt, atol=1e-6, rtol=0)
        # ... while the real text is seen.
        changed = tokens_tiny.clone()
        changed[:, 1] = 320
        assert not torch.allclose(model.encode_text(changed), txt)


def test_multi_token_mask_blocks_class_tokens_from_text_queries():
    model = _build("tiny-oblique-multi")
    tokens = torch.tensor([[49406, 320, 49407, 0, 0]])
    mask = model.text.attention_mask(tokens, torch.float32)
    heads = model.text.tower.heads
    assert mask.shape == (heads, 5 + 8, 5 + 8)
    allowed = mask[0] == 0
    assert allowed[:5, :5].equal(torch.ones(5, 5).tril().bool())  # text stays causal
    assert not allowed[:5, 5:].any()  # text never sees class tokens
    assert allowed[5:, :3].all() and not allowed[5:, 3:5].any()  # class tokens: text up to EOT only
    assert allowed[5:, 5:].all()


def test_mixed_precision_embeds_in_fp32(tokens_tiny):
    model = _build("tiny-hyperbolic")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(_images(2), tokens_tiny[:2])
        sim = model.similarity(out["image"], out["text"])
    assert out["image"].dtype == out["text"].dtype == sim.dtype == torch.float32
    assert torch.isfinite(sim).all()


# --- paper configs: meta-device builds and parameter counts ----------------------------------------


def _block(w: int) -> int:
    # Pre-LN block with MLP ratio 4: qkv 3w²+3w, attention out w²+w, fc 4w²+4w, proj 4w²+w, 2 LNs 4w.
    return 12 * w * w + 13 * w


def _vit(
    image: int,
    patch: int,
    w: int,
    layers: int,
    out_dim: int,
    k: int = 1,
    final_ln: bool = True,
    meru: bool = False,
) -> int:
    grid = (image // patch) ** 2
    return (
        3 * patch * patch * w  # conv patch embedding
        + (w if meru else 0)  # MERU's timm ViT: patch-embedding bias ...
        + (0 if meru else 2 * w)  # ... and no ln_pre
        + k * w  # class token(s)
        + (k + grid) * w  # position embedding (learned or frozen sin-cos: a parameter either way)
        + layers * _block(w)
        + (2 * w if final_ln else 0)  # ln_post
        + w * out_dim  # projection, no bias
    )


def _text(w: int, layers: int, out_dim: int, k: int = 0, final_ln: bool = True) -> int:
    vocab, ctx = 49408, 77
    return (
        vocab * w  # token embedding
        + (ctx + k) * w  # positions (+ one per appended class token)
        + k * w  # appended class tokens
        + layers * _block(w)
        + (2 * w if final_ln else 0)  # ln_final
        + w * out_dim  # projection, no bias
    )


HYPERBOLIC_SCALARS = 4  # log logit scale, log curvature, log α_img, log α_txt
EXPECTED = {
    "meru-vit-s16": _vit(224, 16, 384, 12, 512, meru=True) + _text(512, 12, 512) + HYPERBOLIC_SCALARS,
    "meru-vit-b16": _vit(224, 16, 768, 12, 512, meru=True) + _text(512, 12, 512) + HYPERBOLIC_SCALARS,
    "meru-vit-l16": _vit(224, 16, 1024, 24, 512, meru=True) + _text(512, 12, 512) + HYPERBOLIC_SCALARS,
    "hype-meru-vit-l14": _vit(224, 14, 1024, 24, 768) + _text(768, 12, 768) + HYPERBOLIC_SCALARS,
    # MERU's and HyCoCLIP's CLIP baselines: MERU's towers, one scalar (the logit scale).
    "meru-clip-vit-s16": _vit(224, 16, 384, 12, 512, meru=True) + _text(512, 12, 512) + 1,
    "meru-clip-vit-b16": _vit(224, 16, 768, 12, 512, meru=True) + _text(512, 12, 512) + 1,
    "meru-clip-vit-l16": _vit(224, 16, 1024, 24, 512, meru=True) + _text(512, 12, 512) + 1,
    "euclip-vit-b16": _vit(224, 16, 768, 12, 512, final_ln=False) + _text(512, 12, 512, final_ln=False) + 1,
    "oblique-multi-vit-b16": _vit(224, 16, 768, 12, 32, k=16) + _text(512, 12, 32, k=16) + 1,
}
OPEN_CLIP_NAMES = {"clip-vit-b32": "ViT-B-32", "clip-vit-b16": "ViT-B-16", "clip-vit-l14": "ViT-L-14"}


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(OPEN_CLIP_NAMES))
def test_clip_configs_match_open_clip(name):
    model = create_model(name, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    with torch.device("meta"):
        reference = open_clip.create_model(OPEN_CLIP_NAMES[name], pretrained=None, device="meta")
    # Both have exactly one scalar (open_clip's logit_scale, our log_logit_scale): no difference.
    assert _count(model) == _count(reference)
    ours = sorted(p.shape for p in model.parameters())
    theirs = sorted(p.shape for p in reference.parameters())
    assert ours == theirs


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_paper_configs_parameter_counts(name):
    model = create_model(name, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert _count(model) == EXPECTED[name]


def test_meru_configs_follow_meru():
    for name in ("meru-vit-s16", "meru-vit-b16", "meru-vit-l16"):
        cfg = load_model_config(name)
        assert cfg.geometry == "hyperbolic" and cfg.vision.pos_embed == "sincos"
        model = create_model(cfg, device="meta")
        assert isinstance(model.visual.ln_pre, nn.Identity) and model.visual.conv1.bias is not None
        assert not model.visual.positional_embedding.requires_grad
        assert cfg.preprocess.mean == (0.485, 0.456, 0.406)
        assert (cfg.loss.entailment_weight, cfg.loss.entailment_K) == (0.2, 0.1)
        assert (cfg.scalars.curv_min, cfg.scalars.curv_max) == (0.1, 10.0)
    # HYPE's released ViT-L/14: open_clip-style towers whose LayerNorms use fp32's eps.
    hype_model = create_model("hype-meru-vit-l14", device="meta")
    assert isinstance(hype_model.visual.ln_pre, nn.LayerNorm) and hype_model.visual.conv1.bias is None
    assert hype_model.visual.ln_post.eps == hype_model.text.ln_final.eps == torch.finfo(torch.float32).eps
    euclip = load_model_config("euclip-vit-b16")
    assert (euclip.loss.entailment_weight, euclip.loss.entailment_K) == (0.1, 0.3)
    assert not euclip.vision.final_ln and not euclip.text.final_ln


# --- config validation -------------------------------------------------------------------------


def _tiny_dict() -> dict:
    return load_model_config("tiny-hyperbolic").to_dict()


def test_unknown_keys_list_the_valid_keys():
    data = _tiny_dict()
    data["vision"]["widht"] = 64
    with pytest.raises(ValueError, match=r"vision\.widht: unknown key; valid keys in vision: ") as err:
        ModelConfig.from_dict(data)
    for valid in ("image_size", "patch_size", "width", "layers", "final_ln", "pos_embed"):
        assert valid in str(err.value)
    data = _tiny_dict()
    data["temperature"] = 0.07
    with pytest.raises(ValueError, match=r"temperature: unknown key; valid keys: ") as err:
        ModelConfig.from_dict(data)
    for valid in ("geometry", "embed_dim", "vision", "text", "oblique", "scalars", "loss", "preprocess"):
        assert valid in str(err.value)


def test_bad_geometry_lists_the_geometries():
    data = _tiny_dict()
    data["geometry"] = "spherical"
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(data)
    for g in GEOMETRIES:
        assert g in str(err.value)


def test_bad_values_name_the_file_and_key(tmp_path):
    cases = [
        (("vision", "layers"), -1, "vision.layers"),
        (("text", "width"), "wide", "text.width"),
        (("vision", "pos_embed"), "rope", "vision.pos_embed"),
        (("vision", "patch_size"), 7, "vision.patch_size"),
        (("scalars", "curv_init"), 20.0, "scalars.curv_init"),
        (("preprocess", "mean"), [0.5, 0.5], "preprocess.mean"),
        (("vision", "final_ln"), "no", "vision.final_ln"),
    ]
    for (section, key), value, where in cases:
        data = _tiny_dict()
        data[section][key] = value
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError) as err:
            load_model_config(path)
        assert str(path) in str(err.value) and where in str(err.value), str(err.value)


def test_geometry_specific_entries_are_checked():
    data = load_model_config("tiny-clip").to_dict()
    data["scalars"]["curv_init"] = 1.0
    with pytest.raises(ValueError, match="scalars.curv_init.*'clip'"):
        ModelConfig.from_dict(data)
    data = load_model_config("tiny-clip").to_dict()
    data["loss"]["entailment_weight"] = 0.2
    with pytest.raises(ValueError, match="no entailment cones"):
        ModelConfig.from_dict(data)
    data = load_model_config("tiny-clip").to_dict()
    data["oblique"] = {"num_spheres": 4}
    with pytest.raises(ValueError, match="oblique"):
        ModelConfig.from_dict(data)
    data = load_model_config("tiny-oblique").to_dict()
    data["oblique"]["num_spheres"] = 7
    with pytest.raises(ValueError, match="oblique.num_spheres.*divide"):
        ModelConfig.from_dict(data)


def test_unknown_name_lists_available_configs():
    with pytest.raises(ValueError, match="tiny-clip"):
        create_model("tiny-nonexistent")


# --- factory ---------------------------------------------------------------------------------


def test_create_by_name_and_from_to_dict_roundtrip():
    model = create_model("tiny-hyperbolic")
    assert isinstance(model, ContrastiveModel) and model.config.name == "tiny-hyperbolic"
    data = json.loads(json.dumps(model.config.to_dict()))  # checkpoints store plain JSON
    again = create_model(data)
    assert again.config == model.config
    assert str(again) == str(model)
    shapes = [(n, p.shape, p.requires_grad) for n, p in model.named_parameters()]
    assert shapes == [(n, p.shape, p.requires_grad) for n, p in again.named_parameters()]
    again.load_state_dict(model.state_dict())  # strict: identical keys


def test_hype_config_dir_adds_to_the_packaged_configs(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    data = load_model_config("tiny-clip").to_dict()
    data["name"] = "mine"
    (tmp_path / "models" / "mine.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.setenv("HYPE_CONFIG_DIR", str(tmp_path))
    assert {"mine", "tiny-clip"} <= set(list_model_configs())
    assert create_model("mine", device="meta").config.name == "mine"


def test_tokenizer_and_preprocess_work_offline(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("tried to open a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    model = create_model("tiny-hyperbolic")
    tok = model.tokenizer()
    ids = tok(["a red square", "x " * 100])
    assert ids.shape == (2, 32) and ids.dtype == torch.long
    assert int(ids[0].argmax()) == 4 and int(ids[1, -1]) == tok.eot_token_id  # truncation keeps EOT

    image = Image.new("RGB", (100, 80), (255, 0, 0))
    x = model.preprocess(train=False)(image)
    assert x.shape == (3, 64, 64)
    red = (1.0 - 0.485) / 0.229  # ImageNet mean/std from the config
    assert float(x[0].mean()) == pytest.approx(red, rel=1e-4)
    train = model.preprocess(train=True)
    crop = next(t for t in train.transforms if type(t).__name__ == "RandomResizedCrop")
    assert tuple(crop.scale) == (0.5, 1.0)
    assert train(image).shape == (3, 64, 64)
    default = create_model("tiny-clip").preprocess(train=False)
    norm = next(t for t in default.transforms if type(t).__name__ == "Normalize")
    assert tuple(norm.mean) == pytest.approx(open_clip.OPENAI_DATASET_MEAN)

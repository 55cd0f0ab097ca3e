"""hype.train config, presets, overrides, parameter groups and schedules (no training here)."""

from __future__ import annotations

import math

import pytest
import torch
from open_clip_train.scheduler import cosine_lr
from train_helpers import TINY_GEOMETRIES

from hype.models import ConfigError, create_model
from hype.train import effective_model_config, list_train_configs, load_train_config
from hype.train.config import LossConfig
from hype.train.optim import build_optimizer, entailment_K_at, lr_at, param_groups

# DESIGN §2.5 / datacomp scale_configs.py: samples seen, model, batch, lr, warm-up, β2.
DATACOMP = {
    "debug": (128_000, "clip-vit-b32", 1024, 1e-4, 500, 0.98),
    "small": (12_800_000, "clip-vit-b32", 4096, 5e-4, 500, 0.98),
    "medium": (128_000_000, "clip-vit-b32", 4096, 5e-4, 500, 0.98),
    "large": (1_280_000_000, "clip-vit-b16", 8192, 5e-4, 500, 0.98),
    "xlarge": (12_800_000_000, "clip-vit-l14", 90112, 1e-3, 10_000, 0.95),
}


def test_every_preset_loads_and_builds_its_model_config():
    names = list_train_configs()
    for geometry in TINY_GEOMETRIES:
        assert f"tiny-{geometry}" in names
    for name in names:
        cfg = load_train_config(name)
        model = effective_model_config(cfg)
        assert cfg.name == name and cfg.total_steps >= 1
        if cfg.hycoclip.enabled:  # HyCoCLIP trains MERU's towers: the preset names a MERU model
            assert model.geometry == "hyperbolic"
        elif name.startswith("tiny-"):
            assert model.name == name and cfg.precision == "fp32"
            assert model.geometry == name[len("tiny-") :].replace("-multi", "").replace("-scorer", "")
    # The synthetic world's MERU scorer recipe (README "Quality"): EuCLIP's K schedule and an image tower
    # without its final LayerNorm; otherwise the tiny MERU.
    scorer, meru = load_train_config("tiny-hyperbolic-scorer"), load_train_config("tiny-hyperbolic")
    assert (scorer.loss.K_start, scorer.loss.K_end) == (0.3, 0.1)
    s_model, m_model = effective_model_config(scorer), effective_model_config(meru)
    assert not s_model.vision.final_ln and m_model.vision.final_ln and s_model.text.final_ln
    assert s_model.vision.width == m_model.vision.width and scorer.samples_seen == meru.samples_seen


@pytest.mark.parametrize("scale", sorted(DATACOMP))
def test_datacomp_presets_follow_the_spec_table(scale):
    samples, model, batch, lr, warmup, beta2 = DATACOMP[scale]
    cfg = load_train_config(f"datacomp-{scale}")
    assert (cfg.samples_seen, cfg.model, cfg.batch_size) == (samples, model, batch)
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.beta2) == (lr, warmup, beta2)
    assert (cfg.optim.beta1, cfg.optim.weight_decay, cfg.data.resampled) == (0.9, 0.2, True)


def test_meru_hype_and_euclip_recipes():
    meru = load_train_config("meru-vit-b16")
    assert (meru.batch_size, meru.total_steps, meru.optim.warmup_steps) == (2048, 120_000, 4000)
    hype = load_train_config("hype-meru-vit-l14")
    assert (hype.batch_size, hype.total_steps, hype.optim.warmup_steps, hype.model) == (
        2048,
        125_000,
        4000,
        "hype-meru-vit-l14",
    )
    eu = load_train_config("euclip-vit-b16")
    assert (eu.loss.K_start, eu.loss.K_end) == (0.3, 0.1)
    assert effective_model_config(eu).loss.entailment_K == 0.1  # the checkpoint records the final K


def test_overrides_set_nested_keys_and_model_fields():
    cfg = load_train_config(
        "tiny-hyperbolic",
        ["optim.lr=3e-4", "data.workers=0", "precision=bf16", "model.vision.layers=2"]
        + ["data.train=/x/{0..3}.tar"],
    )
    assert cfg.optim.lr == 3e-4 and cfg.data.workers == 0 and cfg.precision == "bf16"
    assert cfg.data.train == "/x/{0..3}.tar"
    model = effective_model_config(cfg)
    assert model.vision.layers == 2 and model.geometry == "hyperbolic"


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.learning_rate=1", r"optim.learning_rate: unknown key; valid keys in optim: lr, beta1"),
        ("batchsize=3", r"batchsize: unknown key; valid keys in the top level: .*batch_size"),
        ("optim.lr=-1", r"optim.lr: must be > 0"),
        ("optim.beta2=1.0", r"optim.beta2: must be in \[0, 1\)"),
        ("precision=fp8", r"precision: must be one of fp32, bf16, fp16"),
        ("samples_seen=10", r"samples_seen: 10 is less than one batch"),
        ("data.workers=-1", r"data.workers: must be >= 0"),
        ("optim.lr=fast", r"optim.lr: must be a number"),
        ("model.vision.patch_size=7", r"model.vision.patch_size: 7 does not divide image_size"),
        ("loss.K_start=0.3", r"set both K_start and K_end"),
        ("nonsense", r"is not key=value"),
    ],
)
def test_bad_overrides_are_clear(override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config("tiny-clip", [override])


def test_unknown_preset_and_bad_file(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown training preset 'nope'; available: .*tiny-clip"):
        load_train_config("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-clip\noptim: {lr: 1e-3, warmup: 3}\n")
    with pytest.raises(ConfigError, match=rf"{bad}.*optim.warmup: unknown key; valid keys in optim"):
        load_train_config(bad)


def test_entailment_settings_on_a_geometry_without_cones_are_refused():
    cfg = load_train_config("tiny-clip", ["loss.entailment_weight=0.2"])
    with pytest.raises(ConfigError, match="no entailment cones"):
        effective_model_config(cfg)


def test_param_groups_exclude_gains_biases_scalars_and_frozen():
    model = create_model("tiny-hyperbolic")
    decay, keep = param_groups(model, 0.2)
    assert decay["weight_decay"] == 0.2 and keep["weight_decay"] == 0.0
    names_decay, names_keep = set(decay["names"]), set(keep["names"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names_decay | names_keep == trainable and not names_decay & names_keep
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "visual.positional_embedding" in frozen  # MERU's sin-cos table stays out of the optimizer
    for scalar in ("log_logit_scale", "log_curv", "log_alpha_img", "log_alpha_txt"):
        assert scalar in names_keep
    for name, p in model.named_parameters():
        if name in names_keep:
            assert p.ndim < 2 or name.endswith("class_embedding"), name
        elif name in names_decay:
            assert p.ndim >= 2, name
    assert any(n.endswith("ln_1.weight") for n in names_keep) and any(n.endswith("bias") for n in names_keep)
    assert "text.token_embedding.weight" in names_decay
    multi = create_model("tiny-oblique-multi")
    keep_multi = set(param_groups(multi, 0.2)[1]["names"])
    assert {n for n in keep_multi if n.endswith("class_embedding")}, "multi-token class tokens are decayed"


def test_adamw_leaves_excluded_params_undecayed():
    model = create_model("tiny-clip")
    from hype.train.config import OptimConfig

    opt = build_optimizer(model, OptimConfig(lr=1.0, weight_decay=0.5))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ln = model.text.ln_final.weight.detach().clone()
    w = model.text.transformer.resblocks[0].mlp.c_fc.weight.detach().clone()
    scale = model.log_logit_scale.detach().clone()
    opt.step()
    assert torch.equal(model.text.ln_final.weight, ln) and torch.equal(model.log_logit_scale, scale)
    assert torch.allclose(model.text.transformer.resblocks[0].mlp.c_fc.weight, w * 0.5)


def test_lr_schedule_matches_open_clip_cosine():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    ref = cosine_lr(opt, 5e-4, 10, 100)
    ours = [lr_at(s, base_lr=5e-4, warmup_steps=10, total_steps=100) for s in range(100)]
    assert ours == pytest.approx([ref(s) for s in range(100)], rel=1e-12, abs=1e-15)
    assert ours[0] == pytest.approx(5e-5) and ours[9] == pytest.approx(5e-4)
    assert all(a >= b for a, b in zip(ours[10:], ours[11:], strict=False))
    assert ours[-1] < 1e-6 and lr_at(100, base_lr=5e-4, warmup_steps=10, total_steps=100) == 0.0


def test_K_schedule_is_linear_from_start_to_end():
    sched = LossConfig(K_start=0.3, K_end=0.1)
    ks = [entailment_K_at(s, 11, sched, 0.1) for s in range(11)]
    assert ks[0] == pytest.approx(0.3) and ks[-1] == pytest.approx(0.1) and ks[5] == pytest.approx(0.2)
    assert entailment_K_at(3, 11, LossConfig(), 0.25) == 0.25
    assert entailment_K_at(3, 11, LossConfig(entailment_K=0.2), 0.25) == 0.2
    assert math.isclose(ks[1] - ks[0], ks[2] - ks[1])


def test_text_fields_keep_override_text_that_looks_like_yaml():
    for text in ("{subreddit} : {caption}", "{caption}", "a: b"):
        assert load_train_config("tiny-clip", [f"data.caption_template={text}"]).data.caption_template == text
    assert load_train_config("tiny-clip", ["data.caption_template=null"]).data.caption_template is None
    with pytest.raises(ConfigError, match="optim.lr: must be a finite number"):
        load_train_config("tiny-clip", ["optim.lr={x}"])

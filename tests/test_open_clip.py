"""open_clip models in and out: every file layout a user has loads with embeddings equal to open_clip's own
model (1e-6); hype's models export to what open_clip (and the EuCLIP fork's layout) load; the round trip
is exact; every open_clip architecture name either translates exactly or is refused with its features.

The models are built here with open_clip (random init) from a tiny config registered the way a user adds
one (`open_clip.add_model_config`), so architecture names resolve as open_clip's own.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import save_file

from hype.checkpoint import load_checkpoint, load_model_file, save_checkpoint
from hype.convert.open_clip import export_open_clip
from hype.io.weights import ModelFileError
from hype.models import create_model
from hype.models.open_clip_files import read_open_clip
from hype.models.open_clip_format import (
    UnsupportedArchitecture,
    builtin_config,
    builtin_name,
    model_config_from_open_clip,
    open_clip_config,
    state_dict_from_open_clip,
    unsupported_features,
)

ARCH = "hype-test-tiny-ViT"  # registered below; QuickGELU like OpenAI's releases
TINY = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 16, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
TEXTS = ["a photo of a red cube", "two blue spheres on grass", "", "a very long caption " * 10]


@pytest.fixture(scope="module")
def registered(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("oc-configs")
    (d / f"{ARCH}.json").write_text(json.dumps(TINY))
    open_clip.add_model_config(d)
    return ARCH


@pytest.fixture(scope="module")
def reference(registered):
    """An open_clip model (random init, a non-default logit scale) and what it embeds."""
    torch.manual_seed(0)
    model = open_clip.create_model(registered).eval()
    with torch.no_grad():
        model.logit_scale.fill_(3.1)
    return model


def _images(n: int = 3) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (40 + 7 * i, 52, 3), dtype=np.uint8)) for i in range(n)]


def _assert_same_embeddings(model, oc_model, preprocess=None) -> None:
    """hype's model (its own preprocessing and tokenizer) vs open_clip's (open_clip's) to 1e-6."""
    preprocess = preprocess or open_clip.image_transform(oc_model.visual.image_size[0], is_train=False)
    tokenizer = open_clip.get_tokenizer(ARCH)
    images = _images()
    with torch.no_grad():
        ours_img = model.encode_image(torch.stack([model.preprocess(False)(im) for im in images]))
        ours_txt = model.encode_text(model.tokenizer()(TEXTS))
        theirs_img = oc_model.encode_image(torch.stack([preprocess(im) for im in images]), normalize=True)
        theirs_txt = oc_model.encode_text(tokenizer(TEXTS), normalize=True)
    assert torch.equal(model.tokenizer()(TEXTS), tokenizer(TEXTS))
    torch.testing.assert_close(ours_img, theirs_img, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_txt, theirs_txt, atol=1e-6, rtol=0)
    assert model.logit_scale.item() == pytest.approx(oc_model.logit_scale.exp().item(), rel=1e-6)


def _write_layouts(root: Path, model) -> dict[str, tuple[Path, str | None]]:
    """The model saved in every layout users have: name -> (path, --arch needed or None)."""
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    out: dict[str, tuple[Path, str | None]] = {}
    root.mkdir(parents=True, exist_ok=True)
    torch.save(sd, root / "bare.bin")
    out["bare .bin"] = (root / "bare.bin", ARCH)
    torch.save({"state_dict": sd}, root / "wrapped.pt")
    out["{'state_dict': ...} .pt"] = (root / "wrapped.pt", ARCH)
    torch.save({"module." + k: v for k, v in sd.items()}, root / "ddp.pt")
    out["DDP module. prefix"] = (root / "ddp.pt", ARCH)
    save_file(sd, str(root / "weights.safetensors"))
    out[".safetensors"] = (root / "weights.safetensors", ARCH)
    # open_clip_train: logs/<name>/checkpoints/epoch_N.pt, params.txt two folders up, DDP prefix.
    run = root / "logs" / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "params.txt").write_text(f"batch_size: 4\nmodel: {ARCH}\nprecision: amp\n")
    train_state = {
        "epoch": 2,
        "name": "run",
        "state_dict": {"module." + k: v for k, v in sd.items()},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
    }
    torch.save(train_state, run / "checkpoints" / "epoch_2.pt")
    out["open_clip_train epoch_N.pt"] = (run / "checkpoints" / "epoch_2.pt", None)
    out["open_clip_train run folder"] = (run, None)
    # Hugging Face: a model folder, and the cache's models--org--name/snapshots/<commit>/ with refs/main.
    hf = root / "hf"
    hf.mkdir()
    (hf / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY, "preprocess_cfg": {}}))
    save_file(sd, str(hf / "open_clip_model.safetensors"))
    out["HF folder (safetensors)"] = (hf, None)
    hf_bin = root / "hf-bin"
    hf_bin.mkdir()
    shutil.copy(hf / "open_clip_config.json", hf_bin)
    torch.save(sd, hf_bin / "open_clip_pytorch_model.bin")
    out["HF folder (pytorch .bin)"] = (hf_bin, None)
    cache = root / "models--org--tiny"
    snap = cache / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("0123abcd")
    shutil.copy(hf / "open_clip_config.json", snap)
    shutil.copy(hf / "open_clip_model.safetensors", snap)
    out["HF cache folder"] = (cache, None)
    return out


def test_every_layout_loads_with_open_clips_embeddings(reference, tmp_path):
    layouts = _write_layouts(tmp_path, reference)
    for name, (path, arch) in layouts.items():
        imported = read_open_clip(path, arch=arch)
        assert imported.model.config.geometry == "clip", name
        _assert_same_embeddings(imported.model, reference)


def test_a_bare_state_dict_needs_the_architecture(reference, tmp_path):
    layouts = _write_layouts(tmp_path, reference)
    with pytest.raises(ModelFileError, match="does not say its architecture.*--arch"):
        read_open_clip(layouts["bare .bin"][0])
    with pytest.raises(ModelFileError, match="not an open_clip architecture name"):
        read_open_clip(layouts["bare .bin"][0], arch="ViT-Nope")
    with pytest.raises(ModelFileError, match="do not match architecture 'ViT-B-32'.*wrong shapes"):
        read_open_clip(layouts["bare .bin"][0], arch="ViT-B-32")


def test_a_logit_scale_above_the_clamp_is_used_as_stored(reference, registered, tmp_path):
    """open_clip clamps the logit scale at 100 only in its training loop; a model read from a file whose
    stored scale is 150 scores with 150, as open_clip's own model does."""
    sd = {k: v.clone() for k, v in reference.state_dict().items()}
    sd["logit_scale"] = torch.tensor(150.0).log()
    save_file(sd, str(tmp_path / "w.safetensors"))
    oc = open_clip.create_model(registered).eval()
    oc.load_state_dict(sd)
    imported = read_open_clip(tmp_path / "w.safetensors", arch=registered)
    assert imported.model.logit_scale.item() == pytest.approx(oc.logit_scale.exp().item(), rel=1e-6)
    assert imported.model.logit_scale.item() == pytest.approx(150.0, rel=1e-6)


def test_a_real_size_state_dict_error_names_the_candidate_architectures(tmp_path):
    # Shapes only (meta tensors are not saveable): the candidates are listed from the tensors' shapes.
    from hype.models.open_clip_files import _candidates

    with torch.device("meta"):
        model = open_clip.model.CLIP(**builtin_config("ViT-B-32"))
    found = _candidates(model.state_dict())
    assert "ViT-B-32" in found and "ViT-B-32-quickgelu" in found and "ViT-L-14" not in found


def test_hf_preprocess_config_and_custom_text_layout(registered, tmp_path):
    torch.manual_seed(1)
    cfg = {**TINY, "custom_text": True}
    oc = open_clip.model.CustomTextCLIP(**TINY).eval()
    pre = {
        "mean": [0.5, 0.4, 0.3],
        "std": [0.2, 0.25, 0.3],
        "interpolation": "bilinear",
        "resize_mode": "squash",
    }
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": pre}))
    save_file(
        {k: v.contiguous() for k, v in oc.state_dict().items()}, str(hf / "open_clip_model.safetensors")
    )
    model = read_open_clip(hf).model
    assert any(k.startswith("text.") for k in oc.state_dict())
    _, _, their_preprocess = open_clip.create_model_and_transforms(f"local-dir:{hf}")
    _assert_same_embeddings(model, oc, their_preprocess)
    p = model.config.preprocess
    assert (list(p.mean), p.interpolation, p.resize_mode) == (pre["mean"], "bilinear", "squash")


def test_fp16_openai_style_weights_and_their_extras(reference, tmp_path):
    # OpenAI's releases are fp16 with input_resolution / context_length / vocab_size entries; the
    # architecture is read off the shapes (heads = width / 64, QuickGELU).
    sd = {k: v.half() for k, v in reference.state_dict().items()}
    sd |= {
        "input_resolution": torch.tensor(32),
        "context_length": torch.tensor(16),
        "vocab_size": torch.tensor(49408),
    }
    torch.save(sd, tmp_path / "openai.pt")
    imported = read_open_clip(tmp_path / "openai.pt")
    assert imported.layout == "openai" and imported.model.config.quick_gelu
    assert imported.model.config.text.heads == 1  # width 64 / 64, what OpenAI's layout implies


def test_every_open_clip_architecture_translates_exactly_or_is_refused():
    native = 0
    for name in open_clip.list_models():
        cfg = builtin_config(name)
        problems = unsupported_features(cfg)
        if problems:
            with pytest.raises(UnsupportedArchitecture, match="features hype's towers do not build"):
                model_config_from_open_clip(cfg, name=name)
            continue
        native += 1
        ours = create_model(model_config_from_open_clip(cfg, name=name), device="meta")
        with torch.device("meta"):
            cls = open_clip.model.CustomTextCLIP if cfg.get("custom_text") else open_clip.model.CLIP
            theirs = cls(**{k: v for k, v in cfg.items() if k != "custom_text"})
        mapped = state_dict_from_open_clip(theirs.state_dict())
        want = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
        assert {k: tuple(v.shape) for k, v in mapped.items()} == want, name
        assert open_clip.get_tokenizer(name).context_length == ours.config.text.context_length, name
        # Export gives the same architecture name back (what DataComp passes to open_clip).
        back = open_clip_config(ours.config)["model_cfg"]
        assert builtin_name(back) in (name, *_aliases(name)), name
    assert native >= 25  # ViT-B/L/H/g/bigG in their GELU and QuickGELU variants, DataComp's among them


def _aliases(name: str) -> list[str]:
    # Built-in names whose configs are identical (open_clip ships a few aliases).
    from hype.models.open_clip_format import _normalized, builtin_names

    want = _normalized(builtin_config(name))
    return [n for n in builtin_names() if _normalized(builtin_config(n)) == want]


def test_hype_clip_configs_are_open_clips_datacomp_architectures():
    for ours, theirs in (
        ("clip-vit-b32", "ViT-B-32"),
        ("clip-vit-b16", "ViT-B-16"),
        ("clip-vit-l14", "ViT-L-14"),
    ):
        cfg = create_model(ours, device="meta").config
        assert builtin_name(open_clip_config(cfg)["model_cfg"]) == theirs


# --- export and round trip -----------------------------------------------------------------------


def _tiny_hype(tmp_path: Path, name: str, **overrides) -> tuple[Path, torch.nn.Module]:
    from hype.models import load_model_config

    cfg = load_model_config(name).to_dict()
    for key, value in overrides.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    torch.manual_seed(2)
    model = create_model(cfg).eval()
    with torch.no_grad():
        for p in (model.log_curv, model.log_alpha_img):
            if p is not None:
                p.add_(0.1)  # away from the init, so a dropped scalar would show
    path = tmp_path / f"{name}.safetensors"
    save_checkpoint(path, model)
    return path, model


def test_export_clip_loads_in_open_clip_with_equal_embeddings(registered, tmp_path):
    path, model = _tiny_hype(tmp_path, "tiny-clip")
    report = export_open_clip(path, tmp_path / "exported")
    assert report.layout == "open_clip" and not report.builtin
    oc, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'exported'}")
    oc.eval()
    images = _images()
    tok = open_clip.get_tokenizer(f"local-dir:{tmp_path / 'exported'}")
    with torch.no_grad():
        torch.testing.assert_close(
            model.encode_image(torch.stack([model.preprocess(False)(im) for im in images])),
            oc.encode_image(torch.stack([preprocess(im) for im in images]), normalize=True),
            atol=1e-6,
            rtol=0,
        )
        torch.testing.assert_close(
            model.encode_text(model.tokenizer()(TEXTS)),
            oc.encode_text(tok(TEXTS), normalize=True),
            atol=1e-6,
            rtol=0,
        )
    # The round trip is exact: same tensors, same architecture.
    back = load_model_file(tmp_path / "exported")
    assert back.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    assert open_clip_config(back.config) == open_clip_config(model.config)


def test_export_of_a_builtin_architecture_loads_by_name(registered, tmp_path):
    # A config equal to an open_clip built-in is exported under that name, and open_clip loads the
    # weights file by name as DataComp's evaluate.py does (`--use_model "NAME PATH"`).
    path, model = _tiny_hype(
        tmp_path,
        "tiny-clip",
        **{
            "quick_gelu": True,
            "embed_dim": 32,
            "vision.image_size": 32,
            "vision.patch_size": 16,
            "vision.width": 64,
            "vision.layers": 2,
            "vision.head_width": 32,
            "text.context_length": 16,
            "text.width": 64,
            "text.heads": 2,
            "text.layers": 2,
        },
    )
    report = export_open_clip(path, tmp_path / "exported")
    assert report.builtin and report.architecture == ARCH
    weights = tmp_path / "exported" / "open_clip_model.safetensors"
    oc, _, _ = open_clip.create_model_and_transforms(ARCH, pretrained=str(weights))
    _assert_same_embeddings(model, oc.eval())
    assert any(f'--use_model "{ARCH} {weights}"' in line for line in report.lines())


@pytest.mark.parametrize("geometry", ["euclidean-squared", "hyperbolic", "elliptic"])
def test_other_geometries_round_trip_through_the_forks_layout(tmp_path, geometry):
    name = {
        "euclidean-squared": "tiny-euclidean-squared",
        "hyperbolic": "tiny-hyperbolic",
        "elliptic": "tiny-elliptic",
    }
    # MERU's sin-cos positions and patch bias are not open_clip's; the fork's hyperbolic ViT is open_clip's.
    overrides = {"vision.pos_embed": "learnable", "vision.patch_bias": False, "vision.ln_pre": True}
    path, model = _tiny_hype(tmp_path, name[geometry], **(overrides if geometry == "hyperbolic" else {}))
    report = export_open_clip(path, tmp_path / "exported")
    assert report.layout == "euclip-fork"
    run = tmp_path / "exported"
    params = dict(line.split(": ", 1) for line in (run / "params.txt").read_text().splitlines())
    assert params["geometry"] == geometry
    ckpt = torch.load(run / "checkpoints" / "epoch_latest.pt", weights_only=True)
    if geometry == "hyperbolic":
        assert {"curvature", "alpha_img", "alpha_txt", "logit_scale"} <= set(ckpt["state_dict"])
        assert ckpt["state_dict"]["curvature"].item() == model.log_curv.item()
    back = load_model_file(run)
    assert back.config.geometry == geometry
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    images = torch.randn(2, 3, model.config.vision.image_size, model.config.vision.image_size)
    with torch.no_grad():
        assert torch.equal(back.encode_image(images), model.encode_image(images))


def test_meru_towers_are_refused_by_the_open_clip_export(tmp_path):
    path, _ = _tiny_hype(tmp_path, "tiny-hyperbolic")
    with pytest.raises(UnsupportedArchitecture, match="sin-cos"):
        export_open_clip(path, tmp_path / "out")


def test_a_fork_checkpoint_without_params_needs_the_geometry(tmp_path):
    overrides = {"vision.pos_embed": "learnable", "vision.patch_bias": False, "vision.ln_pre": True}
    path, _ = _tiny_hype(tmp_path, "tiny-hyperbolic", **overrides)
    export_open_clip(path, tmp_path / "run")
    (tmp_path / "run" / "params.txt").unlink()
    with pytest.raises(ModelFileError, match="--geometry hyperbolic"):
        read_open_clip(tmp_path / "run")
    assert read_open_clip(tmp_path / "run", geometry="hyperbolic").model.config.geometry == "hyperbolic"


# --- the commands --------------------------------------------------------------------------------


def test_convert_and_export_commands(reference, tmp_path):
    from hype.cli import main

    layouts = _write_layouts(tmp_path / "src", reference)
    runner = CliRunner()
    out = tmp_path / "b.safetensors"
    result = runner.invoke(main, ["convert", "open-clip", str(layouts["bare .bin"][0]), "--out", str(out)])
    assert result.exit_code != 0 and "--arch" in result.output
    args = ["convert", "open-clip", str(layouts["bare .bin"][0]), "--arch", ARCH, "--out", str(out), "--json"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["architecture"] == ARCH and report["layout"] == "state-dict"
    _assert_same_embeddings(load_checkpoint(out), reference)

    result = runner.invoke(main, ["export", str(out), str(tmp_path / "exp")])
    assert result.exit_code == 0, result.output
    assert "an open_clip built-in" in result.output and "--use_model" in result.output
    result = runner.invoke(main, ["export", str(out), str(tmp_path / "exp")])
    assert result.exit_code != 0 and "--overwrite" in result.output


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_openai_release_archive_loads_without_arch(tmp_path, dtype):
    """OpenAI's releases: traced TorchScript archives (fp16), read without torch.jit.load or pickled code;
    the architecture comes from the shapes (heads = width / 64, QuickGELU), as open_clip infers it."""
    from test_torchscript import openai_archive

    cfg = {
        "embed_dim": 32,
        "quick_gelu": True,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 16, "head_width": 64},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 2},
    }
    torch.manual_seed(3)
    oc = open_clip.model.CLIP(**cfg).eval()
    if dtype == torch.float16:  # the reference computes in fp32 from the same fp16-rounded weights
        with torch.no_grad():
            for p in oc.parameters():
                p.copy_(p.half().float())
    path = openai_archive(copy.deepcopy(oc), tmp_path / "ViT-T-16.pt", dtype)
    imported = read_open_clip(path)
    assert imported.layout == "openai" and imported.arch_origin.startswith("OpenAI release")
    images = torch.stack([open_clip.image_transform(32, is_train=False)(im) for im in _images()])
    tokens = open_clip.get_tokenizer("ViT-B-32")(TEXTS)[:, :16]
    tokens[:, -1] = torch.where(tokens[:, -1] != 0, 49407, 0)  # keep the EOT after truncation
    model = imported.model
    with torch.no_grad():
        torch.testing.assert_close(
            model.encode_image(images), oc.encode_image(images, normalize=True), atol=1e-6, rtol=0
        )
        torch.testing.assert_close(
            model.encode_text(tokens), oc.encode_text(tokens, normalize=True), atol=1e-6, rtol=0
        )


_OK_CFG = {"embed_dim": 8, "vision_cfg": {}, "text_cfg": {}}
MALFORMED_CONFIGS = {
    "not JSON": "{",
    "a list": "[1]",
    "model_cfg a string": json.dumps({"model_cfg": "x"}),
    "model_cfg empty": json.dumps({"model_cfg": {}}),
    "vision_cfg a string": json.dumps({"model_cfg": {**_OK_CFG, "vision_cfg": "x"}}),
    "text_cfg a number": json.dumps({"model_cfg": {**_OK_CFG, "text_cfg": 5}}),
    "preprocess_cfg a string": json.dumps({"model_cfg": _OK_CFG, "preprocess_cfg": "x"}),
    "embed_dim a string": json.dumps({"model_cfg": {**_OK_CFG, "embed_dim": "8"}}),
    "negative width": json.dumps({"model_cfg": {**_OK_CFG, "vision_cfg": {"width": -1}}}),
    "tokenizer_kwargs a list": json.dumps({"model_cfg": {**_OK_CFG, "text_cfg": {"tokenizer_kwargs": [1]}}}),
}


@pytest.mark.parametrize("name", list(MALFORMED_CONFIGS))
def test_a_malformed_open_clip_config_is_a_clear_error_naming_the_file(tmp_path, name):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "open_clip_config.json").write_text(MALFORMED_CONFIGS[name])
    save_file({"logit_scale": torch.zeros(())}, str(hf / "open_clip_model.safetensors"))
    for native in (True, False):
        with pytest.raises(ModelFileError, match=r"hf/open_clip_config\.json: "):
            read_open_clip(hf, native=native)


def test_a_small_folder_cannot_make_the_reader_allocate_a_huge_model(tmp_path):
    """A few hundred bytes (a config asking for a width-8192, 24-layer ViT, one tiny tensor) are refused
    after a meta-device build, before that model's tens of GB are allocated (`hype convert open-clip`)."""
    from memory_support import run_bounded

    hf = tmp_path / "hf"
    hf.mkdir()
    huge = {**TINY, "vision_cfg": {**TINY["vision_cfg"], "width": 8192, "layers": 24, "head_width": 64}}
    (hf / "open_clip_config.json").write_text(json.dumps({"model_cfg": huge}))
    save_file({"logit_scale": torch.zeros(())}, str(hf / "open_clip_model.safetensors"))
    assert sum(f.stat().st_size for f in hf.iterdir()) < 1024
    setup = "import hype.models, open_clip\nfrom hype.convert.open_clip import convert_open_clip"
    result = run_bounded(setup, f"convert_open_clip({str(hf)!r}, {str(tmp_path / 'o.safetensors')!r})")
    assert result["error"] and result["error"].startswith("ModelFileError: "), result
    assert "do not match architecture" in result["error"] and result["growth_mb"] < 200, result


def _cache_entry(root: Path, source: Path, ref: str) -> Path:
    """models--org--m/ with refs/main = `ref` and blobs/ + snapshots/c0ffee/ symlinks as hf writes them."""
    cache = root / "models--org--m"
    (cache / "refs").mkdir(parents=True)
    (cache / "refs" / "main").write_text(ref)
    (cache / "blobs").mkdir()
    snap = cache / "snapshots" / "c0ffee"
    snap.mkdir(parents=True)
    for f in source.iterdir():
        shutil.copy(f, cache / "blobs" / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    return cache


def test_a_hugging_face_cache_entry_is_read_only_inside_itself(reference, tmp_path):
    """refs/main names a snapshot inside the entry, and every file read resolves inside the entry (hf's
    own symlinks into blobs/ do): a ref such as ../../../outside/snap or a symlink out is refused."""
    layouts = _write_layouts(tmp_path / "layouts", reference)
    hf = layouts["HF folder (safetensors)"][0]
    good = _cache_entry(tmp_path / "good", hf, "c0ffee")
    assert read_open_clip(good).weights.parent.name == "c0ffee"

    outside = tmp_path / "outside" / "snap"
    shutil.copytree(hf, outside)
    escaping = _cache_entry(tmp_path / "ref", hf, "../../../outside/snap")
    shutil.rmtree(escaping / "snapshots" / "c0ffee")
    (escaping / "snapshots" / "other").mkdir()  # two candidate snapshots would not resolve either
    (escaping / "snapshots" / "more").mkdir()
    with pytest.raises(ModelFileError, match=r"refs/main.*'\.\./\.\./\.\./outside/snap'.*not a snapshot"):
        read_open_clip(escaping)

    linked = _cache_entry(tmp_path / "link", hf, "c0ffee")
    weights = linked / "snapshots" / "c0ffee" / "open_clip_model.safetensors"
    weights.unlink()
    weights.symlink_to(outside / "open_clip_model.safetensors")
    with pytest.raises(
        ModelFileError, match=r"open_clip_model\.safetensors.*outside the Hugging Face cache entry"
    ):
        read_open_clip(linked)

    # At any depth: a snapshot holding an open_clip_train run whose checkpoint links out (the weights read
    # would be the outside file), or a nested folder that links back to itself.
    nested = _cache_entry(tmp_path / "nested", hf, "c0ffee")
    snap = nested / "snapshots" / "c0ffee"
    for f in snap.iterdir():
        f.unlink()
    run = layouts["open_clip_train run folder"][0]
    (snap / "checkpoints").mkdir()
    shutil.copy(run / "params.txt", snap)
    (snap / "checkpoints" / "epoch_2.pt").symlink_to(run / "checkpoints" / "epoch_2.pt")
    with pytest.raises(ModelFileError, match=r"checkpoints/epoch_2\.pt: resolves to .*outside the Hugging"):
        read_open_clip(nested)
    (snap / "checkpoints" / "epoch_2.pt").unlink()
    shutil.copy(run / "checkpoints" / "epoch_2.pt", nested / "blobs" / "epoch_2.pt")
    (snap / "checkpoints" / "epoch_2.pt").symlink_to(Path("../../../blobs/epoch_2.pt"))
    (snap / "checkpoints" / "again").symlink_to(Path(".."))  # a loop inside the entry is walked once
    assert read_open_clip(nested).weights.name == "epoch_2.pt"


def test_a_model_name_with_control_characters_is_refused(tmp_path):
    """A name is written into files (the fork's params.txt): a newline in it would add lines there and
    change the model read back. Configs refuse control characters, so a checkpoint carrying one is a
    clear error and nothing is exported."""
    from hype.checkpoint import CheckpointError, read_checkpoint_metadata
    from hype.models import ModelConfig
    from hype.models.config import ConfigError

    with pytest.raises(ConfigError, match="name"):
        ModelConfig(name="tiny\ngeometry: clip")
    path, model = _tiny_hype(tmp_path, "tiny-hyperbolic")
    meta = read_checkpoint_metadata(path)
    cfg = {**meta["model_config"], "name": "tiny\ngeometry: clip"}
    evil = tmp_path / "evil.safetensors"
    metadata = {"format": meta["format"], "model_config": json.dumps(cfg), "extra": "{}"}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(evil), metadata=metadata)
    with pytest.raises(CheckpointError, match=r"evil\.safetensors: .*name.*control character"):
        export_open_clip(evil, tmp_path / "out")
    assert not (tmp_path / "out" / "params.txt").exists()

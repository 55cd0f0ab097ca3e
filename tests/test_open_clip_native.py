"""open_clip architectures hype does not translate (ResNets, timm and Hugging Face towers, CoCa, ...) run as
open_clip's own model behind a hype CLIP's interface: the CLIP scorer (`hype score --clip`) and
`hype eval --model` take them as they are; converting, `--meru` and `hype train --init` refuse them.

The reference is open_clip itself: a random-init model from `open_clip.create_model`, its own preprocess
(`image_transform_v2` of the model's preprocess config), its own tokenizer (`get_tokenizer`) and its own
`encode_image` / `encode_text(normalize=True)`. The ResNet is a tiny `ModifiedResNet` registered under its
own name (RN50 itself is too slow to run on the test machine; its config is checked without weights).
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import open_clip
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import save_file

from hype.checkpoint import load_model_file, model_file_config, model_file_digest
from hype.data.imageprep import Preprocess
from hype.io.weights import ModelFileError
from hype.models.open_clip_files import read_open_clip
from hype.models.open_clip_format import UnsupportedArchitecture, builtin_config
from hype.models.open_clip_native import OpenClipModel, build_open_clip_model

TEXTS = ["a photo of a red cube", "two blue spheres on grass", "", "a very long caption " * 20]
TINY_RN = "hype-test-RN-tiny"
# A ModifiedResNet image tower (stem, 4 bottleneck stages, attention pool) at 64 px; the text width is a
# multiple of 64 with heads = width / 64, as OpenAI's layout implies.
TINY_RN_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1], "width": 16, "patch_size": None},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 1},
}


@pytest.fixture(scope="module")
def rn(tmp_path_factory) -> torch.nn.Module:
    """A random-init open_clip model of the tiny ResNet, its config registered as a built-in name."""
    from open_clip import factory

    folder = tmp_path_factory.mktemp("rn-config")
    (folder / f"{TINY_RN}.json").write_text(json.dumps(TINY_RN_CFG))
    open_clip.add_model_config(folder / f"{TINY_RN}.json")
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_RN).eval()
    with torch.no_grad():
        model.logit_scale.fill_(2.5)
    yield model
    # Other tests list open_clip's names: leave the registry as it was.
    factory._MODEL_CONFIG_PATHS.remove(folder / f"{TINY_RN}.json")
    factory._MODEL_CONFIGS.pop(TINY_RN)


@pytest.fixture(scope="module")
def layouts(rn, tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """The tiny ResNet in the layouts users have: name -> (path, --arch needed or None)."""
    root = tmp_path_factory.mktemp("rn")
    sd = {k: v.contiguous() for k, v in rn.state_dict().items()}
    hf = root / "hf"
    hf.mkdir()
    (hf / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_RN_CFG, "preprocess_cfg": {}}))
    save_file(sd, str(hf / "open_clip_model.safetensors"))
    # The Hugging Face cache: models--org--name/snapshots/<commit>/ named by refs/main.
    cache = root / "models--org--rn"
    shutil.copytree(hf, cache / "snapshots" / "abc123")
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("abc123\n")
    # open_clip_train: <run>/params.txt, <run>/checkpoints/epoch_N.pt with DDP's module. prefix.
    run = root / "logs" / "rn"
    (run / "checkpoints").mkdir(parents=True)
    (run / "params.txt").write_text(f"batch_size: 4\nmodel: {TINY_RN}\nprecision: amp\n")
    train_state = {
        "epoch": 3,
        "name": "rn",
        "state_dict": {"module." + k: v for k, v in sd.items()},
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]},
    }
    torch.save(train_state, run / "checkpoints" / "epoch_3.pt")
    bare = root / "bare"
    bare.mkdir()
    save_file(sd, str(bare / "rn.safetensors"))
    torch.save(sd, bare / "rn.pt")
    return {
        "HF folder": (hf, None),
        "HF cache folder": (cache, None),
        "open_clip_train run folder": (run, None),
        "open_clip_train epoch_N.pt": (run / "checkpoints" / "epoch_3.pt", None),
        "bare .safetensors + --arch": (bare / "rn.safetensors", TINY_RN),
        "bare .pt + --arch": (bare / "rn.pt", TINY_RN),
    }


def _hf_folder(hf: Path, model_cfg: dict, preprocess_cfg: dict) -> tuple[Path, torch.nn.Module]:
    """A Hugging Face folder with a random-init model of this config, and open_clip's model of it."""
    hf.mkdir(exist_ok=True)
    config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}
    (hf / "open_clip_config.json").write_text(json.dumps(config))
    torch.manual_seed(1)
    oc = open_clip.create_model(f"local-dir:{hf}").eval()
    sd = {k: v.contiguous() for k, v in oc.state_dict().items()}
    save_file(sd, str(hf / "open_clip_model.safetensors"))
    return hf, oc


def _images(n: int = 3) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (50 + 37 * i, 90, 3), dtype=np.uint8)) for i in range(n)]


def _their_preprocess(oc: torch.nn.Module):
    from open_clip.transform import PreprocessCfg, image_transform_v2

    return image_transform_v2(PreprocessCfg(**open_clip.get_model_preprocess_cfg(oc)), False)


def _max_diffs(model, oc, tokenizer) -> tuple[float, float]:
    """|ours - open_clip's| on the same preprocessed images and tokens; hype's preprocessing and tokenizer
    are checked equal to open_clip's on the way."""
    images = _images()
    theirs = torch.stack([_their_preprocess(oc)(im) for im in images])
    prep = Preprocess.of(model)
    assert torch.equal(prep.batch([prep.pixels(im) for im in images], "cpu"), theirs)
    assert torch.equal(torch.stack([model.preprocess(False)(im) for im in images]), theirs)
    tokens = tokenizer(TEXTS)
    assert torch.equal(model.tokenizer()(TEXTS), tokens)
    with torch.no_grad():
        d_img = (model.encode_image(theirs) - oc.encode_image(theirs, normalize=True)).abs().max().item()
        d_txt = (model.encode_text(tokens) - oc.encode_text(tokens, normalize=True)).abs().max().item()
    return d_img, d_txt


def test_a_resnet_embeds_as_open_clips_own_model_in_every_layout(rn, layouts):
    tokenizer = open_clip.get_tokenizer(TINY_RN)
    digests = set()
    for name, (path, arch) in layouts.items():
        model = load_model_file(path, arch=arch)
        assert isinstance(model, OpenClipModel), name
        assert (model.config.name, model.geometry.name, model.curv) == (TINY_RN, "clip", None), name
        assert (model.config.embed_dim, model.config.vision.image_size) == (32, 64), name
        d_img, d_txt = _max_diffs(model, rn, tokenizer)
        assert d_img <= 1e-6 and d_txt <= 1e-6, (name, d_img, d_txt)
        assert model.logit_scale.item() == pytest.approx(np.exp(2.5), rel=1e-6), name
        digests.add(model_file_digest(path))
    # What `hype score` reads before loading: the geometry, and the digest its fingerprints hold (the HF
    # folder and its cache copy are the same bytes; the run folder and its epoch file are one source).
    assert model_file_config(layouts["open_clip_train run folder"][0])["geometry"] == "clip"
    assert len(digests) == 4


def test_the_real_resnet_names_resolve_to_open_clips_configs():
    """RN50 by name: open_clip's config, OpenAI's preprocessing and tokenizer (built on the meta device: no
    weights); OpenAI's RN50 archive is recognised as RN50-quickgelu from its tensor shapes."""
    from hype.models.open_clip_format import OPENAI_EXTRAS, builtin_name, infer_openai_config

    with torch.device("meta"):
        model = build_open_clip_model(builtin_config("RN50"), {}, name="RN50", device="meta")
    assert type(model.open_clip.visual).__name__ == "ModifiedResNet"
    c = model.config
    assert (c.embed_dim, c.vision.image_size, c.text.context_length) == (1024, 224, 77)
    assert (c.preprocess.mean, c.preprocess.std) == (
        open_clip.OPENAI_DATASET_MEAN,
        open_clip.OPENAI_DATASET_STD,
    )
    assert (c.preprocess.resize_mode, c.preprocess.interpolation) == ("shortest", "bicubic")
    assert torch.equal(model.tokenizer()(TEXTS), open_clip.get_tokenizer("RN50")(TEXTS))
    shapes = {k: torch.empty(v.shape) for k, v in model.open_clip.state_dict().items()}
    shapes.update({k: torch.tensor(0) for k in OPENAI_EXTRAS})
    assert builtin_name(infer_openai_config(shapes)) == "RN50-quickgelu"


def test_an_openai_resnet_release_archive_loads_without_arch(rn, tmp_path):
    """OpenAI's RN50.pt is a traced fp16 TorchScript archive; the architecture is read off the shapes as
    open_clip does (QuickGELU), and the tensors without running the archive's code. The reference is what
    open_clip makes of the archive (`load_openai_model`, fp32)."""
    import copy
    import warnings

    from open_clip.openai import load_openai_model
    from test_torchscript import openai_archive

    oc = open_clip.create_model(TINY_RN, force_quick_gelu=True).eval()
    oc.load_state_dict(rn.state_dict())
    path = openai_archive(copy.deepcopy(oc), tmp_path / "RN.pt", torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated; it is the reference here
        theirs = load_openai_model(str(path), precision="fp32", device="cpu").eval()
    imported = read_open_clip(path, native=True)
    assert imported.layout == "openai" and isinstance(imported.model, OpenClipModel)
    d_img, d_txt = _max_diffs(imported.model, theirs, open_clip.get_tokenizer(TINY_RN))
    assert d_img <= 1e-6 and d_txt <= 1e-6, (d_img, d_txt)


_TEXT = {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 1}
# Tiny configs of the other kinds of open_clip model, each with a preprocess config of its own.
OTHER_KINDS = {
    "timm ConvNeXt image tower, CustomTextCLIP (text.* keys)": (
        {
            "embed_dim": 32,
            "custom_text": True,
            "vision_cfg": {"timm_model_name": "test_convnext", "timm_pool": "avg", "image_size": 48},
            "text_cfg": _TEXT,
        },
        {
            "mean": [0.5, 0.4, 0.3],
            "std": [0.2, 0.25, 0.3],
            "interpolation": "bilinear",
            "resize_mode": "squash",
        },
    ),
    "CoCa (attentional pooling, multimodal decoder)": (
        {
            "embed_dim": 32,
            "custom_text": True,
            "multimodal_cfg": {**_TEXT, "n_queries": 4, "attn_pooler_heads": 1},
            "vision_cfg": {
                "image_size": 32,
                "layers": 1,
                "width": 64,
                "patch_size": 16,
                "output_tokens": True,
            },
            "text_cfg": {**_TEXT, "embed_cls": True, "output_tokens": True},
        },
        {"resize_mode": "longest"},
    ),
    "SigLIP-style ViT (avg pool, logit bias, non-causal text pooled last)": (
        {
            "embed_dim": 32,
            "init_logit_bias": -10,
            "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 16, "pool_type": "avg"},
            "text_cfg": {**_TEXT, "no_causal_mask": True, "pool_type": "last"},
        },
        {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]},
    ),
}


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_other_kinds_of_model_embed_as_open_clips_own_model(kind, tmp_path):
    """A Hugging Face folder of each kind loads as open_clip's own model with its own preprocessing."""
    cfg, pre = OTHER_KINDS[kind]
    hf, oc = _hf_folder(tmp_path / "hf", cfg, pre)
    model = load_model_file(hf)
    assert isinstance(model, OpenClipModel) and model.config.name == "hf"
    assert type(model.open_clip) is type(oc)
    p = model.config.preprocess
    assert p.resize_mode == pre.get("resize_mode", "shortest")
    assert p.interpolation == pre.get("interpolation", "bicubic")
    assert list(p.mean) == pre.get("mean", list(open_clip.OPENAI_DATASET_MEAN))
    d_img, d_txt = _max_diffs(model, oc, open_clip.get_tokenizer(f"local-dir:{hf}"))
    assert d_img <= 1e-6 and d_txt <= 1e-6, (d_img, d_txt)


# --- what refuses it --------------------------------------------------------------------------------


def test_convert_and_train_init_refuse_it_naming_the_use(layouts, tmp_path):
    from hype.cli import main

    hf = layouts["HF folder"][0]
    out = tmp_path / "x.safetensors"
    result = CliRunner().invoke(main, ["convert", "open-clip", str(hf), "--out", str(out)])
    assert result.exit_code != 0
    text = " ".join(result.output.split())
    assert f"'{TINY_RN}'" in text and "ResNet" in text, text
    assert "hype score --clip SRC" in text and "hype eval --model SRC" in text, text
    assert not out.exists()
    with pytest.raises(UnsupportedArchitecture, match="hype train --init"):
        load_model_file(hf, hype_towers=True)


def test_a_bare_file_without_arch_lists_the_resnet_names_of_its_shapes(layouts):
    bare = layouts["bare .safetensors + --arch"][0]
    with pytest.raises(ModelFileError, match=f"pass --arch NAME, e.g. one of: {TINY_RN}$"):
        load_model_file(bare)


def test_a_file_missing_tensors_is_refused_naming_them(layouts, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(layouts["bare .safetensors + --arch"][0])
    del sd["visual.attnpool.c_proj.bias"]
    save_file(sd, str(tmp_path / "cut.safetensors"))
    with pytest.raises(ModelFileError, match=rf"do not match architecture '{TINY_RN}'.*missing.*c_proj.bias"):
        load_model_file(tmp_path / "cut.safetensors", arch=TINY_RN)


def test_score_refuses_it_as_meru_and_train_refuses_it_as_init(layouts, tmp_path_factory, tmp_path):
    from test_score_support import models, run_cli, score_args, world

    from hype.cli import main

    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    hf = layouts["HF folder"][0]
    result = run_cli(score_args(w, hf, clip, tmp_path / "run"))
    assert result.exit_code != 0 and "--meru" in result.output and "'clip' model" in result.output
    args = [
        "train",
        "--config",
        "tiny-clip",
        "--data",
        str(w / "clean" / "shards"),
        "--out",
        str(tmp_path / "t"),
    ]
    result = CliRunner().invoke(main, [*args, "--init", str(hf), "--no-progress"])
    assert result.exit_code != 0
    assert TINY_RN in result.output and "hype score --clip" in " ".join(result.output.split()), result.output


# --- hype score --clip and hype eval --model ----------------------------------------------------------


def _shard_pairs(tar_path: Path) -> dict[str, tuple[bytes, str]]:
    """uid -> (image bytes, caption) read straight from a webdataset tar."""
    members: dict[str, dict[str, bytes]] = {}
    with tarfile.open(tar_path) as tar:
        for m in tar.getmembers():
            key, _, ext = m.name.partition(".")
            members.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return {json.loads(f["json"])["uid"]: (f["jpg"], f["txt"].decode()) for f in members.values()}


def _score_equals_open_clips(path: Path, oc, tokenizer, tmp_path_factory, out: Path) -> None:
    """cos θ of `hype score --clip path` equals open_clip's own cosine, computed here one sample at a time
    from the tar (PIL decode, open_clip's transform and tokenizer, encode_*(normalize=True))."""
    from test_score_support import models, run_cli, score_args, world

    w = world(tmp_path_factory)
    meru, _ = models(tmp_path_factory)
    shard = w / "pool" / "shards" / "00000000.tar"
    args = score_args(w, meru, path, out)
    args[args.index("--pool") + 1] = str(shard)
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    got = pq.read_table(out / "scores" / "part-00000000.parquet").to_pandas()
    pairs = _shard_pairs(shard)
    assert len(got) == len(pairs) > 0
    transform = _their_preprocess(oc)
    want = []
    with torch.no_grad():
        for uid in got.uid:
            data, caption = pairs[uid]
            image = transform(Image.open(io.BytesIO(data)).convert("RGB")).unsqueeze(0)
            img = oc.encode_image(image, normalize=True)
            txt = oc.encode_text(tokenizer([caption]), normalize=True)
            want.append(float((img * txt).sum()))
    diff = np.abs(got.cos_theta.to_numpy(np.float64) - np.array(want)).max()
    assert diff <= 1e-6, diff
    assert np.ptp(want) > 1e-3  # the scores differ between samples: equality is not a constant
    assert json.loads((out / "summary.json").read_text())["status"] == "complete"


def test_score_takes_a_resnet_as_the_clip_scorer(rn, layouts, tmp_path_factory, tmp_path):
    path = layouts["HF cache folder"][0]
    _score_equals_open_clips(path, rn, open_clip.get_tokenizer(TINY_RN), tmp_path_factory, tmp_path / "run")


def test_a_scorer_with_its_own_tokenizer_settings_gets_its_own_tokens(tmp_path_factory, tmp_path):
    """A CLIP whose tokenizer cleans text its own way (SigLIP's `canonicalize`: no punctuation) at the MERU's
    context length (32) is not handed the MERU's tokens: the captions have commas and periods."""
    cfg = json.loads(json.dumps(TINY_RN_CFG))
    cfg["text_cfg"].update(context_length=32, tokenizer_kwargs={"clean": "canonicalize"})
    hf, oc = _hf_folder(tmp_path / "hf", cfg, {})
    tokenizer = open_clip.get_tokenizer(f"local-dir:{hf}")
    plain = open_clip.tokenizer.SimpleTokenizer(context_length=32)  # what the MERU (tiny-hyperbolic) uses
    assert not torch.equal(tokenizer(["a cube, a disc."]), plain(["a cube, a disc."]))
    _score_equals_open_clips(hf, oc, tokenizer, tmp_path_factory, tmp_path / "run")


@pytest.mark.slow
def test_eval_takes_a_resnet_and_matches_clip_benchmark(rn, layouts, tmp_path_factory):
    """`hype eval --model <run folder>` on the synthetic suite; on classification and retrieval its metrics
    equal clip_benchmark's (DataComp's evaluator) on open_clip's own model."""
    from hype.cli import main
    from hype.synth import make_world

    root = tmp_path_factory.mktemp("rn-eval")
    world = root / "world"
    make_world(world, 16, 0, clean_size=8, eval_size=12, reference_per_class=1, shard_size=16, workers=1)
    out = root / "eval_results.jsonl"
    run = layouts["open_clip_train run folder"][0]
    args = ["eval", "--model", str(run), "--data-dir", str(world), "--out", str(out), "--tasks", "synthetic"]
    result = CliRunner().invoke(
        main, [*args, "--workers", "0", "--batch-size", "16", "--no-progress", "--json"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert [t["status"] for t in summary["tasks"]] == ["done"] * 7
    assert summary["model"]["config"] == TINY_RN
    ours = {json.loads(line)["key"]: json.loads(line)["metrics"] for line in out.read_text().splitlines()}

    pytest.importorskip("clip_benchmark", reason="pip install -e '.[dev]' (clip-benchmark)")
    from test_clip_benchmark import TASKS, theirs_metrics

    for key in TASKS:
        theirs = theirs_metrics(rn, _their_preprocess(rn), open_clip.get_tokenizer(TINY_RN), world, key)
        for metric, value in theirs.items():
            assert ours[key][metric] == pytest.approx(value, abs=1e-6), (key, metric)


# --- Hugging Face tokenizers and text towers, read locally ---------------------------------------------


def test_hugging_face_tokenizer_and_text_tower_need_transformers(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a)
    )
    with pytest.raises(ModelFileError, match="pip install transformers"):
        build_open_clip_model(builtin_config("ViT-B-16-SigLIP"), {}, name="ViT-B-16-SigLIP")


def test_a_missing_hugging_face_tokenizer_names_the_repo_to_fetch(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelFileError, match=r"hf download timm/ViT-B-16-SigLIP\b"):
        build_open_clip_model(builtin_config("ViT-B-16-SigLIP"), {}, name="ViT-B-16-SigLIP")


def _hf_tokenizer_model(hf: Path, repo: str) -> torch.nn.Module:
    """A SigLIP-like model folder (its own Hugging Face tokenizer, `canonicalize` cleaning, a text tower
    pooled at the last token) with the tokenizer's files beside it, as open_clip's push_to_hf_hub writes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "</s>", "a", "photo", "of", "red", "cube", "two", "blue", "spheres", "on"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    fast.save_pretrained(hf)
    text = {**_TEXT, "vocab_size": len(words), "hf_tokenizer_name": repo, "pad_id": 0}
    text.update(tokenizer_kwargs={"clean": "canonicalize"}, no_causal_mask=True, pool_type="last")
    cfg = {"embed_dim": 32, "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 16}}
    return _hf_folder(hf, {**cfg, "text_cfg": text}, {})[1]


def test_a_hugging_face_tokenizer_is_read_from_the_model_folder_or_the_cache(monkeypatch, tmp_path):
    """Nothing is downloaded: the tokenizer comes from the model's folder, else from the Hugging Face cache
    under the config's `hf_tokenizer_name`."""
    pytest.importorskip("transformers")
    import huggingface_hub.constants

    repo = "org/tiny-tokenizer"
    hf = tmp_path / "hf"
    oc = _hf_tokenizer_model(hf, repo)
    model = load_model_file(hf)
    tokenizer = open_clip.get_tokenizer(f"local-dir:{hf}")
    assert type(tokenizer).__name__ == "HFTokenizer"
    d_img, d_txt = _max_diffs(model, oc, tokenizer)
    assert d_img <= 1e-6 and d_txt <= 1e-6, (d_img, d_txt)
    # The same model with its tokenizer only in the cache: models--org--tiny-tokenizer/snapshots/<commit>/.
    snap = tmp_path / "cache" / "models--org--tiny-tokenizer" / "snapshots" / "c0ffee"
    snap.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).rename(snap / name)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("c0ffee")
    with pytest.raises(ModelFileError, match=f"hf download {repo}"):
        load_model_file(hf)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    assert torch.equal(load_model_file(hf).tokenizer()(TEXTS), tokenizer(TEXTS))
    # Read only inside its cache entry: a nested file linking out is refused.
    (snap / "extra").mkdir()
    (snap / "extra" / "vocab.txt").symlink_to(hf / "open_clip_config.json")
    with pytest.raises(ModelFileError, match=r"extra/vocab\.txt: resolves to .*outside the Hugging Face"):
        load_model_file(hf).tokenizer()


# --- a model folder is data, never code ---------------------------------------------------------------

_EVIL_TOKENIZER = """
import pathlib
pathlib.Path({marker!r}).write_text("the model folder ran its own code")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def _evil_tokenizer_folder(tmp_path: Path, kwargs: dict) -> tuple[Path, Path]:
    """A model folder whose tokenizer declares its own code (`auto_map`) and whose config asks for
    `tokenizer_kwargs` `kwargs`; importing that code writes `marker`."""
    hf, marker = tmp_path / "hf", tmp_path / "executed"
    _hf_tokenizer_model(hf, "org/evil")
    (hf / "tokenization_evil.py").write_text(_EVIL_TOKENIZER.format(marker=str(marker)))
    tok = json.loads((hf / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    tok["tokenizer_class"] = "EvilTokenizer"
    (hf / "tokenizer_config.json").write_text(json.dumps(tok))
    cfg = json.loads((hf / "open_clip_config.json").read_text())
    cfg["model_cfg"]["text_cfg"]["tokenizer_kwargs"] = kwargs
    (hf / "open_clip_config.json").write_text(json.dumps(cfg))
    return hf, marker


@pytest.mark.parametrize(
    "kwargs",
    [{"trust_remote_code": True}, {"clean": "canonicalize"}],
    ids=["asks for trust_remote_code", "plain options"],
)
def test_a_model_folder_never_runs_its_own_code(monkeypatch, tmp_path, kwargs):
    """`hype score --clip DIR` / `hype eval --model DIR` load DIR with `load_model_file`: a tokenizer that
    declares its own Python (`auto_map`) is refused by name, whatever loader options the config asks for
    (`trust_remote_code` among them), and its code is never imported."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    hf, marker = _evil_tokenizer_folder(tmp_path, kwargs)
    refusal = r"tokenizer_config\.json: declares Python code|tokenizer_kwargs 'trust_remote_code'"
    with pytest.raises(ModelFileError, match=refusal):
        load_model_file(hf)
    assert not marker.exists()


def test_tokenizer_options_from_a_model_file_are_an_allow_list(tmp_path):
    """Only the tokenizer options open_clip's configs use (and only their known values) pass from a model
    file to a tokenizer; anything else (a loader option such as `trust_remote_code`, `bpe_path`, a
    `cache_dir`) is refused by name before any loader is called."""
    for bad in ({"trust_remote_code": True}, {"bpe_path": "/etc/passwd"}, {"clean": "exec"}):
        cfg = json.loads(json.dumps(TINY_RN_CFG))
        cfg["text_cfg"]["tokenizer_kwargs"] = bad
        hf, _ = _hf_folder(tmp_path / f"rn-{next(iter(bad))}", cfg, {})
        with pytest.raises(ModelFileError, match=rf"tokenizer_kwargs.*{next(iter(bad))}"):
            load_model_file(hf)

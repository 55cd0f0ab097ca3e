"""`hype score --clip` takes the open_clip model a user has, as is, in every layout: the cos θ column equals
the run with the same model as a hype checkpoint (the baseline run of `test_score_support`)."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file
from test_score_support import baseline, models, run_cli, score_args, world

from hype.convert.open_clip import export_open_clip
from hype.models.open_clip_format import state_dict_to_open_clip


def _layouts(tmp_path, clip_ckpt):
    """The baseline's CLIP scorer as open_clip files: name -> path given to --clip."""
    from hype.checkpoint import load_checkpoint

    export_open_clip(clip_ckpt, tmp_path / "hf")
    out = {"HF folder": tmp_path / "hf"}
    cache = tmp_path / "models--org--clip"
    snap = cache / "snapshots" / "abc123"
    shutil.copytree(tmp_path / "hf", snap)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("abc123\n")
    out["HF cache folder"] = cache
    # open_clip_train run: the config sits at the run's top (open_clip_config.json), weights in checkpoints/.
    run = tmp_path / "logs" / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "hf" / "open_clip_config.json", run)
    (run / "params.txt").write_text("model: tiny-clip\nprecision: amp\n")
    sd = state_dict_to_open_clip(load_checkpoint(clip_ckpt))
    torch.save(
        {"epoch": 1, "name": "run", "state_dict": {"module." + k: v for k, v in sd.items()}},
        run / "checkpoints" / "epoch_1.pt",
    )
    out["open_clip_train epoch_N.pt"] = run / "checkpoints" / "epoch_1.pt"
    # A second weights file in the folder: open_clip_model.safetensors still wins, as in open_clip.
    save_file(sd, str(tmp_path / "hf" / "extra.safetensors"))
    return out


def test_score_takes_open_clip_models_as_the_clip_scorer(tmp_path_factory, tmp_path):
    base = baseline(tmp_path_factory)
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    shard = w / "pool" / "shards" / "00000000.tar"
    want = pq.read_table(base / "scores" / "part-00000000.parquet").to_pandas()
    for name, path in _layouts(tmp_path, clip).items():
        out = tmp_path / f"run-{name.replace(' ', '_')}"
        args = score_args(w, meru, path, out)
        args[args.index("--pool") + 1] = str(shard)
        result = run_cli(args)
        assert result.exit_code == 0, (name, result.output)
        got = pq.read_table(out / "scores" / "part-00000000.parquet").to_pandas()
        assert list(got.uid) == list(want.uid), name
        assert (got.cos_theta.to_numpy() == want.cos_theta.to_numpy()).all(), name
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "complete", name


def test_score_takes_an_openai_release_archive(tmp_path_factory, tmp_path):
    """OpenAI's layout implies heads = width / 64, so the scorer here is a CLIP of that shape; the run with
    its TorchScript archive equals the run with the same weights as a hype checkpoint."""
    import open_clip
    from test_torchscript import openai_archive

    from hype.checkpoint import save_checkpoint
    from hype.models import create_model, load_model_config
    from hype.models.open_clip_format import open_clip_config

    w = world(tmp_path_factory)
    meru, _ = models(tmp_path_factory)
    cfg = load_model_config("tiny-clip").to_dict()
    cfg["quick_gelu"] = True
    cfg["vision"]["head_width"] = 64
    cfg["text"]["heads"] = cfg["text"]["width"] // 64
    torch.manual_seed(5)
    model = create_model(cfg).eval()
    save_checkpoint(tmp_path / "clip.safetensors", model)
    oc = open_clip.model.CLIP(**open_clip_config(model.config)["model_cfg"]).eval()
    oc.load_state_dict(state_dict_to_open_clip(model))
    archive = openai_archive(oc, tmp_path / "ViT-T-8.pt")
    shard = w / "pool" / "shards" / "00000002.tar"
    columns = {}
    for name, clip in (("hype", tmp_path / "clip.safetensors"), ("openai", archive)):
        args = score_args(w, meru, clip, tmp_path / name)
        args[args.index("--pool") + 1] = str(shard)
        result = run_cli(args)
        assert result.exit_code == 0, (name, result.output)
        columns[name] = pq.read_table(tmp_path / name / "scores" / "part-00000000.parquet").to_pandas()
    assert list(columns["hype"].uid) == list(columns["openai"].uid)
    assert (columns["hype"].cos_theta.to_numpy() == columns["openai"].cos_theta.to_numpy()).all()

"""HyCoCLIP's data (#36 §2): GRIT grounding in the synthetic world's JSON, read as the authors prepare
GRIT, and `hype train --config tiny-hycoclip` end to end."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from test_train_data import good, write_shard
from train_helpers import MICRO

from hype.checkpoint import load_checkpoint
from hype.cli.train import train as train_cmd
from hype.data.grounding import NO_GROUNDING, grit_boxes
from hype.data.pipeline import TrainStream
from hype.synth import make_world
from hype.synth.scenes import COLORS
from hype.train import load_train_config, read_metrics


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grounding") / "world"
    make_world(out, 64, 3, clean_size=96, eval_size=8, reference_per_class=1, shard_size=32, workers=1)
    return out


def _samples(world: Path):
    for tar in sorted(world.glob("*/shards/*.tar")):
        files: dict[str, dict[str, bytes]] = {}
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                key, ext = m.name.rsplit(".", 1)
                files.setdefault(key, {})[ext] = tf.extractfile(m).read()
        yield from files.values()


def test_grit_boxes_follow_the_authors_preparation():
    caption = "a red star and a blue disc near a red star"
    meta = {
        "caption": caption,
        "noun_chunks": [
            [0, 10, 0.1, 0.2, 0.5, 0.6, 0.9],  # "a red star": 40 x 40 px of 100 x 100
            [15, 26, 0.0, 0.0, 0.05, 0.05, 0.8],  # "a blue disc": 5 x 5 px, under the cutoff
            [32, 42, 0.5, 0.5, 1.0, 1.0, 0.7],  # "a red star" again: only its first box counts
            [0, 99, 0, 0, 1, 1, 1],  # a span past the caption: malformed, ignored
            "junk",
        ],
        "ref_exps": [[15, 26, 0.2, 0.2, 0.9, 0.9, 0.5], [2, 10, 0.3, 0.3, 0.99, 0.99, 0.5]],
    }
    got = grit_boxes(meta, "the .txt caption", 100, 100, min_area=32 * 32)
    # The blue disc's phrase was seen (and dropped as too small) in noun_chunks: its ref_exp is not taken.
    assert got == [("a red star", (10, 20, 50, 60)), ("red star", (30, 30, 99, 99))]
    assert grit_boxes({}, "x", 10, 10) == []


def test_the_worlds_noun_chunks_box_the_objects_their_phrases_name(world):
    inside = total = rows = 0
    for files in _samples(world):
        meta = json.loads(files["json"])
        assert meta["ref_exps"] == []
        spans: dict[tuple[int, int], list] = {}
        for start, end, *box, score in meta["noun_chunks"]:
            assert 0 <= start < end <= len(meta["caption"]) and score == 1.0
            assert 0 <= box[0] < box[2] <= 1 and 0 <= box[1] < box[3] <= 1
            spans.setdefault((start, end), []).append(box)
            rows += 1
        img = np.asarray(Image.open(io.BytesIO(files["jpg"])).convert("RGB")).astype(int)
        h, w, _ = img.shape
        for (start, end), boxes in spans.items():
            colour = [c for c in COLORS if c in meta["caption"][start:end].lower().split()]
            if not colour:
                continue
            # Every pixel of the named colour should lie in the phrase's boxes (jittered copies included).
            mask = np.abs(img - np.array(COLORS[colour[0]])).max(-1) < 40
            in_box = np.zeros_like(mask)
            for x1, y1, x2, y2 in boxes:
                in_box[int(y1 * h) : int(np.ceil(y2 * h)), int(x1 * w) : int(np.ceil(x2 * w))] = True
            inside, total = inside + (mask & in_box).sum(), total + mask.sum()
    assert rows > 50 and total > 10_000
    assert inside / total > 0.97


def _stream(shards, **kw) -> TrainStream:
    return TrainStream(
        [str(s) for s in shards],
        batch_size=4,
        shuffle_buffer=1,
        image_transform=lambda img: torch.tensor([img.width, img.height], dtype=torch.float32),
        tokenize=lambda texts: torch.tensor([[len(t)] for t in texts]),
        **kw,
    )


def test_the_stream_yields_one_box_per_sample_and_skips_or_masks_the_unboxed(tmp_path):
    boxed = {"noun_chunks": [[0, 3, 0.0, 0.0, 0.5, 0.5, 1.0]]}  # "cap": the top-left 10 x 8 px
    shard = write_shard(tmp_path / "0.tar", [good(i, **(boxed if i % 2 else {})) for i in range(8)])
    batch = next(iter(_stream([shard], grounding_min_area=64, resampled=False)))
    assert batch["images"].tolist() == [[20, 16]] * 4  # the whole 20 x 16 images
    assert batch["box_images"].tolist() == [[10, 8]] * 4 and batch["box_tokens"].tolist() == [[3]] * 4
    assert batch["skips"]["counts"] == {NO_GROUNDING: 4}
    kept = next(iter(_stream([shard], grounding_min_area=64, resampled=False, unboxed="whole")))
    assert kept["box_mask"].tolist() == [False, True, False, True] and kept["skips"]["counts"] == {}
    assert kept["box_images"][0].tolist() == [20, 16]  # the placeholder, masked out by the loss
    plain = next(iter(_stream([shard], resampled=False)))
    assert "box_images" not in plain and len(plain["images"]) == 4


def test_tiny_hycoclip_trains_from_its_preset_and_default_runs_do_not_change(world, tmp_path):
    out = tmp_path / "hc"
    args = ["--config", "tiny-hycoclip", "--data", str(world / "clean" / "shards"), "--out", str(out)]
    fast = ["data.workers=0", "data.shuffle_buffer=32", "log_every_steps=1", "optim.warmup_steps=1"]
    result = CliRunner().invoke(
        train_cmd,
        [
            *args,
            "--no-progress",
            *MICRO,
            *fast,
            "samples_seen=16",
            "batch_size=8",
            "checkpoint.every_steps=0",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2 and all(r["entailment"] > 0 and np.isfinite(r["loss"]) for r in rows)
    assert load_checkpoint(out / "model.safetensors").config.geometry == "hyperbolic"
    assert "hycoclip" in (out / "config.yaml").read_text()
    # The section exists only where it is used: every other preset's config reads as before it existed.
    assert "hycoclip" not in load_train_config("tiny-hyperbolic-scorer").to_dict()
    with pytest.raises(Exception, match="accum_steps=1"):
        load_train_config("tiny-hycoclip", ["accum_steps=2"])
    refused = CliRunner().invoke(train_cmd, [*args, "--no-progress", *MICRO, *fast, "model=tiny-euclidean"])
    assert refused.exit_code != 0 and "needs the hyperbolic geometry" in refused.output, refused.output
    assert "Traceback" not in refused.output

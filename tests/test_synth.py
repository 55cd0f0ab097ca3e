"""The synthetic world: exact layout, determinism, noise ground truth, and the `hype synth` CLI."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from PIL import Image

from hype.cli import main
from hype.data.uids import load_subset, validate_uid
from hype.io.tar import write_tar
from hype.synth import NOISE_KINDS, SynthError, make_world
from hype.synth.captions import SHAPE_WORDS, canonical_caption
from hype.synth.eval_tasks import OBJECT_CLASSES, TASK_NAMES
from hype.synth.noise import allocate, parse_noise
from hype.synth.render import EVAL_IMAGE_EXT
from hype.synth.rng import stream
from hype.synth.scenes import Obj, Scene

ARGS = dict(size=300, seed=7, clean_size=120, eval_size=40, reference_per_class=3, shard_size=128)
HEX32 = re.compile(r"^[0-9a-f]{32}$")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "world"
    make_world(out, **ARGS, workers=2)
    return out


@pytest.fixture(scope="module")
def truth(world):
    return pq.read_table(world / "truth.parquet").to_pandas().set_index("uid", drop=False)


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _read_tar(path: Path) -> dict[str, dict[str, bytes]]:
    """key -> {extension: bytes}, keeping the member order of the tar."""
    groups: dict[str, dict[str, bytes]] = defaultdict(dict)
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key, ext = m.name.split(".", 1)
            groups[key][ext] = tar.extractfile(m).read()
    return dict(groups)


def _decode(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


# ---- layout


def test_pool_shards_follow_img2dataset_layout(world, truth):
    shards = world / "pool" / "shards"
    tars = sorted(shards.glob("*.tar"))
    assert [t.name for t in tars] == ["00000000.tar", "00000001.tar", "00000002.tar"]  # 300 / 128
    seen = 0
    for t in tars:
        shard = int(t.stem)
        assert len(t.stem) == 8
        groups = _read_tar(t)
        stats = json.loads((shards / f"{t.stem}_stats.json").read_text())
        assert stats["count"] == stats["successes"] == len(groups)
        assert stats["failed_to_download"] == stats["failed_to_resize"] == 0
        assert stats["status_dict"] == {"success": len(groups)}
        table = pq.read_table(shards / f"{t.stem}.parquet").to_pandas()
        assert list(table.columns) == [
            "key",
            "uid",
            "url",
            "caption",
            "status",
            "error_message",
            "width",
            "height",
            "original_width",
            "original_height",
            "sha256",
        ]
        assert list(table["key"]) == list(groups)
        for (key, files), row in zip(groups.items(), table.itertuples(), strict=True):
            assert set(files) == {"jpg", "txt", "json"}
            assert re.fullmatch(r"\d{9}", key) and int(key[:5]) == shard
            meta = json.loads(files["json"])
            assert HEX32.match(meta["uid"]) and validate_uid(meta["uid"])
            assert meta["uid"] == row.uid and meta["key"] == key == row.key
            assert meta["status"] == "success" and meta["error_message"] is None
            assert meta["caption"] == files["txt"].decode("utf-8") == row.caption
            assert meta["sha256"] == hashlib.sha256(files["jpg"]).hexdigest() == row.sha256
            img = _decode(files["jpg"])
            assert (
                img.size
                == (meta["width"], meta["height"])
                == (meta["original_width"], meta["original_height"])
            )
            assert meta["url"] == f"http://127.0.0.1:8000/images/{meta['uid']}.jpg"
            # The raw file behind the url holds the very same bytes.
            assert (world / "pool" / "images" / f"{meta['uid']}.jpg").read_bytes() == files["jpg"]
            t_row = truth.loc[meta["uid"]]
            assert (t_row["key"], t_row["shard"], t_row["caption"]) == (key, shard, meta["caption"])
            seen += 1
    assert seen == ARGS["size"] == len(truth)
    assert len(list((world / "pool" / "images").glob("*.jpg"))) == ARGS["size"]


def test_pool_metadata_is_datacomp_layout(world, truth):
    files = list((world / "pool" / "metadata").glob("*.parquet"))
    assert len(files) == 1 and HEX32.match(files[0].stem)
    meta = pq.read_table(files[0]).to_pandas()
    assert list(meta.columns) == ["uid", "url", "text", "original_width", "original_height", "sha256"]
    assert len(meta) == ARGS["size"]
    assert set(meta["uid"]) == set(truth["uid"])
    assert (meta["text"].to_numpy() == truth.loc[meta["uid"], "caption"].to_numpy()).all()


def test_truth_columns_and_world_json(world, truth):
    for col in [
        "uid",
        "key",
        "shard",
        "noise",
        "text_level",
        "image_level",
        "shape",
        "color",
        "count",
        "size",
        "position",
        "background",
        "caption",
        "source_uid",
    ]:
        assert col in truth.columns
    w = json.loads((world / "world.json").read_text())
    assert w["format_version"] == 1 and w["seed"] == ARGS["seed"]
    assert w["counts"]["pool"] == ARGS["size"] and w["counts"]["clean"] == ARGS["clean_size"]
    assert w["noise_counts"] == truth["noise"].value_counts().to_dict()
    assert sum(w["noise_counts"].values()) == ARGS["size"]
    assert w["eval_tasks"] == list(TASK_NAMES)
    assert str(world) not in (world / "world.json").read_text()  # no absolute paths: worlds are portable


def test_clean_set_spans_specificity_tiers_and_shares_nothing_with_the_pool(world):
    tars = sorted((world / "clean" / "shards").glob("*.tar"))
    assert [t.name for t in tars] == ["00000000.tar"]
    groups = _read_tar(tars[0])
    assert len(groups) == ARGS["clean_size"]
    assert json.loads((tars[0].parent / "00000000_stats.json").read_text())["count"] == ARGS["clean_size"]
    clean = pq.read_table(world / "clean" / "truth.parquet").to_pandas()
    assert set(clean["noise"]) == {"clean"}
    assert (clean["caption"] == clean["true_caption"]).all()
    # Both sides span specificity: generic images with generic captions (level 0), crops and single
    # objects with short captions, detailed scenes with detailed ones.
    assert set(clean["text_level"]) == {0, 1, 2, 3, 4}
    assert set(clean["image_kind"]) == {"background", "crowd", "single", "multi", "mix", "crop"}
    generic = clean["image_kind"].isin(["background", "crowd"])
    assert (clean.loc[generic, "text_level"] == 0).all() and (clean.loc[generic, "image_level"] <= 1).all()
    assert (clean.loc[clean["image_kind"] == "crop", "text_level"] <= 2).all()
    assert (clean.loc[clean["image_kind"].isin(["multi", "mix"]), "text_level"] >= 3).all()
    # A crop is square and captioned as the object it is centred on.
    crops = clean[clean["image_kind"] == "crop"]
    assert (crops["width"] == crops["height"]).all()
    for _, row in crops.iterrows():
        words = row["caption"].lower()
        assert any(w in words for w in SHAPE_WORDS[row["shape"]]), row["caption"]
    # None of the pool's noise recipes: no blank/noise/clutter image, no underspecified text.
    pool = pq.read_table(world / "truth.parquet").to_pandas()
    assert not set(clean["image_kind"]) & {"blank", "noise", "clutter"}
    assert not set(clean["caption"]) & set(pool.loc[pool["noise"] == "underspecified_text", "caption"])
    assert not set(clean["uid"]) & set(pool["uid"])


def test_eval_tasks_follow_clip_benchmark_layout(world):
    ev = world / "eval"
    assert sorted(p.name for p in ev.iterdir() if p.name.startswith("wds_")) == sorted(
        f"wds_{t.replace('/', '-')}_test" for t in TASK_NAMES
    )
    for task in TASK_NAMES:
        folder = ev / f"wds_{task.replace('/', '-')}_test"
        test = folder / "test"
        n = int((test / "nshards.txt").read_text())
        assert sorted(p.name for p in test.glob("*.tar")) == [f"{i}.tar" for i in range(n)]
        samples = {}
        for i in range(n):
            samples.update(_read_tar(test / f"{i}.tar"))
        assert len(samples) == ARGS["eval_size"]
        if task == "synth/retrieval":
            assert not (folder / "classnames.txt").exists()
            assert (folder / "dataset_type.txt").read_text().strip() == "retrieval"
            for files in samples.values():
                assert set(files) == {EVAL_IMAGE_EXT, "txt"}
                lines = files["txt"].decode().split("\n")
                assert len(lines) == 5 and all(lines) and len(set(lines)) >= 3
            continue
        classes = (folder / "classnames.txt").read_text().splitlines()
        templates = (folder / "zeroshot_classification_templates.txt").read_text().splitlines()
        assert len(classes) == len(set(classes)) >= 4 and templates
        assert all("{c}" in t for t in templates)
        labels = []
        for files in samples.values():
            assert set(files) == {EVAL_IMAGE_EXT, "cls"}
            labels.append(int(files["cls"]))
            assert _decode(files[EVAL_IMAGE_EXT]).size == (64, 64)
        assert 0 <= min(labels) and max(labels) < len(classes)
        if len(classes) <= ARGS["eval_size"]:
            assert len(set(labels)) == len(classes)  # balanced: every class present
    assert (ev / "wds_synth-objects_test" / "classnames.txt").read_text().splitlines() == list(OBJECT_CLASSES)
    assert len(OBJECT_CLASSES) == 64


def test_reference_set(world):
    ref = world / "eval" / "reference"
    classes = (ref / "classnames.txt").read_text().splitlines()
    assert classes == list(OBJECT_CLASSES)
    n = int((ref / "train" / "nshards.txt").read_text())
    samples = {}
    for i in range(n):
        samples.update(_read_tar(ref / "train" / f"{i}.tar"))
    assert len(samples) == 64 * ARGS["reference_per_class"]
    labels = [int(f["cls"]) for f in samples.values()]
    assert np.bincount(labels).tolist() == [ARGS["reference_per_class"]] * 64
    assert all(_decode(f["jpg"]).size == (64, 64) for f in list(samples.values())[:20])


# ---- determinism


def test_same_seed_gives_identical_bytes_whatever_the_worker_count(world, tmp_path):
    again = tmp_path / "again"
    make_world(again, **ARGS, workers=1)
    a, b = _hashes(world), _hashes(again)
    assert len(a) > 300 and a == b


def test_different_seed_differs(world, tmp_path):
    other = tmp_path / "other"
    make_world(other, **{**ARGS, "seed": 8, "clean_size": 10, "reference_per_class": 1}, workers=1)
    a, b = _hashes(world), _hashes(other)
    for name in ["pool/shards/00000000.tar", "truth.parquet", "eval/wds_synth-objects_test/test/0.tar"]:
        assert a[name] != b[name]


# ---- ground truth of the noise


def test_every_noise_kind_is_present(truth):
    counts = truth["noise"].value_counts().to_dict()
    assert set(counts) == set(NOISE_KINDS)
    assert 0.4 < counts["clean"] / len(truth) < 0.6


def test_misaligned_captions_belong_to_another_image(truth):
    mis = truth[truth["noise"] == "misaligned"]
    assert len(mis) > 0
    assert (mis["caption"] != mis["true_caption"]).all()
    for _, row in mis.iterrows():
        if row["source_uid"] is None:
            continue
        src = truth.loc[row["source_uid"]]
        assert src["noise"] == "clean" and src["caption"] == row["caption"] and src["uid"] != row["uid"]
        assert src["shape"] != row["shape"] or src["shape"] == "mixed"
    assert mis["source_uid"].notna().mean() > 0.8


def test_underspecified_texts_have_level_zero(truth):
    und = truth[truth["noise"] == "underspecified_text"]
    assert len(und) > 0 and (und["text_level"] == 0).all()
    assert (truth.loc[truth["noise"] != "underspecified_text", "text_level"] > 0).all()


def test_underspecified_images(world, truth):
    und = truth[truth["noise"] == "underspecified_image"]
    assert set(und["image_kind"]) == {"blank", "noise", "clutter"}
    assert (und["image_level"] <= 1).all()
    assert (truth.loc[truth["noise"] != "underspecified_image", "image_level"] >= 2).all()
    for _, row in und.iterrows():
        pixels = np.asarray(
            _decode((world / "pool" / "images" / f"{row['uid']}.jpg").read_bytes()), dtype=float
        )
        if row["image_kind"] == "blank":
            assert row["image_level"] == 0 and pixels.std(axis=(0, 1)).max() < 1.0
        elif row["image_kind"] == "noise":
            assert row["image_level"] == 0 and pixels.std() > 10
        else:
            assert row["image_level"] == 1 and row["shape"] == "mixed" and row["count"] >= 18


def _thumbnails(world: Path, uids) -> np.ndarray:
    """Brightness-invariant 16x16 thumbnails (zero mean, unit norm): rows compare by dot product."""
    rows = []
    for uid in uids:
        img = _decode((world / "pool" / "images" / f"{uid}.jpg").read_bytes()).resize((16, 16), Image.BOX)
        a = np.asarray(img, dtype=float).ravel()
        rows.append((a - a.mean()) / (np.linalg.norm(a - a.mean()) + 1e-6))
    return np.stack(rows)


def test_near_duplicates_copy_a_clean_sample(world, truth):
    dup = truth[truth["noise"] == "near_duplicate"]
    assert len(dup) > 0
    for _, row in dup.iterrows():
        src = truth.loc[row["source_uid"]]
        assert src["noise"] == "clean"
        for col in ["shape", "color", "count", "background", "text_level", "image_level"]:
            assert src[col] == row[col]
    # Each copy looks most like its own source among all pool images (other copies of it aside).
    thumbs = _thumbnails(world, truth["uid"])
    pos = {u: i for i, u in enumerate(truth["uid"])}
    hits = 0
    for _, row in dup.iterrows():
        sim = thumbs @ thumbs[pos[row["uid"]]]
        sim[(truth["source_uid"] == row["source_uid"]).to_numpy()] = -1  # itself and sibling copies
        hits += int(np.argmax(sim) == pos[row["source_uid"]])
    assert hits >= 0.8 * len(dup)


def test_uids_unique_and_oracle_subset(world, truth):
    assert truth["uid"].is_unique and truth["key"].is_unique
    oracle = load_subset(world / "subsets" / "oracle_clean.npy")
    assert len(oracle) == (truth["noise"] == "clean").sum()


def test_pool_images_vary_in_size(truth):
    short = np.minimum(truth["width"], truth["height"])
    aspect = np.maximum(truth["width"], truth["height"]) / short
    assert short.min() < 32 and aspect.max() > 2.5
    assert ((short >= 40) & (aspect < 1.5)).mean() > 0.85


def test_captions_name_content_at_each_level():
    star = Scene(
        "single", (Obj("star", "red", 0.28, 0.5, 0.26),), "striped", (230, 180, 0.1, 0), "large", "left"
    )
    assert canonical_caption(star, 1) == "a star"
    assert canonical_caption(star, 2) == "a red star"
    assert canonical_caption(star, 3) == "a large red star on a striped background"
    assert canonical_caption(star, 4) == "one large red star at the left on a striped background"
    two = Scene(
        "multi", (Obj("star", "red", 0.2, 0.2, 0.2), Obj("star", "red", 0.7, 0.7, 0.2)), "white", (), "large"
    )
    assert canonical_caption(two, 4) == "two large red stars on a white background"


# ---- small pieces


def test_noise_spec_and_allocation():
    f = parse_noise("misaligned=0.3")
    assert abs(sum(f.values()) - 1) < 1e-9 and f["misaligned"] > f["near_duplicate"]
    counts = allocate(7, parse_noise(None))
    assert sum(counts.values()) == 7 and min(counts.values()) >= 1
    with pytest.raises(ValueError, match="unknown noise kind"):
        parse_noise("typo=0.1")
    with pytest.raises(ValueError, match="clean"):
        parse_noise("clean=0")


def test_streams_are_named_and_independent():
    a, b = stream(1, "pool"), stream(1, "pool")
    assert [a.random() for _ in range(5000)] == [b.random() for _ in range(5000)]
    assert stream(1, "pool").random() != stream(1, "clean").random()
    assert all(0 <= stream(3, "x").integers(2, 5) - 2 < 3 for _ in range(50))


def test_tar_writer_matches_tarfile(tmp_path):
    members = [("000000000.jpg", bytes(range(256)) * 5), ("000000000.txt", "héllo".encode()), ("a.cls", b"")]
    write_tar(tmp_path / "a.tar", members)
    with tarfile.open(tmp_path / "b.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
            tar.addfile(info, io.BytesIO(data))
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()


# ---- the CLI


def test_cli_generates_world_and_eval_does_not_depend_on_pool_size(world, tmp_path):
    out = tmp_path / "cli"
    args = ["synth", "--out", str(out), "--size", "50", "--seed", "7", "--eval-size", "40"]
    args += ["--reference-per-class", "3", "--shard-size", "128", "--clean-size", "20", "--no-progress"]
    args += ["--base-url", "http://127.0.0.1:9999/"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "50 samples" in result.output and "misaligned" in result.output and str(out) in result.output
    meta = pq.read_table(next((out / "pool" / "metadata").glob("*.parquet"))).to_pandas()
    assert meta["url"].str.startswith("http://127.0.0.1:9999/images/").all()
    # The eval tasks come from their own streams: a different pool size leaves them byte-identical.
    a = {k: v for k, v in _hashes(world).items() if k.startswith("eval/")}
    b = {k: v for k, v in _hashes(out).items() if k.startswith("eval/")}
    assert a and a == b

    # A rerun with the same settings finds the world's marker and skips: nothing is written again.
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = CliRunner().invoke(main, [*args, "--workers", "1", "--json"])  # workers: not a setting
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["skipped"] is True
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    assert "already in" in CliRunner().invoke(main, args).output
    # Other settings: the world is replaced only with --overwrite.
    other = CliRunner().invoke(main, args[:4] + ["30"] + args[5:])
    assert other.exit_code != 0 and "--overwrite" in other.output
    replaced = CliRunner().invoke(main, args[:4] + ["30"] + args[5:] + ["--overwrite", "--json"])
    assert replaced.exit_code == 0, replaced.output
    assert json.loads(replaced.output)["counts"]["pool"] == 30
    assert len(pq.read_table(out / "truth.parquet")) == 30
    assert not list(tmp_path.glob(".*synth-*"))  # no temporary folders left behind


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--size", "0"], "--size"),
        (["--size", "-5"], "--size"),
        (["--size", "10", "--eval-size", "0"], "--eval-size"),
        (["--size", "10", "--shard-size", "20000"], "--shard-size"),
        (["--size", "10", "--noise", "bogus=1"], "unknown noise kind"),
        (["--size", "10", "--noise", "clean"], "NAME=FRACTION"),
        (["--size", "10", "--base-url", "127.0.0.1:8000"], "--base-url"),
        (["--size", "10", "--workers", "0"], "--workers"),
        (["--size", "ten"], "ten"),
    ],
)
def test_cli_rejects_bad_arguments(tmp_path, extra, message):
    result = CliRunner().invoke(main, ["synth", "--out", str(tmp_path / "w"), "--no-progress", *extra])
    assert result.exit_code != 0
    assert message in result.output
    assert not (tmp_path / "w").exists()


def test_overwrite_refuses_folders_that_are_not_worlds(tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    for extra, message in (([], "pass --overwrite"), (["--overwrite"], "holds no world.json")):
        result = CliRunner().invoke(
            main, ["synth", "--out", str(out), "--size", "5", "--no-progress", *extra]
        )
        assert result.exit_code != 0 and message in result.output
    assert (out / "thesis.tex").read_text() == "years of work"
    with pytest.raises(SynthError, match="not a synthetic world"):
        make_world(out, 5, overwrite=True)


def test_cli_default_base_url_matches_library():
    from hype.cli.synth import DEFAULT_BASE_URL as CLI_URL
    from hype.synth import DEFAULT_BASE_URL

    assert CLI_URL == DEFAULT_BASE_URL


def test_crop_alike_renders_are_the_ones_a_crop_could_give_and_pass_the_copy_check():
    """`crop_alike` (the benches count such false flags apart): its bounds, and its renders pass the copy
    check as a copy would (the reason no threshold separates them from copies)."""
    from dataclasses import replace

    from hype.scoring.copydetect import CopyCheck, pair_similarities, work_image
    from hype.synth.render import encode_jpeg, render
    from hype.synth.scenes import Obj, Scene, crop_alike

    a = Scene("single", (Obj("star", "red", 0.28, 0.5, 0.14, 2.0),), "white", (), "small", "left")

    def moved(**kw) -> Scene:
        return replace(a, objects=(replace(a.objects[0], **kw),))

    alike = [moved(r=0.14 * 8 / 7), moved(cx=0.28 + 0.06), moved(angle=5.0), replace(a, background="white")]
    grey = replace(a, background="gradient", bg_params=(80, 200, 0))
    differ = [moved(r=0.14 * 1.2), moved(cy=0.5 - 0.07), moved(angle=5.5), moved(color="orange"),
              replace(a, background="black"), grey]  # fmt: skip
    assert [crop_alike(a, b) for b in alike] == [True] * 4
    assert [crop_alike(a, b) or crop_alike(b, a) for b in differ] == [False] * 6
    assert not crop_alike(replace(a, crop=(0, 1.5)), replace(a, crop=(0, 1.5)))

    imgs = np.stack([work_image(encode_jpeg(render(s, 160, 160))) for s in (a, *alike[:3])])
    sims = pair_similarities(imgs, imgs, np.array([[0, 1], [0, 2], [0, 3]]), CopyCheck())
    assert (sims >= CopyCheck().threshold).all(), sims


def test_replay_plan_draws_the_worlds_pool_again(world, truth):
    """The benches read scenes beyond truth.parquet's columns from the plan drawn again (`replay_plan`)."""
    from hype.synth.world import replay_plan

    plan = replay_plan(world)
    assert [s.uid for s in plan.pool] == truth.uid.tolist()
    got = [(s.scene.shape, s.scene.color, s.scene.count, s.noise) for s in plan.pool]
    want = list(zip(truth["shape"], truth["color"], truth["count"], truth["noise"], strict=True))
    assert [tuple(None if v != v else v for v in row) for row in want] == got

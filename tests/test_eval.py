"""`hype eval` end to end: every geometry on the synthetic tasks, DataComp-layout readers (classification,
WILDS-style metadata, multi-objective fairness, retrieval, WinoGAViL), corrupt data, resume, strict."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from hype.checkpoint import save_checkpoint
from hype.cli import main
from hype.eval import RunOptions, load_suite, run_eval, select_tasks
from hype.eval.readers import decode_image
from hype.io.tar import write_tar
from hype.models import create_model, list_model_configs
from hype.synth import make_world

TINY = [name for name in list_model_configs() if name.startswith("tiny-")]
FAST = RunOptions(batch_size=16, device="cpu", workers=0, progress=False)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # These tiny models gain nothing from intra-op threads, and on a busy shared CPU two threads run
    # 2-3x slower than one; the code paths under test are the same.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval") / "world"
    make_world(out, size=24, clean_size=8, eval_size=40, reference_per_class=1, shard_size=16, workers=1)
    return out


@pytest.fixture(scope="module")
def clip_model():
    torch.manual_seed(0)
    return create_model("tiny-clip").eval()


def _model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return create_model(name).eval()


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- every geometry on the synthetic suite ----------------------------------------------------------


def test_tiny_configs_cover_every_geometry():
    from hype.geometry import GEOMETRIES

    assert {create_model(n, device="meta").geometry.name for n in TINY} == set(GEOMETRIES)


@pytest.mark.parametrize("config", TINY)
def test_every_geometry_end_to_end_on_synthetic_suite(world, tmp_path, config):
    out = tmp_path / "eval_results.jsonl"
    summary = run_eval(_model(config), select_tasks("synthetic"), world, out, FAST)
    lines = _lines(out)
    suite = load_suite("synthetic")
    assert [line["key"] for line in lines] == [t.key for t in suite.tasks]
    for line, task in zip(lines, suite.tasks, strict=True):
        assert set(line) == {"key", "dataset", "metrics"} and line["dataset"] == task.name
        m = line["metrics"]
        assert m["main_metric"] == m[task.main_metric]
        assert m["num_samples"] == 40 and m["num_skipped"] == 0 and m["num_read_errors"] == 0
        for name, value in m.items():
            if value is not None and not name.startswith("num_"):
                assert 0.0 <= value <= 1.0, (config, task.key, name, value)
    assert _lines(out)[3]["metrics"]["acc5"] is None  # synth/count has 4 classes
    # A random model cannot know the classes: accuracy stays near chance, 1/num_classes (labels are
    # balanced, so even a model that always answers the same class scores exactly chance).
    pairs = zip(lines, suite.tasks, strict=True)
    gaps = [m["metrics"]["acc1"] - 1 / t.num_classes for m, t in pairs if t.num_classes]
    assert len(gaps) == 6 and max(map(abs, gaps)) < 0.25 and abs(np.mean(gaps)) < 0.1, gaps
    (agg,) = summary["aggregates"]["synthetic"]
    assert agg["count"] == agg["total"] == 7
    assert agg["value"] == pytest.approx(np.mean([line["metrics"]["main_metric"] for line in lines]))


def test_classification_matches_an_independent_reference(world, tmp_path, clip_model):
    """Top-1 predictions equal a plain loop: PIL decode, the model's preprocess, one image at a time,
    class embeddings from the geometry's ensemble of each class's prompts."""
    task = load_suite("synthetic").get("synth/shape")
    folder = world / "eval" / task.folders[0]
    classnames = (folder / "classnames.txt").read_text().splitlines()
    templates = (folder / "zeroshot_classification_templates.txt").read_text().splitlines()
    model, tok, tf = clip_model, clip_model.tokenizer(), clip_model.preprocess(train=False)
    with torch.no_grad():
        heads = torch.stack(
            [
                model.geometry.ensemble(
                    model.encode_text(tok([t.format(c=c) for t in templates])), curv=model.curv
                )
                for c in classnames
            ]
        )
        preds, labels = [], []
        for shard in sorted((folder / "test").glob("*.tar"), key=lambda p: int(p.stem)):
            with tarfile.open(shard) as tar:
                files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
            for name in sorted(n for n in files if n.endswith(".webp")):
                image = tf(Image.open(io.BytesIO(files[name]))).unsqueeze(0)
                preds.append(int(model.similarity(model.encode_image(image), heads).argmax()))
                labels.append(int(files[name.replace(".webp", ".cls")]))
    expected = np.mean(np.array(preds) == np.array(labels))
    out = tmp_path / "r.jsonl"
    run_eval(model, [task], world, out, RunOptions(batch_size=7, device="cpu", workers=2, progress=False))
    assert _lines(out)[0]["metrics"]["acc1"] == pytest.approx(expected)


# --- results file: resume, crash, identity ---------------------------------------------------------


def test_rerun_skips_finished_tasks_and_repairs_a_crash(world, tmp_path, clip_model):
    out = tmp_path / "eval_results.jsonl"
    tasks = select_tasks("synth/shape,synth/count")
    run_eval(clip_model, tasks, world, out, FAST, identity={"m": 1})
    first = out.read_bytes()
    summary = run_eval(clip_model, tasks, world, out, FAST, identity={"m": 1})
    assert [t["status"] for t in summary["tasks"]] == ["cached", "cached"]
    assert out.read_bytes() == first
    # a crash while writing the second line: it is dropped, and that task is evaluated again
    cut = first[: first.index(b"\n") + 1] + first[first.index(b"\n") + 1 :][:25]
    out.write_bytes(cut)
    summary = run_eval(clip_model, tasks, world, out, FAST, identity={"m": 1})
    assert [t["status"] for t in summary["tasks"]] == ["cached", "done"]
    assert out.read_bytes() == first  # same model, same data: the same bytes
    with pytest.raises(ValueError, match="another model"):
        run_eval(clip_model, tasks, world, out, FAST, identity={"m": 2})


def test_results_identity_is_the_run_contract_s_fingerprint(tmp_path):
    from hype.eval.results import check_identity, identity_path
    from hype.io.runs import fingerprint, is_done

    out = tmp_path / "eval_results.jsonl"
    check_identity(out, {"checkpoint_sha256": "ab", "config": "c"})
    assert is_done(identity_path(out), fingerprint({"config": "c", "checkpoint_sha256": "ab"}))
    check_identity(out, {"config": "c", "checkpoint_sha256": "ab"})  # the same model: no error
    with pytest.raises(ValueError, match=r"another model .*\"ab\""):
        check_identity(out, {"checkpoint_sha256": "cd", "config": "c"})
    # A record written before the contract (the identity itself) still names its model.
    identity_path(out).write_text(json.dumps({"m": 1}))
    check_identity(out, {"m": 1})
    with pytest.raises(ValueError, match="another model"):
        check_identity(out, {"m": 2})


def test_missing_datasets_are_reported_and_strict_fails(world, tmp_path, clip_model):
    out = tmp_path / "r.jsonl"
    summary = run_eval(clip_model, select_tasks("synth/color,imagenet1k,vtab/cifar100"), world, out, FAST)
    assert [t["status"] for t in summary["tasks"]] == ["done", "missing", "missing"]
    assert [m["key"] for m in summary["missing"]] == ["imagenet1k", "vtab/cifar100"]
    assert "wds_imagenet1k_test" in summary["missing"][0]["reason"]
    assert [line["key"] for line in _lines(out)] == ["synth/color"]
    agg = {a["name"]: a for a in summary["aggregates"]["datacomp"]}
    assert agg["Average"]["count"] == 0 and agg["Average"]["total"] == 38 and agg["Average"]["value"] is None
    with pytest.raises(ValueError, match=r"--strict: 2 dataset\(s\) missing"):
        strict = RunOptions(device="cpu", workers=0, progress=False, strict=True)
        run_eval(
            clip_model, select_tasks("imagenet1k,synth/shape,vtab/cifar100"), world, tmp_path / "s", strict
        )
    assert not (tmp_path / "s").exists()  # strict fails before evaluating anything


# --- fake DataComp-layout tasks ----------------------------------------------------------------------


def _image_bytes(rng: np.random.Generator, fmt: str = "PNG") -> bytes:
    pixels = rng.integers(0, 256, size=(24, 24, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def _npy(values) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(values))
    return buf.getvalue()


def _write_task(folder: Path, shards: list[list[tuple[str, bytes]]], classnames=None, templates=None) -> None:
    (folder / "test").mkdir(parents=True)
    if classnames is not None:
        (folder / "classnames.txt").write_text("\n".join(classnames) + "\n")
    if templates is not None:
        (folder / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")
    for i, members in enumerate(shards):
        write_tar(folder / "test" / f"{i}.tar", members)
    (folder / "test" / "nshards.txt").write_text(f"{len(shards)}\n")


def test_datacomp_imagenet_layout_with_corrupt_members(tmp_path, clip_model):
    rng = np.random.default_rng(0)
    classes = ["tench", "goldfish", "great white shark", "tiger shark", "hammerhead", "electric ray"]
    shards = []
    for s in range(2):
        members = []
        for i in range(9):
            key = f"{s:02d}{i:04d}"
            ext = ("webp", "png", "jpg")[i % 3]
            fmt = {"webp": "WEBP", "png": "PNG", "jpg": "JPEG"}[ext]
            members += [(f"{key}.{ext}", _image_bytes(rng, fmt)), (f"{key}.cls", str(i % 6).encode())]
        shards.append(members)
    shards[0] += [("bad0001.jpg", b"\xff\xd8\xff\xe0 not really a jpeg"), ("bad0001.cls", b"1")]  # corrupt
    shards[1] += [("nolabel01.png", _image_bytes(rng))]  # no .cls
    shards[1] += [("badcls01.png", _image_bytes(rng)), ("badcls01.cls", b"seven")]  # not an integer
    _write_task(tmp_path / "wds_imagenet1k_test", shards, classes, ["a photo of a {c}.", "itap of a {c}."])
    out = tmp_path / "eval_results.jsonl"
    summary = run_eval(clip_model, select_tasks("imagenet1k"), tmp_path, out, FAST)
    (line,) = _lines(out)
    assert line["key"] == "imagenet1k" and line["dataset"] == "ImageNet 1k"
    m = line["metrics"]
    assert (m["num_samples"], m["num_skipped"], m["num_read_errors"]) == (18, 3, 0)
    assert set(m) == {"acc1", "acc5", "mean_per_class_recall", "main_metric", "num_samples", "num_skipped",
                      "num_read_errors"}  # fmt: skip
    assert m["main_metric"] == m["acc1"] and m["acc5"] is not None
    examples = summary["tasks"][0]["skip_examples"]
    assert any("corrupt .jpg" in e for e in examples) and any("no .cls" in e for e in examples)
    agg = {a["name"]: a for a in summary["aggregates"]["datacomp"]}
    assert agg["ImageNet"]["value"] == pytest.approx(m["acc1"]) and agg["Average"]["count"] == 1


def test_truncated_tar_is_counted_not_fatal(tmp_path, clip_model):
    rng = np.random.default_rng(1)
    members = [(f"k{i:03d}.png", _image_bytes(rng)) for i in range(6)]
    shard = [m for i, (name, data) in enumerate(members) for m in ((name, data), (f"k{i:03d}.cls", b"0"))]
    folder = tmp_path / "wds_cifar10_test"
    _write_task(folder, [shard, shard], [f"class {i}" for i in range(10)], ["a photo of a {c}."])
    data = (folder / "test" / "1.tar").read_bytes()
    (folder / "test" / "1.tar").write_bytes(data[: len(data) // 2 + 100])  # cut mid-member
    out = tmp_path / "r.jsonl"
    run_eval(clip_model, select_tasks("cifar10"), tmp_path, out, FAST)
    m = _lines(out)[0]["metrics"]
    assert m["num_read_errors"] >= 1
    assert 6 <= m["num_samples"] < 12


def test_fmow_style_metadata_is_read_with_the_image(tmp_path, clip_model):
    rng = np.random.default_rng(2)
    n_classes, members = 5, []
    regions = [0, 0, 1, 1, 1, 2, 2, 4, 5, 5, 0, 1]
    for i, region in enumerate(regions):
        y = i % n_classes
        members += [
            (f"f{i:04d}.webp", _image_bytes(rng, "WEBP")),
            (f"f{i:04d}.cls", str(y).encode()),
            (f"f{i:04d}.npy", _npy([region, 14 + i % 2, y])),  # WILDS FMoW metadata row: region, year, y
        ]
    members += [("g0000.webp", _image_bytes(rng, "WEBP")), ("g0000.cls", b"1"), ("g0000.npy", _npy([1]))]
    _write_task(tmp_path / "wds_wilds-fmow_test", [members], [f"site {i}" for i in range(n_classes)],
                ["satellite photo of a {c}."])  # fmt: skip
    out = tmp_path / "r.jsonl"
    run_eval(clip_model, select_tasks("wilds/fmow"), tmp_path, out, FAST)
    m = _lines(out)[0]["metrics"]
    assert m["num_samples"] == len(regions) and m["num_skipped"] == 1  # the row without a year
    assert m["main_metric"] == m["acc_worst_region"]
    assert m["count_region:3"] == 0.0 and m["count_region:5"] == 2.0
    non_empty = [m[f"acc_region:{r}"] for r in range(6) if m[f"count_region:{r}"] > 0]
    assert m["acc_worst_region"] == pytest.approx(min(non_empty))
    assert {
        "acc_avg",
        "acc_worst_year",
        "acc_year:14",
        "acc_year:15",
        "acc1",
        "mean_per_class_recall",
    } <= set(m)
    assert m["acc_avg"] == pytest.approx(m["acc1"])


def test_iwildcam_macro_f1_needs_no_metadata(tmp_path, clip_model):
    rng = np.random.default_rng(5)
    members = [
        m
        for i in range(12)
        for m in ((f"w{i:03d}.jpg", _image_bytes(rng, "JPEG")), (f"w{i:03d}.cls", b"%d" % (i % 6)))
    ]
    _write_task(
        tmp_path / "wds_wilds-iwildcam_test", [members], [f"animal {i}" for i in range(6)], ["a {c}."]
    )
    out = tmp_path / "r.jsonl"
    run_eval(clip_model, select_tasks("wilds/iwildcam"), tmp_path, out, FAST)
    m = _lines(out)[0]["metrics"]
    assert m["main_metric"] == m["F1-macro_all"] and 0 <= m["F1-macro_all"] <= 1
    assert m["acc_avg"] == pytest.approx(m["acc1"]) and m["num_samples"] == 12


def test_fairface_style_multi_objective_task(tmp_path, clip_model):
    rng = np.random.default_rng(3)
    objectives = {"race": 7, "gender": 2, "age": 9, "toxic": 20}
    classnames = [f"{o}:{o} class {i}" for o, n in objectives.items() for i in range(n)]
    templates = [f"{o}:a photo of a {{c}}." for o in objectives]
    members = []
    for i in range(10):
        members += [
            (f"p{i:03d}.jpg", _image_bytes(rng, "JPEG")),
            (f"p{i:03d}.npy", _npy([i % 9, i % 2, i % 7, int(i % 7 != 1)])),
        ]
    _write_task(tmp_path / "wds_fairface_test", [members], classnames, templates)
    out = tmp_path / "r.jsonl"
    run_eval(clip_model, select_tasks("fairness/fairface"), tmp_path, out, FAST)
    (line,) = _lines(out)
    m = line["metrics"]
    assert line["dataset"] == "FairFace" and m["main_metric"] is None
    for name in ("acc_race", "acc_gender", "acc_age", "acc_gender_x", "toxicity_crime", "toxicity_nonhuman"):
        assert f"{name}_avg" in m and f"{name}_wg" in m
    assert m["num_samples"] == 10


def test_retrieval_reads_the_clip_benchmark_folder_alias(world, tmp_path, clip_model):
    shutil.copytree(world / "eval" / "wds_synth-retrieval_test", tmp_path / "wds_flickr30k_test")
    out = tmp_path / "r.jsonl"
    run_eval(clip_model, select_tasks("retrieval/flickr_1k_test_image_text_retrieval"), tmp_path, out, FAST)
    (line,) = _lines(out)
    assert line["dataset"] == "Flickr"
    m = line["metrics"]
    assert m["main_metric"] == pytest.approx(
        0.5 * (m["image_retrieval_recall@1"] + m["text_retrieval_recall@1"])
    )
    for k in (1, 5, 10):
        assert 0 <= m[f"image_retrieval_recall@{k}"] <= 1
    assert m["image_retrieval_recall@10"] >= m["image_retrieval_recall@5"] >= m["image_retrieval_recall@1"]
    assert m["num_samples"] == 40


def _winogavil_folder(folder: Path) -> Path:
    """Items with found, listed and missing images, and a broken line."""
    rng = np.random.default_rng(4)
    (folder / "images").mkdir(parents=True)
    names = [f"img{i}" for i in range(14)]
    for n in names:
        (folder / "images" / f"{n}.png").write_bytes(_image_bytes(rng))
    items = [
        {"cue": "apple", "candidates": names[:5], "associations": names[:2]},
        {"cue": "Ocean", "candidates": names[:10], "associations": names[3:6]},
        {"cue": "tree", "candidates": names[2:14], "associations": names[4:8],
         "candidate_images": [f"images/{n}.png" for n in names[2:14]]},
        {"cue": "ghost", "candidates": ["missing", *names[:4]], "associations": ["missing"]},
    ]  # fmt: skip
    lines = [json.dumps(item) for item in items] + ['{"cue": "broken"']
    (folder / "items.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_winogavil_layout(tmp_path, clip_model):
    _winogavil_folder(tmp_path / "winogavil_test")
    out = tmp_path / "r.jsonl"
    run_eval(clip_model, select_tasks("misc/winogavil"), tmp_path, out, FAST)
    m = _lines(out)[0]["metrics"]
    assert m["num_samples"] == 3 and m["num_skipped"] == 2  # missing image, broken JSON line
    assert m["jaccard_score_6"] is None and m["jaccard_score_5"] is not None
    assert (
        m["main_metric"]
        == m["jaccard_score_10-12"]
        == pytest.approx((m["jaccard_score_10"] + m["jaccard_score_12"]) / 2)
    )


def test_decode_image_tolerates_a_wrong_extension():
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "PNG")
    assert decode_image(buf.getvalue(), "jpg").format == "PNG"


def test_loader_images_are_bit_identical_to_open_clip_in_every_image_mode(tmp_path):
    """The eval loader batches `hype.data.imageprep.Preprocess`; each image equals the model's open_clip
    eval transform on the decoded file, whatever its mode (the RGB conversion follows the crop)."""
    from hype.data.imageprep import Preprocess
    from hype.eval import readers as R

    rng = np.random.default_rng(3)
    images = []
    for mode, size in (
        ("RGB", (97, 41)),
        ("L", (30, 70)),
        ("P", (64, 64)),
        ("RGBA", (50, 33)),
        ("LA", (9, 300)),
    ):
        rgb = Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))
        images.append(rgb.quantize(16) if mode == "P" else rgb.convert(mode))
    members = []
    for i, img in enumerate(images):
        buf = io.BytesIO()
        img.save(buf, "PNG")
        members += [(f"k{i:03d}.png", buf.getvalue()), (f"k{i:03d}.cls", b"0")]
    _write_task(tmp_path / "task", [members])
    for name in ("tiny-clip", "tiny-hyperbolic"):
        model = _model(name)
        spec = R.WdsSpec(label=True)
        (batch,) = R.wds_loader(
            tmp_path / "task", transform=Preprocess.of(model), spec=spec, batch_size=8, workers=0
        )
        decoded = [decode_image(data, "png") for key, data in members if key.endswith(".png")]
        assert [d.mode for d in decoded] == ["RGB", "L", "P", "RGBA", "LA"]
        expected = torch.stack([model.preprocess(train=False)(d) for d in decoded])
        assert batch["images"].dtype == torch.float32 and torch.equal(batch["images"], expected), name


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_checkpoint_json_summary_and_errors(world, tmp_path):
    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "m.safetensors", create_model("tiny-euclidean-squared"))
    out = tmp_path / "eval_results.jsonl"
    args = ["eval", "--model", str(ckpt), "--data-dir", str(world), "--out", str(out), "--workers", "0",
            "--tasks", "synth/position,imagenet1k", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert [t["status"] for t in summary["tasks"]] == ["done", "missing"]
    assert summary["model"]["config"] == "tiny-euclidean-squared"
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Synth Position" in result.output and "cached" in result.output and "MISSING" in result.output
    assert "Average" in result.output and "(0/38" in result.output
    result = CliRunner().invoke(main, [*args, "--strict"])
    assert result.exit_code != 0 and "wds_imagenet1k_test" in result.output

    other = ["eval", "--model-config", "tiny-clip", "--data-dir", str(world), "--out", str(out),
             "--tasks", "synth/shape", "--no-progress", "--workers", "0"]  # fmt: skip
    result = CliRunner().invoke(main, other)
    assert result.exit_code != 0 and "another model" in result.output
    result = CliRunner().invoke(main, ["eval", "--data-dir", str(world)])
    assert result.exit_code != 0 and "exactly one of --model" in result.output
    result = CliRunner().invoke(main, ["eval", "--model-config", "tiny-clip", "--data-dir", str(world),
                                       "--tasks", "imagenet1"])  # fmt: skip
    assert result.exit_code != 0 and "did you mean imagenet1k" in result.output


def test_custom_suite_file_gets_its_own_aggregate(world, tmp_path, clip_model):
    suite = tmp_path / "mine.yaml"
    suite.write_text(
        "suite: mine\naverage: My average\naggregates: {shapes: Shapes}\ntasks:\n"
        "  - {key: synth/shape, name: Shapes!, type: zeroshot_classification, main_metric: acc5,\n"
        "     group: shapes}\n"
        "  - {key: synth/count, name: Counts, type: zeroshot_classification,\n"
        "     main_metric: mean_per_class_recall, group: other}\n"
    )
    out = tmp_path / "r.jsonl"
    summary = run_eval(clip_model, select_tasks(str(suite)), world, out, FAST)
    lines = _lines(out)
    assert [line["dataset"] for line in lines] == ["Shapes!", "Counts"]
    assert lines[0]["metrics"]["main_metric"] == lines[0]["metrics"]["acc5"]
    rows = {r["name"]: r for r in summary["aggregates"]["mine"]}
    assert rows["Shapes"]["value"] == pytest.approx(lines[0]["metrics"]["acc5"])
    assert rows["My average"]["value"] == pytest.approx(
        (lines[0]["metrics"]["acc5"] + lines[1]["metrics"]["mean_per_class_recall"]) / 2
    )


# --- object storage ---------------------------------------------------------------------------------


def _upload_tree(folder: Path, url: str) -> None:
    from hype.io import storage

    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        storage.upload(path, storage.location(f"{url}/{path.relative_to(folder).as_posix()}"))


def test_data_and_results_on_object_storage_give_the_local_results(world, tmp_path, clip_model, s3):
    """Task folders (a synthetic world's root, WinoGAViL's images) and the results file on S3: the same
    bytes as a local run, decoded in a DataLoader worker; a rerun skips the finished tasks and a crash
    mid-line is repaired in place."""
    from hype.io import read_bytes, write_bytes

    root = f"s3://{s3.bucket()}"
    _upload_tree(world / "eval", f"{root}/world/eval")
    local_dir = tmp_path / "local"
    shutil.copytree(world / "eval", local_dir)
    _upload_tree(_winogavil_folder(local_dir / "winogavil_test"), f"{root}/world/eval/winogavil_test")
    tasks = select_tasks("synth/shape,synth/retrieval,misc/winogavil")
    opts = RunOptions(batch_size=16, device="cpu", workers=1, progress=False)
    run_eval(clip_model, tasks, local_dir, tmp_path / "r.jsonl", opts, identity={"m": 1})
    out = f"{root}/results/r.jsonl"
    summary = run_eval(clip_model, tasks, f"{root}/world", out, opts, identity={"m": 1})
    expected = (tmp_path / "r.jsonl").read_bytes()
    assert [t["status"] for t in summary["tasks"]] == ["done"] * 3 and summary[
        "data_dir"
    ] == f"{root}/world/eval"
    assert read_bytes(out) == expected and len(expected.splitlines()) == 3
    assert json.loads(read_bytes(out + ".model.json"))["model"] == {"m": 1}
    first = expected.index(b"\n") + 1
    write_bytes(out, expected[: first + 20])  # killed while the second task was written
    summary = run_eval(clip_model, tasks, f"{root}/world", out, FAST, identity={"m": 1})
    assert [t["status"] for t in summary["tasks"]] == ["cached", "done", "done"]
    assert read_bytes(out) == expected
    with pytest.raises(ValueError, match="another model"):
        run_eval(clip_model, tasks, f"{root}/world", out, FAST, identity={"m": 2})


def test_a_missing_bucket_is_named(world, s3):
    from hype.io import StorageError

    with pytest.raises(StorageError, match="s3://no-such-bucket-hype/r.jsonl: the bucket does not exist"):
        run_eval(
            create_model("tiny-clip"), select_tasks("synth/shape"), world, "s3://no-such-bucket-hype/r.jsonl"
        )

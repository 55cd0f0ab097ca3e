"""`hype submit`: the DataComp submission folder and every check DataComp's format implies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from test_select_helpers import save_memmap_subset, write_scores

import hype.filters  # noqa: F401  (registers the bundled rules for select_subset without the CLI)
from hype.cli import main
from hype.data.uids import save_subset
from hype.eval.tasks import load_suite
from hype.select import SelectError
from hype.select.run import SelectRequest, select_subset
from hype.submit import make_submission, scale_config
from hype.table.schema import METRICS

# DataComp's task list as its own code has it (mlfoundations/datacomp tasklist.yml: key, "name", main_metric,
# default acc1; aggregate_scores.py: the groups), written out here so that the tests check hype's copy
# (configs/eval/datacomp.yaml) rather than trust it. Group "" = in no aggregate but the average.
TASKLIST = [
    ("vtab/caltech101", "Caltech-101", "mean_per_class_recall", "VTAB"),
    ("cifar10", "CIFAR-10", "acc1", ""),
    ("vtab/cifar100", "CIFAR-100", "acc1", "VTAB"),
    ("vtab/clevr_count_all", "CLEVR Counts", "acc1", "VTAB"),
    ("vtab/clevr_closest_object_distance", "CLEVR Distance", "acc1", "VTAB"),
    ("country211", "Country211", "acc1", ""),
    ("vtab/dtd", "Describable Textures", "acc1", "VTAB"),
    ("vtab/eurosat", "EuroSAT", "acc1", "VTAB"),
    ("fgvc_aircraft", "FGVC Aircraft", "mean_per_class_recall", ""),
    ("food101", "Food-101", "acc1", ""),
    ("gtsrb", "GTSRB", "acc1", ""),
    ("imagenet1k", "ImageNet 1k", "acc1", "ImageNet"),
    ("imagenet_sketch", "ImageNet Sketch", "acc1", "ImageNet dist. shifts"),
    ("imagenetv2", "ImageNet v2", "acc1", "ImageNet dist. shifts"),
    ("imagenet-a", "ImageNet-A", "acc1", "ImageNet dist. shifts"),
    ("imagenet-o", "ImageNet-O", "acc1", "ImageNet dist. shifts"),
    ("imagenet-r", "ImageNet-R", "acc1", "ImageNet dist. shifts"),
    ("vtab/kitti_closest_vehicle_distance", "KITTI Vehicle Distance", "acc1", "VTAB"),
    ("mnist", "MNIST", "acc1", ""),
    ("objectnet", "ObjectNet", "acc1", "ImageNet dist. shifts"),
    ("vtab/flowers", "Oxford Flowers-102", "mean_per_class_recall", "VTAB"),
    ("vtab/pets", "Oxford-IIIT Pet", "mean_per_class_recall", "VTAB"),
    ("voc2007", "Pascal VOC 2007", "acc1", ""),
    ("vtab/pcam", "PatchCamelyon", "acc1", "VTAB"),
    ("renderedsst2", "Rendered SST2", "acc1", ""),
    ("vtab/resisc45", "RESISC45", "acc1", "VTAB"),
    ("cars", "Stanford Cars", "acc1", ""),
    ("stl10", "STL-10", "acc1", ""),
    ("sun397", "SUN397", "acc1", "VTAB"),
    ("vtab/svhn", "SVHN", "acc1", "VTAB"),
    ("retrieval/flickr_1k_test_image_text_retrieval", "Flickr", "mean_recall@1", "Retrieval"),
    ("retrieval/mscoco_2014_5k_test_image_text_retrieval", "MSCOCO", "mean_recall@1", "Retrieval"),
    ("misc/winogavil", "WinoGAViL", "jaccard_score_10-12", "Retrieval"),
    ("wilds/iwildcam", "iWildCam", "F1-macro_all", ""),
    ("wilds/camelyon17", "Camelyon17", "acc1", ""),
    ("wilds/fmow", "FMoW", "acc_worst_region", ""),
    ("fairness/dollar_street", "Dollar Street", "acc_top5_wg", ""),
    ("fairness/geode", "GeoDE", "acc_wg", ""),
    ("fairness/fairface", "FairFace", None, ""),  # run, no main metric: evaluate.py writes null
    ("fairness/utkface", "UTKFace", None, ""),
]
# datacomp/scale_configs.py: the open_clip architecture name DataComp trains and reports per scale.
DATACOMP_MODELS = {
    "debug": "ViT-B-32",
    "small": "ViT-B-32",
    "medium": "ViT-B-32",
    "large": "ViT-B-16",
    "xlarge": "ViT-L-14",
}


def datacomp_results() -> list[dict]:
    """One line per task as DataComp's evaluate.py writes it: the metrics, then main_metric copied from
    the task's main metric (null for FairFace and UTKFace)."""
    lines = []
    for i, (key, name, metric, _) in enumerate(TASKLIST):
        classification = metric not in ("mean_recall@1", "jaccard_score_10-12")
        metrics = {"acc1": round(0.2 + 0.01 * i, 4), "acc5": 0.9} if classification else {}
        if metric not in (None, "acc1"):
            metrics[metric] = round(0.1 + 0.015 * i, 4)
        metrics["main_metric"] = metrics[metric] if metric else None
        lines.append({"key": key, "dataset": name, "metrics": metrics})
    return lines


def write_results(path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


RESULTS = datacomp_results()
SCORED = [r["metrics"]["main_metric"] for r in RESULTS if r["metrics"]["main_metric"] is not None]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("submit")
    rng = np.random.default_rng(0)
    n = 400
    df = pd.DataFrame(
        {
            "uid": [f"{int(x):032x}" for x in rng.integers(1, 2**62, n)],
            **{m: rng.normal(0, 1, n).astype(np.float32) for m in METRICS},
            "shard": "s.tar",
            "key": "k",
            "text": "t",
            "width": np.int32(9),
            "height": np.int32(9),
        }
    )
    run = write_scores(df, root / "run", parts=2)
    select_subset(
        SelectRequest(scores=run, out=root / "hype20.npy", frac=0.2, preset="no-c-in", progress=False)
    )
    results = write_results(root / "eval_results.jsonl", RESULTS)
    return {"root": root, "run": run, "subset": root / "hype20.npy", "results": results, "df": df}


def test_submission_folder(prepared, tmp_path):
    p = prepared
    res = CliRunner().invoke(
        main,
        [
            "submit",
            "--scale",
            "small",
            "--subset",
            str(p["subset"]),
            "--eval-results",
            str(p["results"]),
            "--out",
            str(tmp_path / "sub"),
            "--scores",
            str(p["run"]),
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    folder = tmp_path / "sub" / "small_scale"
    assert (folder / "samples" / "hype20.npy").read_bytes() == p["subset"].read_bytes()
    assert (folder / "results.jsonl").read_bytes() == p["results"].read_bytes()
    meta = json.loads((folder / "submission.json").read_text())
    assert meta["scale"] == "small" and meta["track"] == "filtering" and meta["model"] == "ViT-B-32"
    assert meta["train_num_samples"] == 12_800_000 and meta["batch_size"] == 4096
    assert meta["method_name"] == "hype (no-c-in)" and meta["dataset_size"] == 80
    assert meta["subset"]["rows"] == 80 and meta["subset"]["file"] == "samples/hype20.npy"
    assert meta["pool_check"]["all_uids_in_pool"] is True
    assert meta["results"]["scored_tasks"] == 38 and meta["results"]["tasks"] == 40
    assert meta["results"]["average"] == pytest.approx(sum(SCORED) / 38)
    groups = meta["results"]["aggregates"]
    for group in ("ImageNet", "ImageNet dist. shifts", "VTAB", "Retrieval"):
        values = [
            r["metrics"]["main_metric"] for r, t in zip(RESULTS, TASKLIST, strict=True) if t[3] == group
        ]
        assert groups[group] == pytest.approx(sum(values) / len(values))
    assert groups["Average"] == pytest.approx(meta["results"]["average"])
    assert meta["selection"]["preset"] == "no-c-in" and meta["selection"]["target"]["k"] == 80
    assert "all in the pool's scores" in res.output
    # The same submission again: submission.json's fingerprint matches, nothing is checked or written.
    files = {f: f.stat().st_mtime_ns for f in folder.rglob("*")}
    sub = tmp_path / "sub"
    again = make_submission("small", p["subset"], p["results"], sub, scores=p["run"], progress=False)
    assert again["skipped"] is True and again["created"] == meta["created"]
    assert {f: f.stat().st_mtime_ns for f in folder.rglob("*")} == files
    # A second submission with another setting into the same folder needs --overwrite.
    with pytest.raises(SelectError, match="--overwrite"):
        make_submission("small", p["subset"], p["results"], tmp_path / "sub", progress=False)
    meta = make_submission(
        "small",
        p["subset"],
        p["results"],
        tmp_path / "sub",
        method_name="mine",
        overwrite=True,
        progress=False,
    )
    assert meta["method_name"] == "mine" and meta["pool_check"] is None


def test_a_raw_memmap_subset_is_submitted_as_is(prepared, tmp_path):
    """DataComp's README allows raw memmap subset files; its evaluate.py uploads the file under its name."""
    p = prepared
    uids = pd.read_parquet(p["root"] / "hype20.parquet")["uid"].tolist()
    raw = save_memmap_subset(tmp_path / "hype20.u8u8", uids)
    meta = make_submission("small", raw, p["results"], tmp_path / "sub", scores=p["run"], progress=False)
    folder = tmp_path / "sub" / "small_scale"
    assert (folder / "samples" / "hype20.u8u8").read_bytes() == raw.read_bytes()
    assert meta["subset"]["file"] == "samples/hype20.u8u8" and meta["subset"]["rows"] == 80
    assert meta["pool_check"]["all_uids_in_pool"] is True and meta["dataset_size"] == 80


def bad_subset(tmp_path, kind: str):
    path = tmp_path / f"{kind}.npy"
    if kind == "int64":
        np.save(path, np.arange(5, dtype=np.int64))
    elif kind == "pickle":
        np.save(path, np.array([{"uid": 1}], dtype=object), allow_pickle=True)
    elif kind == "text":
        path.write_text("f" * 32 + "\n")
    elif kind == "odd_size":
        path.write_bytes(bytes(20))
    elif kind == "unsorted":
        arr = np.zeros(3, dtype="u8,u8")
        arr["f1"] = [3, 1, 2]
        np.save(path, arr)
    elif kind == "empty":
        np.save(path, np.zeros(0, dtype="u8,u8"))
    elif kind == "too_big":  # more unique uids than the debug pool (128,000)
        arr = np.zeros(128_001, dtype="u8,u8")
        arr["f1"] = np.arange(128_001)
        np.save(path, arr)
    elif kind == "stranger":
        save_subset(path, ["f" * 32])
    return path


@pytest.mark.parametrize(
    ("kind", "scale", "message"),
    [
        ("int64", "small", "found a NumPy file holding a 1-D int64 array"),
        ("pickle", "small", "found a NumPy file holding a 1-D object array"),
        ("text", "small", "found a text file"),
        ("odd_size", "small", "found a 20-byte file that is not an .npy file"),
        ("unsorted", "small", "not sorted"),
        ("empty", "small", "non-empty"),
        ("too_big", "debug", "128,001 unique uids, more than the 128,000"),
        ("stranger", "small", "1 of the subset's 1 unique uids are not in the scores"),
    ],
)
def test_bad_subsets_are_refused(prepared, tmp_path, kind, scale, message):
    path = bad_subset(tmp_path, kind)
    with pytest.raises(SelectError, match=message):
        make_submission(
            scale, path, prepared["results"], tmp_path / "out", scores=prepared["run"], progress=False
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["{not json"], "line 1 is not valid JSON"),
        (["[1, 2]"], "line 1 is not a JSON object"),
        ([json.dumps({"key": "a", "metrics": {"main_metric": 1}})], "missing or bad 'dataset'"),
        ([json.dumps({"key": "a", "dataset": "A", "metrics": {}})], "no 'main_metric'"),
        (
            [json.dumps({"key": "a", "dataset": "A", "metrics": {"main_metric": "0.5"}})],
            "not a finite number",
        ),
        ([json.dumps(RESULTS[0]), json.dumps(RESULTS[0])], "already appears on line 1"),
        ([], "no results"),
    ],
)
def test_bad_results_are_refused(prepared, tmp_path, lines, message):
    path = tmp_path / "eval_results.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    with pytest.raises(SelectError, match=message):
        make_submission("small", prepared["subset"], path, tmp_path / "out", progress=False)


def test_unknown_scale_and_missing_files(prepared, tmp_path):
    with pytest.raises(SelectError, match="DataComp scales are"):
        make_submission("huge", prepared["subset"], prepared["results"], tmp_path / "o", progress=False)
    with pytest.raises(SelectError, match="subset file not found"):
        make_submission("small", tmp_path / "nope.npy", prepared["results"], tmp_path / "o", progress=False)
    with pytest.raises(SelectError, match="no such file; run hype eval"):
        make_submission("small", prepared["subset"], tmp_path / "nope.jsonl", tmp_path / "o", progress=False)


def test_shipped_task_list_is_datacomps():
    """hype's configs/eval/datacomp.yaml, which submit checks results against, is DataComp's tasklist.yml."""
    suite = load_suite("datacomp")
    assert [(t.key, t.name, t.main_metric) for t in suite.tasks] == [t[:3] for t in TASKLIST]
    assert len(suite.scored) == 38


@pytest.mark.parametrize("scale", sorted(DATACOMP_MODELS))
def test_model_is_named_as_datacomp_names_it(scale):
    """DataComp's submission records scale_configs.py's architecture name (ViT-B-32, ...), not hype's
    config name."""
    assert scale_config(scale)["model"] == DATACOMP_MODELS[scale]


def replace(index: int, **changes) -> list:
    lines = datacomp_results()
    for field, value in changes.items():
        if field in ("dataset", "key"):
            lines[index][field] = value
        else:
            lines[index]["metrics"][field] = value
    return lines


def without(*keys: str) -> list:
    return [r for r in datacomp_results() if r["key"] not in keys]


IMAGENET = [t[0] for t in TASKLIST].index("imagenet1k")
CALTECH = [t[0] for t in TASKLIST].index("vtab/caltech101")
FLICKR = [t[0] for t in TASKLIST].index("retrieval/flickr_1k_test_image_text_retrieval")
FAIRFACE = [t[0] for t in TASKLIST].index("fairness/fairface")
SYNTHETIC = [
    {"key": f"synth/{k}", "dataset": f"Synth {k.title()}", "metrics": {"acc1": 0.5, "main_metric": 0.5}}
    for k in ("objects", "shape", "color", "count", "background", "position")
]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        # What DataComp's own code rejects or misreads (issue 13).
        (without("imagenet1k"), r"no 'ImageNet 1k' line \(key imagenet1k\).*missing 1 of DataComp's 38"),
        (replace(IMAGENET, dataset="ImageNet"), r"line 12: .*'ImageNet'; DataComp names it 'ImageNet 1k'"),
        (replace(FLICKR, dataset="Flickr30k"), r"line 31: .*'Flickr30k'; DataComp names it 'Flickr'"),
        (SYNTHETIC, "these are synthetic-world results; DataComp needs the 38-task benchmark"),
        (datacomp_results() + SYNTHETIC[:1], "line 41: 'synth/objects' is a synthetic-world task"),
        (
            datacomp_results() + [{"key": "x", "dataset": "X", "metrics": {"main_metric": 1}}],
            "line 41: 'x' is not a task of DataComp's 40-task benchmark",
        ),
        ([{"key": "x", "dataset": "X", "metrics": {"main_metric": 1}}], "no line .* is a DataComp task"),
        # The main metric as DataComp reads it.
        (without("vtab/svhn", "mnist"), r"missing 2 of DataComp's 38 scored tasks: MNIST \(mnist\), SVHN"),
        (replace(CALTECH, main_metric=None), "Caltech-101 has no score"),
        (replace(CALTECH, main_metric=0.99), r"0.99 is not metrics\['mean_per_class_recall'\]"),
        (replace(IMAGENET, acc1=None, main_metric=None), "ImageNet 1k has no score"),
        (replace(FAIRFACE, main_metric=0.4), "FairFace has no main metric in DataComp"),
        (replace(CALTECH, acc5=float("nan")), r"metrics\['acc5'\] is NaN"),
        (datacomp_results() + [""], "line 41 is empty"),
    ],
)
def test_results_datacomp_would_reject_are_refused(prepared, tmp_path, lines, message):
    path = write_results(tmp_path / "eval_results.jsonl", lines)
    with pytest.raises(SelectError, match=message) as e:
        make_submission("small", prepared["subset"], path, tmp_path / "out", progress=False)
    assert str(path) in str(e.value)
    assert not (tmp_path / "out").exists()


def test_results_without_the_unscored_tasks_are_accepted(prepared, tmp_path):
    """FairFace and UTKFace are run but never scored: their lines may be absent."""
    path = write_results(tmp_path / "r.jsonl", without("fairness/fairface", "fairness/utkface"))
    meta = make_submission("small", prepared["subset"], path, tmp_path / "out", progress=False)
    assert meta["results"]["tasks"] == 38 and meta["results"]["average"] == pytest.approx(sum(SCORED) / 38)


def test_results_that_are_not_utf8_are_refused(prepared, tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(SelectError, match="not UTF-8 text"):
        make_submission("small", prepared["subset"], path, tmp_path / "out", progress=False)


def test_a_submission_from_and_to_object_storage_is_the_local_one(prepared, tmp_path, s3):
    """Subset, results and --out on S3: the folder holds the bytes a local run writes."""
    from hype.io import read_bytes, storage

    p = prepared
    root = f"s3://{s3.bucket()}"
    storage.upload(p["subset"], storage.location(f"{root}/in/hype20.npy"))
    storage.upload(p["root"] / "hype20.json", storage.location(f"{root}/in/hype20.json"))
    storage.upload(p["results"], storage.location(f"{root}/in/eval_results.jsonl"))
    args = ["submit", "--scale", "small", "--scores", str(p["run"]), "--no-progress"]
    local = CliRunner().invoke(
        main,
        [*args, "--subset", str(p["subset"]), "--eval-results", str(p["results"]), "--out", str(tmp_path)],
    )
    remote = CliRunner().invoke(
        main,
        [
            *args,
            "--subset",
            f"{root}/in/hype20.npy",
            "--eval-results",
            f"{root}/in/eval_results.jsonl",
            "--out",
            f"{root}/sub",
        ],
    )
    assert local.exit_code == 0 and remote.exit_code == 0, local.output + remote.output
    assert f"written to {root}/sub/small_scale" in remote.output
    for name in ("samples/hype20.npy", "results.jsonl"):
        assert read_bytes(f"{root}/sub/small_scale/{name}") == (tmp_path / "small_scale" / name).read_bytes()
    meta = [
        json.loads(read_bytes(f"{folder}/small_scale/submission.json"))
        for folder in (str(tmp_path), root + "/sub")
    ]
    for m in meta:
        m.pop("created")
    assert meta[0] == meta[1] and meta[1]["selection"]["preset"] == "no-c-in"
    with pytest.raises(SelectError, match="--overwrite"):
        make_submission("small", p["subset"], p["results"], f"{root}/sub", progress=False)


def test_a_missing_bucket_is_named(prepared, s3):
    with pytest.raises(Exception, match="s3://no-such-bucket-hype/sub.*bucket does not exist"):
        make_submission("small", prepared["subset"], prepared["results"], "s3://no-such-bucket-hype/sub")

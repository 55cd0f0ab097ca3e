"""`hype submit`: the DataComp submission folder and every check DataComp's format implies."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from test_select_helpers import save_memmap_subset, write_scores

import filters  # noqa: F401  (registers the bundled rules for select_subset without the CLI)
from hype.cli import main
from hype.data.uids import save_subset
from hype.scoring.schema import METRICS
from hype.select import SelectError
from hype.select.run import SelectRequest, select_subset
from hype.submit import make_submission

RESULTS = [
    {"key": "imagenet1k", "dataset": "ImageNet 1k", "metrics": {"acc1": 0.3, "main_metric": 0.3}},
    {"key": "fairness/fairface", "dataset": "FairFace", "metrics": {"main_metric": None}},
    {
        "key": "retrieval/flickr_1k_test_image_text_retrieval",
        "dataset": "Flickr",
        "metrics": {"main_metric": 0.5},
    },
]


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
    results = root / "eval_results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in RESULTS))
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
    assert meta["scale"] == "small" and meta["track"] == "filtering" and meta["model"] == "clip-vit-b32"
    assert meta["train_num_samples"] == 12_800_000 and meta["batch_size"] == 4096
    assert meta["method_name"] == "hype (no-c-in)" and meta["dataset_size"] == 80
    assert meta["subset"]["rows"] == 80 and meta["subset"]["file"] == "samples/hype20.npy"
    assert meta["pool_check"]["all_uids_in_pool"] is True
    assert meta["results"]["average"] == pytest.approx(0.4) and meta["results"]["scored_tasks"] == 2
    assert meta["selection"]["preset"] == "no-c-in" and meta["selection"]["target"]["k"] == 80
    assert "all in the pool's scores" in res.output
    # A second submission into the same folder needs --overwrite.
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

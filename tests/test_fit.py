"""`hype fit` (hype.select.fit): weights fitted to a labelled sample, cross-validated, with one-line errors
for bad labels; the synthetic world's truth as a curator's labels."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_select_helpers import write_scores

from hype.cli import main
from hype.data.uids import array_to_uids
from hype.select.fit import fit_logistic
from hype.synth import make_world
from hype.synth.labels import curator_labels
from hype.table.schema import METRICS

N = 3000


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> dict:
    """A scored pool of N rows with independent metrics; the labels of 400 of them follow cos_theta alone."""
    root = tmp_path_factory.mktemp("fit")
    rng = np.random.default_rng(0)
    uids = [f"{i:032x}" for i in rng.choice(2**62, N, replace=False)]
    df = pd.DataFrame({"uid": uids})
    for m in METRICS:
        df[m] = rng.normal(0, 1 + METRICS.index(m), N).astype(np.float32)
    for col in ("shard", "key", "text"):
        df[col] = ""
    df["width"] = df["height"] = np.int32(64)
    run = write_scores(df, root / "run")
    pick = rng.choice(N, 400, replace=False)
    cos = df["cos_theta"].to_numpy(np.float64)[pick]
    keep = (rng.random(400) < 1 / (1 + np.exp(-3 * (cos - cos.mean()) / cos.std()))).astype(np.int8)
    labels = root / "labels.parquet"
    pq.write_table(pa.table({"uid": df["uid"].to_numpy()[pick], "keep": keep}), labels)
    return {"run": run, "labels": labels, "df": df, "pick": pick, "keep": keep, "root": root}


def fit(*args: str):
    return CliRunner().invoke(main, ["fit", *args])


def test_fit_recovers_the_one_column_the_labels_follow(pool, tmp_path):
    out = tmp_path / "w.json"
    res = fit("--scores", str(pool["run"]), "--labels", str(pool["labels"]), "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "5-fold held-out accuracy" in res.output and "AUROC" in res.output
    record = json.loads(out.read_text())
    w = record["weights"]
    assert 2 < w["cos_theta"] < 4.5  # the labels' own slope is 3 per pool std
    assert all(abs(w[c]) < 0.2 * w["cos_theta"] for c in METRICS if c != "cos_theta")
    cv = record["fit"]["cv"]
    assert cv["folds"] == 5 and len(cv["per_fold"]) == 5 and 0.7 < cv["accuracy"] <= 1 and cv["auroc"] > 0.8
    data = record["data"]
    assert data["labels_sha256"] == hashlib.sha256(pool["labels"].read_bytes()).hexdigest()
    assert (data["rows"], data["keep"]) == (400, int(pool["keep"].sum())) and data["columns"] == list(METRICS)
    assert data["scores"] == str(pool["run"] / "scores") and data["scores_rows"] == N
    # The pool statistics of the z-scores, against pandas (population std).
    for m in METRICS:
        x = pool["df"][m].to_numpy(np.float64)
        assert record["normalization"][m]["mean"] == pytest.approx(x.mean(), rel=1e-9, abs=1e-12)
        assert record["normalization"][m]["std"] == pytest.approx(x.std(), rel=1e-9)


def test_logistic_fit_matches_scikit_learn():
    sklearn = pytest.importorskip("sklearn.linear_model")
    rng = np.random.default_rng(2)
    z = rng.normal(size=(300, 4))
    y = (rng.random(300) < 1 / (1 + np.exp(-(z @ [2.0, -1.0, 0.0, 0.5] + 0.3)))).astype(float)
    w, b = fit_logistic(z, y, l2=0.7)
    ref = sklearn.LogisticRegression(C=1 / 0.7, tol=1e-12, max_iter=10_000).fit(z, y)
    np.testing.assert_allclose(w, ref.coef_[0], rtol=1e-5, atol=1e-7)
    assert b == pytest.approx(ref.intercept_[0], rel=1e-5, abs=1e-7)


def labels_file(path: Path, **columns) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


@pytest.mark.parametrize(
    "columns, message",
    [
        (
            {"id": ["a"], "keep": [1]},
            r"no column 'uid' \(it has id, keep\); a labels file holds uid and keep",
        ),
        ({"uid": ["0" * 32, "1" * 32], "keep": [1, 2]}, r"column 'keep' holds 2; labels must be 1/0"),
        ({"uid": ["0" * 32, "1" * 32], "keep": ["keep", "maybe"]}, r"column 'keep' holds 'maybe'"),
        (
            {"uid": ["f" * 32, "e" * 32], "keep": [1, 0]},
            r"2 of the 2 labelled uids are not in the scores table",
        ),
        ({"uid": ["nope", "e" * 32], "keep": [1, 0]}, r"--labels .*bad\.parquet"),
    ],
)
def test_bad_labels_are_one_line_errors(pool, tmp_path, columns, message):
    bad = labels_file(tmp_path / "bad.parquet", **columns)
    res = fit("--scores", str(pool["run"]), "--labels", str(bad), "--out", str(tmp_path / "w.json"))
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
    assert res.output.startswith("Error: ") and re.search(message, res.output), res.output
    assert not (tmp_path / "w.json").exists()


def test_too_few_of_a_class_for_the_folds(pool, tmp_path):
    uids = pool["df"]["uid"].to_numpy()[:40].tolist()
    few = labels_file(tmp_path / "few.parquet", uid=uids, keep=[1] * 37 + [0] * 3)
    res = fit("--scores", str(pool["run"]), "--labels", str(few), "--out", str(tmp_path / "w.json"))
    assert res.exit_code == 1 and "3 sample(s) of the rarer class; label at least 5 kept" in res.output


def test_curator_labels_come_from_the_pool_truth(tmp_path):
    world = make_world(tmp_path / "world", 64, 0, clean_size=8, eval_size=8, reference_per_class=1, workers=1)
    labels = pd.read_parquet(curator_labels(tmp_path / "world", tmp_path / "labels.parquet", rows=40, seed=1))
    truth = pd.read_parquet(tmp_path / "world" / "truth.parquet").set_index("uid")
    assert len(labels) == 40 and labels["uid"].is_unique and set(labels["uid"]) <= set(truth.index)
    assert (labels["keep"] == (truth.loc[labels["uid"], "noise"] == "clean").to_numpy()).all()
    del world


def test_labels_past_the_bounds_are_refused_before_decoding(pool, tmp_path, monkeypatch):
    import hype.select.fit as fit_module

    monkeypatch.setattr(fit_module, "MAX_LABEL_ROWS", 10)
    many = labels_file(tmp_path / "many.parquet", uid=[f"{i:032x}" for i in range(11)], keep=[1, 0] * 5 + [1])
    res = fit("--scores", str(pool["run"]), "--labels", str(many), "--out", str(tmp_path / "w.json"))
    assert res.exit_code == 1 and "many.parquet: 11 rows; label a sample of at most 10" in res.output


def _kept(path: Path) -> set:
    return set(np.load(path).tolist())


def test_select_combine_ranks_by_the_fitted_weights(pool, tmp_path):
    """`hype select --rank combine --weights weights.json` keeps the top rows of the fitted sum of pool
    z-scores, checked against a float64 computation of that sum; subset.json records what the fit saw."""
    weights = tmp_path / "w.json"
    assert (
        fit("--scores", str(pool["run"]), "--labels", str(pool["labels"]), "--out", str(weights)).exit_code
        == 0
    )
    record = json.loads(weights.read_text())
    out = tmp_path / "s.npy"
    args = ["select", "--scores", str(pool["run"]), "--out", str(out), "--top-k", "300", "--no-progress"]
    res = CliRunner().invoke(main, [*args, "--rank", "combine", "--weights", str(weights)])
    assert res.exit_code == 0, res.output
    df = pool["df"]
    ref = np.zeros(N)
    for m, w in record["weights"].items():
        x = df[m].to_numpy(np.float64)
        ref += w * (x - x.mean()) / x.std()
    top = np.argsort(-ref, kind="stable")[:300]
    inline = tmp_path / "inline.npy"
    spec = ",".join(f"{m}={w!r}" for m, w in record["weights"].items())
    res2 = CliRunner().invoke(
        main, [*args[:4], str(inline), *args[5:], "--rank", "combine", "--weights", spec]
    )
    assert res2.exit_code == 0, res2.output
    assert _kept(out) == _kept(inline)
    assert set(array_to_uids(np.load(out))) == {df["uid"][i] for i in top}
    meta = json.loads((tmp_path / "s.json").read_text())
    filed = meta["rank"]["weights_file"]
    assert record["data"]["labels_sha256"] in json.dumps(filed)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() in json.dumps(filed)


@pytest.mark.parametrize(
    "content, extra, message",
    [
        ("[1, 2]", [], "expected a mapping metric: weight"),
        ("{}", [], "no weights in it"),
        ('{"eps_i": 1, "nope": 2}', [], "'nope' is neither a numeric column"),
        (None, ["--normalize", "rank"], "fitted with normalize zscore"),
    ],
)
def test_combine_weights_file_errors(pool, tmp_path, content, extra, message):
    path = tmp_path / "w.json"
    if content is None:
        assert (
            fit("--scores", str(pool["run"]), "--labels", str(pool["labels"]), "--out", str(path)).exit_code
            == 0
        )
    else:
        path.write_text(content)
    res = CliRunner().invoke(
        main,
        [
            "select",
            "--scores",
            str(pool["run"]),
            "--out",
            str(tmp_path / "s.npy"),
            "--frac",
            "0.1",
            "--no-progress",
            "--rank",
            "combine",
            "--weights",
            str(path),
            *extra,
        ],
    )
    assert res.exit_code != 0 and message in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "s.npy").exists()

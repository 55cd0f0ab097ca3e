"""`hype report`: content, escaping of untrusted captions, and rendering in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from PIL import Image
from test_select_helpers import make_world, truth_scores, write_scores

import hype.filters  # noqa: F401  (registers the bundled rules for select_subset without the CLI)
from hype.cli import main
from hype.data.uids import uid_to_pair
from hype.report import write_report
from hype.select import SelectError
from hype.select.run import SelectRequest, select_subset
from hype.table.schema import METRICS

SCRIPT = "<script>document.title='pwned';document.body.setAttribute('data-pwned','1')</script>"
IMG = "<img src=x onerror=\"document.body.setAttribute('data-pwned','2')\">"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    world = make_world(root / "world", size=600)
    df = truth_scores(world)
    # Untrusted web captions: every other caption carries a script or an event-handler payload.
    df.loc[::2, "text"] = [f"{t} {SCRIPT if i % 2 else IMG}" for i, t in enumerate(df["text"][::2])]
    # Small images all score low: the cut keeps none of them, and the size audit flags them.
    df.loc[np.minimum(df["width"], df["height"]) < 64, "cos_theta"] = -5.0
    run = write_scores(df, root / "run", parts=2, row_group_size=128)
    summary = {
        "counts": {"scored": 600, "skipped": 3},
        "skips": {"corrupt_image": 3},
        "note": "</td><script>document.title='pwned'</script>",
    }
    (run / "summary.json").write_text(json.dumps(summary))
    _decontam_matches(run, world, df)
    select_subset(SelectRequest(scores=run, out=root / "subset.npy", frac=0.2, progress=False, audit=True))
    out = root / "report.html"
    info = write_report(run, out, subset=root / "subset.npy", progress=False)
    return {"root": root, "run": run, "out": out, "info": info, "df": df, "world": world}


TASK = "synth-shape<script>document.title='pwned'</script>"  # a task name comes from a folder name


def _decontam_matches(run, world, df) -> None:
    """RUN_DIR/decontam/ as `hype score --decontaminate` writes it: 3 pool samples matched to 3 images of
    the world's evaluation set (hype.scoring.decontam's schema and marker)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hype.scoring.decontam import MATCH_SCHEMA
    from hype.synth.contaminate import eval_images

    images = eval_images(sorted((world / "eval" / "wds_synth-shape_test" / "test").glob("*.tar")))[:3]
    cols = {
        "uid": list(df.uid[:3]),
        "shard": list(df.shard[:3]),
        "key": list(df.key[:3]),
        "task": [TASK] * 3,
        "eval_shard": [i[0] for i in images],
        "eval_key": [i[1] for i in images],
        "similarity": [0.99, 0.98, 0.97],
        "copy_similarity": [0.99, 0.95, 0.9],
    }
    (run / "decontam").mkdir()
    pq.write_table(pa.table(cols, MATCH_SCHEMA), run / "decontam" / "matches.parquet")
    marker = {"threshold": 0.95, "eval_dir": str(world / "eval"), "pool_samples": 600, "flagged_samples": 3}
    marker["tasks"] = {TASK: {"eval_images": 8, "matches": 3}}
    (run / "decontam" / "matches.json").write_text(json.dumps(marker))


def chromium(*args: str, tmp) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium)")
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


def test_page_is_self_contained_and_escapes_untrusted_text(report):
    page = report["out"].read_text()
    gallery = report["info"]["gallery"]
    assert report["info"]["thumbnails"]["shown"] == 60 + gallery  # 2 metrics x 5 buckets x 6, the gallery
    assert report["info"]["decontam_thumbnails"]["shown"] == 6  # 3 matches: pool and evaluation image
    assert "cos 0.9900 · copy 0.990" in page and "cos 0.9700 · copy 0.900" in page  # both similarities
    assert page.count("src='data:image/jpeg;base64,") == 60 + gallery + 6
    assert "<script" not in page.lower() and "onerror=" not in page.replace("onerror=&quot;", "")
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;" in page
    assert "&lt;img src=x onerror=&quot;" in page
    assert not re.search(r"(src|href)=['\"]?(https?:|//)", page)  # nothing fetched from anywhere
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    # a histogram per metric, the correlation matrix, the language and size audits
    assert page.count("<svg") == 5 + 1 + 2
    # The run summary and the selection summary are shown (skips highlighted).
    assert "counts.skipped" in page and "skips.corrupt_image" in page and "target.k" in page


def test_statistics_match_the_table(report):
    from hype.report.collect import collect

    data = collect(report["run"], report["root"] / "subset.npy", progress=False)
    df = report["df"]
    assert data.pool_rows == 600 and data.subset_in_pool == 120
    np.testing.assert_allclose(
        data.correlation, df[list(data.metrics)].astype(float).corr().to_numpy(), atol=1e-9
    )
    for m in data.metrics:
        assert data.pool_hist[m].sum() == 600 and data.subset_hist[m].sum() == 120
    for m, buckets in data.buckets.items():
        edges = data.bucket_edges[m]
        for k, samples in enumerate(buckets):
            assert len(samples) == 6
            assert all(edges[k] - 1e-3 <= s.values[m] <= edges[k + 1] + 1e-3 for s in samples)


def test_chromium_renders_histograms_and_runs_no_injected_code(report, tmp_path):
    dom = chromium("--dump-dom", report["out"].as_uri(), tmp=tmp_path / "profile-dom").stdout
    assert "<title>HYPE report</title>" in dom  # no payload changed the title
    assert not re.search(r"<body[^>]*data-pwned", dom)  # ... nor set an attribute on the body
    assert (
        dom.count("<svg") == 8 and dom.count('class="bar pool"') > 20 and dom.count('class="bar subset"') > 10
    )
    assert "&lt;script&gt;document.title=" in dom  # shown as text, not run
    assert "<script" not in dom.lower()
    # Decontamination: per match, the pool thumbnail and the evaluation thumbnail side by side.
    assert dom.count('class="pair"') == 3 and dom.count('alt="evaluation image ') == 3
    assert dom.count('alt="pool sample ') == 3 and "cos 0.99" in dom

    png = tmp_path / "shot.png"
    chromium(
        f"--screenshot={png}",
        "--window-size=1280,1400",
        "--hide-scrollbars",
        report["out"].as_uri(),
        tmp=tmp_path / "profile-shot",
    )
    img = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert img.shape[1] == 1280 and img.std() > 10  # not blank

    def near(colour, region):
        return int((np.abs(region - np.array(colour)).sum(axis=2) < 40).sum())

    charts = img[250:900]  # the histogram rows, below the title and the counters
    pool = (232, 137, 138)  # #d62728 at 55% over white
    subset = (139, 203, 139)  # #2ca02c at 55% over white
    assert near(pool, charts) > 300 and near(subset, charts) > 300
    assert near(pool, img[:200]) < 50  # the header above the charts has no bars


def test_cli_missing_shards_and_errors(report, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(report["world"] / "pool" / "shards", moved)
    run = tmp_path / "run"
    df = report["df"].copy()
    df["shard"] = ["gone/" + s.rsplit("/", 1)[1] for s in df["shard"]]
    write_scores(df, run, parts=1)
    out = tmp_path / "r.html"
    res = CliRunner().invoke(main, ["report", "--scores", str(run), "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "60 unavailable: pass --pool" in res.output and "could not be shown" in out.read_text()
    res = CliRunner().invoke(
        main,
        ["report", "--scores", str(run), "--out", str(out), "--pool", str(moved), "--no-progress", "--json"],
    )
    assert json.loads(res.output)["thumbnails"]["shown"] == 60
    with pytest.raises(SelectError, match="HTML page"):
        write_report(run, tmp_path / "r.pdf", progress=False)
    with pytest.raises(SelectError, match="no scores found"):
        write_report(tmp_path, tmp_path / "r.html", progress=False)


def test_a_report_from_and_to_object_storage_is_the_local_one(report, tmp_path, s3):
    """Subset, pool shards and --out on S3 (shards found through --pool, or named by URL in the scores):
    the page is the one a local run writes, but for the paths in its header."""
    from hype.io import read_bytes, storage

    root = f"s3://{s3.bucket()}"
    shards = report["world"] / "pool" / "shards"
    for tar in sorted(shards.glob("*.tar")):
        storage.upload(tar, storage.location(f"{root}/pool/{tar.name}"))
    for name in ("subset.npy", "subset.json"):
        storage.upload(report["root"] / name, storage.location(f"{root}/{name}"))
    df = report["df"].copy()
    names = [s.rsplit("/", 1)[1] for s in df["shard"]]
    df["shard"] = ["gone/" + n for n in names]
    moved = write_scores(df, tmp_path / "moved", parts=2, row_group_size=128)
    df["shard"] = [f"{root}/pool/{n}" for n in names]
    on_s3 = write_scores(df, tmp_path / "on_s3", parts=2, row_group_size=128)

    def page(data: bytes) -> str:
        return re.sub(r"<div class='muted'>scores .*?</div>", "", data.decode("utf-8"), count=1)

    local = write_report(
        moved, tmp_path / "r.html", subset=report["root"] / "subset.npy", pool=str(shards), progress=False
    )
    expected = page((tmp_path / "r.html").read_bytes())
    for run, pool in ((moved, f"{root}/pool"), (on_s3, None)):
        info = write_report(run, f"{root}/r.html", subset=f"{root}/subset.npy", pool=pool, progress=False)
        assert info["thumbnails"] == local["thumbnails"]
        assert local["thumbnails"]["shown"] == 60 + local["gallery"] and local["gallery"] > 0
        assert page(read_bytes(f"{root}/r.html")) == expected


def test_a_missing_bucket_is_named(report, s3):
    res = CliRunner().invoke(
        main,
        [
            "report",
            "--scores",
            str(report["run"]),
            "--out",
            "s3://no-such-bucket-hype/r.html",
            "--no-progress",
        ],
    )
    assert res.exit_code == 1
    assert "s3://no-such-bucket-hype/r.html: the bucket does not exist; create it" in res.output


def test_the_selection_cut_offs_gallery_and_audits(report):
    """With a subset whose subset.json records the selection: each term's cut-off is where a sample with
    the other terms at their pool medians reaches the cut score; the gallery shows dropped samples only,
    grouped by the main deficit `hype explain` gives them (one group per term, at most --gallery each, every
    one a term select counted as the main deficit of dropped rows); the audits are drawn as bars, flags in
    red."""
    from hype.report.page import e
    from hype.select.audit import too_small_line
    from hype.select.explain import Wanted, explain_selection, request_from_summary

    page = report["out"].read_text()
    df, info = report["df"], report["info"]
    summary = json.loads((report["root"] / "subset.json").read_text())
    medians = {m: summary["metrics"][m]["pool"]["quantiles"]["p50"] for m in METRICS}
    scores = df[list(METRICS)].astype(np.float64).sum(axis=1).sort_values(ascending=False)
    cut = scores.iloc[119]  # the 120th of 600: the last kept row's score
    for m in METRICS:  # the hype rule: contribution = value, so the cut-off is cut - the others' medians
        want = cut - sum(v for k, v in medians.items() if k != m)
        if df[m].min() < want <= df[m].max():
            assert info["cutoffs"][m] == pytest.approx(want, abs=1e-4)
        else:
            assert info["cutoffs"][m] is None
    shown = sum(v is not None for v in info["cutoffs"].values())
    assert shown >= 1 and page.count("class='cutoff'") == shown
    assert page.count("no cut-off (none alone)") == len(METRICS) - shown

    kept = set(pq.read_table(report["root"] / "subset.parquet").column("uid").to_pylist())
    figures = re.findall(
        r"<figure class='dropped' data-deficit='([^']*)'><img src='[^']*' alt='sample (\w+)'", page
    )
    assert len(figures) == info["gallery"] > 0 and not {u for _, u in figures} & kept
    req = request_from_summary(summary, str(report["run"]))
    from hype.select.run import SelectRequest

    uids = np.unique(np.array([uid_to_pair(u) for _, u in figures], dtype="u8,u8"))
    again = explain_selection(SelectRequest(out="x.npy", progress=False, **req), Wanted(uids=uids))
    deficit = {r["uid"]: (r["deficit"] or {}).get("term", "none") for r in again["rows"]}
    assert all(deficit[u] == d for d, u in figures)
    groups = [d for i, (d, _) in enumerate(figures) if i == 0 or figures[i - 1][0] != d]
    assert len(groups) == len(set(groups)) >= 2  # each term's samples together, under its heading
    assert "<h3>Dropped samples by main deficit</h3>" in page
    assert page.count("<h4>main deficit: ") == len(set(groups) - {"none"})
    for d in groups:
        assert sum(1 for x, _ in figures if x == d) <= 6 and summary["decisions"]["deficit"][d] > 0
    assert "<th>main deficit of</th>" in page

    assert "data-audit='size'" in page and "data-audit='language'" in page
    small = summary["audit"]["size"]["groups"]["< 64 px"]
    assert small["kept"] == 0 and small["rows"] >= 20
    assert page.count("class='bar flagged'") == sum(
        len(a.get("flags", [])) for a in summary["audit"].values()
    )
    assert "keeps 0.0% of images with shorter side &lt; 64 px" in page
    # the groups too small to judge one by one are named, with what they lost together (said nothing before)
    small = {name: a["too_small"] for name, a in summary["audit"].items() if a.get("too_small")}
    assert small and page.count("<li class='too-small'>") == len(small)
    for name, t in small.items():
        assert f"{e(name)}: {e(too_small_line(t))}" in page


def test_chromium_draws_the_selection(report, tmp_path):
    """The cut-off lines, the gallery of dropped samples and the audit bars, rendered by Chromium (the
    screenshot stays in the test's folder); no injected caption of the gallery runs."""
    out = tmp_path / "selection.html"
    args = ["report", "--scores", str(report["run"]), "--subset", str(report["root"] / "subset.npy")]
    res = CliRunner().invoke(main, [*args, "--out", str(out), "--per-bucket", "0", "--no-progress"])
    assert res.exit_code == 0, res.output
    gallery = report["info"]["gallery"]
    assert (
        f"selection: 1 cut-off lines, {gallery} dropped samples by main deficit, audits included"
        in res.output
    )
    dom = chromium("--dump-dom", out.as_uri(), tmp=tmp_path / "profile-dom").stdout
    assert "<title>HYPE report</title>" in dom and not re.search(r"<body[^>]*data-pwned", dom)
    assert dom.count('class="cutoff"') >= 1 and dom.count('class="bar flagged"') >= 1
    assert dom.count('<figure class="dropped"') == dom.count("data-deficit=") == gallery
    assert "Dropped samples by main deficit" in dom
    png = tmp_path / "selection.png"
    chromium(
        f"--screenshot={png}",
        "--window-size=1280,4200",
        "--hide-scrollbars",
        out.as_uri(),
        tmp=tmp_path / "p",
    )
    img = np.asarray(Image.open(png).convert("RGB")).astype(int)
    flagged = (214, 39, 40)  # #d62728: a flagged audit group's label and bar, below the histograms
    assert int((np.abs(img[1200:] - np.array(flagged)).sum(axis=2) < 30).sum()) > 200
    dark = (np.abs(img - 17).sum(axis=2) < 30)[250:900]  # the cut-off line (#111) among the histograms
    assert int(dark.sum()) > 100

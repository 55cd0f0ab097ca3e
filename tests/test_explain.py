"""`hype explain`, the decisions and audits in subset.json, and `--frac-of nominal`, checked against a brute
force reference (pandas: float64 sums, sort by score desc then uid asc, every term swapped to its median)
on the synthetic world's scores."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from test_select_helpers import make_world, truth_scores, write_scores

import hype.filters  # noqa: F401  (registers the bundled rules)
from hype.cli import main
from hype.table.schema import METRICS


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain")
    w = make_world(root / "world", size=600)
    df = truth_scores(w)
    write_scores(df, root / "run", parts=3, row_group_size=97)
    return {"root": root, "world": w, "run": root / "run", "df": df}


def cli(*args: str) -> str:
    res = CliRunner().invoke(main, [*args, "--no-progress"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def reference(df: pd.DataFrame, k: int, medians: dict, eligible: np.ndarray | None = None) -> pd.DataFrame:
    """Score, rank, kept and decisive term of every row, by brute force (terms swapped one at a time)."""
    d = df.copy()
    d["eligible"] = True if eligible is None else eligible
    contrib = {m: d[m].to_numpy(np.float64) for m in METRICS}

    def total(c):
        s = np.zeros(len(d))
        for m in METRICS:
            s = s + c[m]
        return s

    d["score"] = total(contrib)
    order = d[d["eligible"]].sort_values(["score", "uid"], ascending=[False, True], kind="mergesort")
    rank = pd.Series(np.arange(1, len(order) + 1), index=order.index)
    d["rank"] = rank
    d["kept"] = d["rank"] <= k
    last = order.iloc[k - 1]
    first_dropped = order.iloc[k] if len(order) > k else None

    def above(s, uid, row):  # (s, uid) ranks at or above `row`
        return s > row["score"] or (s == row["score"] and uid <= row["uid"])

    decisive = []
    for i, r in d.iterrows():
        if not r["eligible"]:
            decisive.append("filter")
            continue
        best, name = None, "none alone"
        for m in METRICS:
            swapped = total({**{j: np.array([contrib[j][i]]) for j in METRICS}, m: np.array([medians[m]])})[0]
            if r["kept"]:
                flips = first_dropped is not None and not (
                    swapped > first_dropped["score"]
                    or (swapped == first_dropped["score"] and r["uid"] < first_dropped["uid"])
                )
                if flips and (best is None or swapped < best):
                    best, name = swapped, m
            else:
                if above(swapped, r["uid"], last) and (best is None or swapped > best):
                    best, name = swapped, m
        decisive.append(name)
    d["decisive"] = decisive
    return d


def test_explain_and_subset_json_agree_with_the_brute_force_reference(world, tmp_path):
    out = tmp_path / "s.npy"
    cli("select", "--scores", str(world["run"]), "--frac", "0.2", "--out", str(out))
    summary = json.loads(out.with_suffix(".json").read_text())
    medians = {m: summary["metrics"][m]["pool"]["quantiles"]["p50"] for m in METRICS}
    ref = reference(world["df"], 120, medians)
    dec = summary["decisions"]
    assert dec["medians"] == medians
    dropped = ref[~ref["kept"]]
    assert dec["dropped_rows"] == len(dropped) == 480 and dec["kept_rows"] == 120
    assert dec["decisive"] == {
        name: int((dropped["decisive"] == name).sum()) for name in [*METRICS, "none alone"]
    }
    assert sum(dec["decisive"].values()) == 480 and dec["decisive"]["none alone"] < 480

    for which in ("--dropped", "--kept"):
        text = cli("explain", "--subset", str(out.with_suffix(".json")), "--sample", "12", which, "--json")
        got = json.loads(text)
        assert got["k"] == 120 and got["cut"]["score"] == summary["cut"]["score"]
        assert len(got["rows"]) == 12
        for row in got["rows"]:
            r = ref.set_index("uid").loc[row["uid"]]
            assert row["kept"] == bool(r["kept"]) == (which == "--kept")
            assert row["score"] == r["score"] and row["rank"] == r["rank"]
            assert row["decisive"] == r["decisive"]
            contributions = [row["terms"][m]["contribution"] for m in METRICS]
            assert sum(contributions) == pytest.approx(row["score"], abs=1e-12)
            below = {}  # the terms whose median would raise the score: their brute-force midranks
            for m in METRICS:  # the mid-rank, within the histogram's bins (relative 2^-9 wide)
                x, v = world["df"][m].to_numpy(np.float64), r[m]
                midrank = ((x < v).mean() + (x == v).mean() / 2) * 100
                near = (np.abs(x - v) <= abs(v) * 2.0**-8).mean() * 100
                assert row["terms"][m]["percentile"] == pytest.approx(midrank, abs=near + 0.01)
                assert row["terms"][m]["contribution_percentile"] == row["terms"][m]["percentile"]
                if np.float32(medians[m]) > np.float32(v):
                    below[m] = (midrank, near)
            # the main deficit: the lowest midrank among them (checked where the histogram cannot swap two)
            if not below:
                assert row["deficit"] is None
                continue
            ranked = sorted(below, key=lambda m: below[m][0])
            tol = max(below[m][1] for m in ranked[:2]) + 0.02
            if len(ranked) == 1 or below[ranked[1]][0] - below[ranked[0]][0] > 2 * tol:
                assert row["deficit"]["term"] == ranked[0], (row, below)
                assert row["deficit"]["percentile"] == pytest.approx(below[ranked[0]][0], abs=tol)


def test_explain_by_uid_with_a_filter_and_zscore_names_the_filter_and_finds_every_uid(world, tmp_path):
    df = world["df"]
    small = df["uid"][df["width"].lt(100) | df["height"].lt(100)].iloc[0]
    big = df["uid"][df["width"].ge(100) & df["height"].ge(100)].iloc[:3].tolist()
    absent = "f" * 32
    uids = tmp_path / "uids.txt"
    uids.write_text("\n".join([small, *[u.upper() for u in big], absent]) + "\n")
    args = ["--scores", str(world["run"]), "--top-k", "50", "--normalize", "zscore"]
    args += ["--filter", "basic:english=false,min_side=100,min_words=1,min_chars=1"]
    got = json.loads(cli("explain", *args, "--uids", str(uids), "--json"))
    rows = {r["uid"]: r for r in got["rows"]}
    assert set(rows) == {small, *big} and got["missing"] == [absent]
    assert rows[small]["eligible"] is False and rows[small]["decisive"].startswith("filter:basic")
    assert "rank" not in rows[small]
    for u in big:
        r = rows[u]
        assert r["eligible"] and sum(t["contribution"] for t in r["terms"].values()) == pytest.approx(
            r["score"]
        )
        mean, std = df["eps_i"].astype(np.float64).mean(), df["eps_i"].astype(np.float64).std(ddof=0)
        assert r["terms"]["eps_i"]["contribution"] == pytest.approx(
            (r["terms"]["eps_i"]["value"] - mean) / std
        )
    text = cli("explain", *args, "--uids", str(uids))
    assert "removed by: basic" in text and f"{absent}: not in the scores table" in text


def test_explain_subset_finds_the_scores_its_record_names_from_any_folder(world, tmp_path, monkeypatch):
    """subset.json records its scores table's absolute location, and a relative one (an older record) is
    read relative to the record's folder: `explain --subset` never reads a table found from the current
    folder. Malformed records are one-line errors."""
    import os

    record = tmp_path / "sel" / "s.json"
    monkeypatch.chdir(world["root"])
    cli("select", "--scores", "run", "--frac", "0.2", "--out", str(record.with_suffix(".npy")))
    assert json.loads(record.read_text())["scores"] == str(world["run"] / "scores")
    uid = world["df"]["uid"].iloc[0]
    expected = json.loads(cli("explain", "--subset", str(record), "--uid", uid, "--json"))
    elsewhere = tmp_path / "a" / "b"  # not at the record's depth: its relative path leads nowhere here
    (elsewhere / "run").mkdir(parents=True)  # a "run" here must not be read instead
    monkeypatch.chdir(elsewhere)
    assert json.loads(cli("explain", "--subset", str(record), "--uid", uid, "--json")) == expected

    older = json.loads(record.read_text())
    older["scores"] = os.path.relpath(world["run"] / "scores", record.parent)
    record.write_text(json.dumps(older))
    assert json.loads(cli("explain", "--subset", str(record), "--uid", uid, "--json")) == expected
    for bad in (7, ["run", 7], None):
        record.write_text(json.dumps({**older, "scores": bad}))
        res = CliRunner().invoke(main, ["explain", "--subset", str(record), "--uid", uid, "--no-progress"])
        assert res.exit_code != 0 and "not a subset.json written by `hype select`" in res.output
        assert "Traceback" not in res.output


def test_explain_refuses_unclear_requests(world):
    res = CliRunner().invoke(
        main, ["explain", "--scores", str(world["run"]), "--frac", "0.2", "--no-progress"]
    )
    assert res.exit_code != 0 and "--uid U" in res.output
    res = CliRunner().invoke(
        main, ["explain", "--scores", str(world["run"]), "--frac", "0.2", "--uid", "xyz", "--no-progress"]
    )
    assert res.exit_code != 0 and "'xyz' is not a uid" in res.output


def test_audit_flags_a_group_the_cut_wipes_out(world, tmp_path):
    df = world["df"].copy()
    # Images with a shorter side under 64 px: all scored low, so the cut keeps none of them.
    short = np.minimum(df["width"], df["height"]) < 64
    assert 20 <= short.sum() < 400
    df.loc[short, "cos_theta"] = -5.0
    run = write_scores(df, tmp_path / "run", parts=2, row_group_size=100)
    out = tmp_path / "s.npy"
    text = cli("select", "--scores", str(run), "--frac", "0.2", "--out", str(out), "--audit")
    audit = json.loads(out.with_suffix(".json").read_text())["audit"]
    assert audit["size"]["groups"]["< 64 px"] == {"rows": int(short.sum()), "kept": 0, "kept_frac": 0.0}
    assert any(
        f.startswith("keeps 0.0% of images with shorter side < 64 px against 20.0% overall")
        for f in audit["size"]["flags"]
    )
    assert "FLAG keeps 0.0% of images with shorter side < 64 px" in text
    assert sum(g["rows"] for g in audit["language"]["groups"].values()) == 600
    assert "skipped" in audit["concept"]["note"] and "--metadata" in audit["domain"]["note"]


def test_frac_of_nominal_counts_metadata_uids_that_were_never_scored(world, tmp_path):
    df = world["df"].iloc[:500]  # 100 samples "failed to download": in the metadata, not scored
    run = write_scores(df, tmp_path / "run", parts=2, row_group_size=100)
    meta = world["world"] / "pool" / "metadata"
    out = tmp_path / "s.npy"
    args = ["select", "--scores", str(run), "--frac", "0.2", "--out", str(out)]
    text = cli(*args, "--frac-of", "nominal", "--metadata", str(meta), "--audit")
    s = json.loads(out.with_suffix(".json").read_text())
    assert s["nominal_rows"] == 600 and s["selected_rows"] == 120  # 20% of 600, not of the 500 scored
    assert s["fractions"] == {"of_scored": 120 / 500, "of_eligible": 120 / 500, "of_nominal": 0.2}
    assert "kept 24.00% of scored, 24.00% of eligible, 20.00% of the 600 nominal" in text
    assert s["audit"]["domain"]["groups"]["127.0.0.1"] == {"rows": 600, "kept": 120, "kept_frac": 0.2}
    res = CliRunner().invoke(main, [*args, "--frac-of", "nominal", "--no-progress"])
    assert res.exit_code != 0 and "--metadata DIR" in res.output


def test_on_the_synthetic_world_the_named_term_is_the_noise_kind(world, tmp_path):
    """Dropped noisy samples: a decisive term, when one is named, and the main term match the truth
    table's noise kind (misaligned -> neg_d_l, underspecified text -> eps_t, image -> eps_i)."""
    truth = pd.read_parquet(world["world"] / "truth.parquet").set_index("uid")
    (tmp_path / "all.txt").write_text("\n".join(truth.index) + "\n")
    args = ["--scores", str(world["run"]), "--frac", "0.2", "--uids", str(tmp_path / "all.txt"), "--json"]
    rows = pd.DataFrame(json.loads(cli("explain", *args))["rows"]).set_index("uid").join(truth["noise"])
    expected = {"misaligned": "neg_d_l", "underspecified_text": "eps_t", "underspecified_image": "eps_i"}
    dropped = rows[~rows["kept"] & rows["noise"].isin(list(expected))]
    want = dropped["noise"].map(expected)
    named = dropped["decisive"] != "none alone"
    assert named.sum() >= 30 and (dropped["decisive"][named] == want[named]).all()
    assert (dropped["main"] == want).mean() > 0.95
    # misaligned samples are far below the pool on both -d_L and cos θ (by construction of these scores):
    # the lowest percentile is either
    deficit = dropped["deficit"].map(lambda d: d["term"])
    both = (dropped["noise"] == "misaligned") & (deficit == "cos_theta")
    assert ((deficit == want) | both).mean() > 0.95


def test_the_main_deficit_names_the_lowest_percentile_not_the_widest_term(world, tmp_path):
    """c_IN is 0 or 10 and its median 0 here: a c_IN of 0 is at the median and never a deficit. With c_IN
    weighted x -1 (10 is now the low side) and eps_t x 100 (a wide term): the main term follows the
    weights, the deficit the percentiles; a negative weight turns the contribution's percentile over."""
    df = world["df"]
    assert np.median(df["c_in"]) == 0
    weights = "eps_i=1,eps_t=100,neg_d_l=1,cos_theta=1,c_in=-1"
    args = ["--scores", str(world["run"]), "--frac", "0.2", "--weights", weights, "--json"]
    got = json.loads(cli("explain", *args, "--sample", "200"))
    rows = [r for r in got["rows"] if r["deficit"]]
    assert len(rows) >= 150
    for r in rows:
        t, d = r["terms"], r["deficit"]
        assert t["c_in"]["contribution_percentile"] == pytest.approx(100 - t["c_in"]["percentile"])
        lower = [m for m in METRICS if t[m]["median_contribution"] > t[m]["contribution"]]
        assert d["term"] in lower and d["percentile"] == min(t[m]["contribution_percentile"] for m in lower)
    # a c_IN of 10 (contribution -10, below the median's 0) is in the top of the pool's values, the bottom
    # of its contributions
    c10 = [r for r in rows if r["terms"]["c_in"]["value"] == 10]
    assert c10 and all(r["terms"]["c_in"]["contribution_percentile"] < 50 for r in c10)
    # where c_IN does not hold the row down and eps_t is below its median, the main term is eps_t (x 100:
    # a slight shortfall outweighs any other term's), the deficit eps_t only where it is the rarest value
    c0 = [r for r in rows if r["terms"]["c_in"]["value"] == 0 and r["terms"]["eps_t"]["percentile"] < 50]
    main = np.mean([r["main"] == "eps_t" for r in c0])
    deficit = np.mean([r["deficit"]["term"] == "eps_t" for r in c0])
    assert len(c0) >= 30 and main > 0.9 and deficit < main - 0.2
    text = cli("explain", *args[:-1], "--sample", "3")
    assert "main deficit: " in text and "at pool percentile" in text


def brute_force_deficits(df: pd.DataFrame, dropped: np.ndarray, medians: dict, weights: dict) -> dict:
    """Per term, the dropped rows whose main deficit it is, by brute force: exact pool mid-ranks (pandas
    ranks, rounded to 0.01 as explain prints them), turned over for a negative weight; of the terms whose
    median contribution is above the row's, the lowest percentile, then the larger lift, then the name."""
    n = len(df)
    pct, lift = {}, {}
    for m in METRICS:
        s = df[m].astype(np.float32)
        below, ties = s.rank(method="min") - 1, s.map(s.value_counts())
        p = ((below + 0.5 * ties) / n * 100).round(2)
        pct[m] = (100 - p).round(2) if weights[m] < 0 else p
        lift[m] = float(np.float32(medians[m])) * weights[m] - s.astype(np.float64) * weights[m]
    counts = dict.fromkeys([*METRICS, "none"], 0)
    for i in np.flatnonzero(dropped):
        low = [(pct[m].iloc[i], -lift[m].iloc[i], m) for m in METRICS if lift[m].iloc[i] > 0]
        counts[min(low)[2] if low else "none"] += 1
    return counts


def test_subset_json_counts_the_main_deficit_of_every_dropped_row_like_the_brute_force(world, tmp_path):
    """`decisions.deficit` in subset.json: the main deficit of every dropped row, counted per term, equals
    the brute-force count, with and without the pool-stats cache (which keeps no histograms) and with a
    negative and a wide weight; the row-by-row `hype explain` names the same terms."""
    import pyarrow.parquet as pq

    from hype.table.keys import KeyHistogram
    from hype.table.stats import HIST_BITS

    df = world["df"].copy()
    # Ties of percentile: cos θ and ε_t hold ε_i's values, a third of them in the same rows (the same
    # percentile: the lift, then the name decides), the rest shuffled.
    rng, n = np.random.default_rng(1), len(df)
    for m in ("cos_theta", "eps_t"):
        order = np.arange(n)
        order[order % 3 != 0] = rng.permutation(order[order % 3 != 0])
        df[m] = df["eps_i"].to_numpy()[order]
    for m in METRICS:  # on a 2^-8 grid, so that no two values share a histogram bin: exact percentiles
        df[m] = (np.round(df[m].astype(np.float64) * 256) / 256).astype(np.float32)
        values = np.unique(df[m].to_numpy())
        assert len(np.unique(KeyHistogram(HIST_BITS).bins(values))) == len(values) >= 2
    run = write_scores(df, tmp_path / "run", parts=3, row_group_size=97)
    plain = dict.fromkeys(METRICS, 1.0)
    turned = {**plain, "eps_t": 100.0, "c_in": -1.0}
    for i, weights in enumerate([plain, turned, plain]):  # the 2nd and 3rd read the pool-stats cache
        out = tmp_path / f"s{i}.npy"
        arg = ",".join(f"{m}={w:g}" for m, w in weights.items())
        cli("select", "--scores", str(run), "--frac", "0.2", "--weights", arg, "--out", str(out))
        assert list((run / "select_cache").glob("pool-stats-*.json"))
        summary = json.loads(out.with_suffix(".json").read_text())
        medians = {m: summary["metrics"][m]["pool"]["quantiles"]["p50"] for m in METRICS}
        kept = set(pq.read_table(out.with_suffix(".parquet")).column("uid").to_pylist())
        dropped = ~df["uid"].isin(kept).to_numpy()
        want = brute_force_deficits(df, dropped, medians, weights)
        assert summary["decisions"]["deficit"] == want and sum(want.values()) == 480
        assert sum(v > 0 for k, v in want.items() if k != "none") >= 2
        if i == 1:  # hype explain's row-by-row deficit: the same counts
            rows = json.loads(
                cli("explain", "--subset", str(out.with_suffix(".json")), "--sample", "600", "--json")
            )
            named = [r["deficit"]["term"] if r["deficit"] else "none" for r in rows["rows"]]
            assert {k: named.count(k) for k in want} == want

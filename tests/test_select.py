"""`hype select`: exact top-fraction selection over a partitioned scores table, presets, outputs, errors.

Every selection is compared with an independent reference (pandas, float64 sums, sort by score desc then
uid asc) on tables written in the scores-table schema.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from test_select_helpers import make_world, reference_top, save_memmap_subset, truth_scores, write_scores

import hype.filters  # noqa: F401  (registers the bundled rules for select_subset without the CLI)
from hype.cli import main
from hype.data.uids import array_to_uids, load_subset
from hype.io import json_text
from hype.select import SelectError
from hype.select import reducer as reducer_module
from hype.select.run import SelectRequest, select_subset
from hype.table.schema import METRICS

ALL = dict.fromkeys(METRICS, 1.0)
PRESET_WEIGHTS = {
    "hype": ALL,
    "no-c-in": {"eps_i": 1, "eps_t": 1, "neg_d_l": 1, "cos_theta": 1},
    "no-cos": {"eps_i": 1, "eps_t": 1, "neg_d_l": 1, "c_in": 1},
    "cos-only": {"cos_theta": 1},
    "specificity-only": {"eps_i": 1, "eps_t": 1},
    "eps-i-only": {"eps_i": 1},
    "eps-t-only": {"eps_t": 1},
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("select")
    w = make_world(root / "world", size=600)
    df = truth_scores(w)
    write_scores(df, root / "run", parts=3, row_group_size=97)
    return {"root": root, "world": w, "run": root / "run", "df": df}


def table(n: int, seed: int = 0, ties: bool = False) -> pd.DataFrame:
    """A made-up scores table; with `ties`, metrics take few distinct values so scores tie a lot."""
    rng = np.random.default_rng(seed)
    uids = [
        f"{int(h):016x}{int(lo):016x}"
        for h, lo in zip(
            rng.integers(0, 2**64, n, dtype=np.uint64),
            rng.integers(0, 2**64, n, dtype=np.uint64),
            strict=True,
        )
    ]
    cols = {}
    for m in METRICS:
        cols[m] = (rng.integers(0, 3, n) * 0.5 if ties else rng.normal(0, 1, n)).astype(np.float32)
    cols["c_in"] = np.where(rng.random(n) < 0.3, 10.0, 0.0).astype(np.float32)
    return pd.DataFrame(
        {
            "uid": uids,
            **cols,
            "shard": ["x.tar"] * n,
            "key": [str(i) for i in range(n)],
            "text": ["a photo of a red circle"] * n,
            "width": np.full(n, 300, np.int32),
            "height": np.full(n, 300, np.int32),
        }
    )


def run_cli(*args: str) -> str:
    res = CliRunner().invoke(main, ["select", *args, "--no-progress"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def test_frac_0_2_keeps_exactly_20_percent_and_the_reference_top(world, tmp_path):
    out = tmp_path / "subset.npy"
    text = run_cli("--scores", str(world["run"]), "--frac", "0.2", "--out", str(out))
    assert "selected 120 of 600" in text
    assert "ranked by hype (eps_i + eps_t + neg_d_l + cos_theta + c_in; normalize none)" in text
    arr = load_subset(out)  # validates dtype u8,u8 and sorting
    uids = array_to_uids(arr)
    assert len(uids) == 120 == round(0.2 * 600)
    assert uids == reference_top(world["df"], ALL, 120)
    assert set(uids) <= set(world["df"]["uid"])

    kept = pd.read_parquet(tmp_path / "subset.parquet")
    assert sorted(kept["uid"]) == uids
    df = world["df"].set_index("uid").loc[kept["uid"]]
    expected = sum(df[m].to_numpy(np.float64) for m in METRICS)
    np.testing.assert_array_equal(kept["score"].to_numpy(), expected)
    for m in METRICS:
        np.testing.assert_array_equal(kept[m].to_numpy(), df[m].to_numpy())

    summary = json.loads((tmp_path / "subset.json").read_text())
    assert summary["pool_rows"] == 600 and summary["selected_rows"] == 120 and summary["subset_rows"] == 120
    assert summary["target"] == {
        "mode": "frac",
        "frac": 0.2,
        "frac_of": "pool",
        "k": 120,
        "rounding": summary["target"]["rounding"],
    }
    assert summary["rank"]["weights"] == ALL and summary["preset"] == "hype"
    pool_mean = world["df"]["cos_theta"].to_numpy(np.float64).mean()
    assert summary["metrics"]["cos_theta"]["pool"]["mean"] == pytest.approx(pool_mean, rel=1e-5)
    assert summary["metrics"]["cos_theta"]["subset"]["mean"] == pytest.approx(
        df["cos_theta"].mean(), rel=1e-5
    )
    q = summary["metrics"]["eps_i"]["pool"]["quantiles"]["p50"]
    assert q == pytest.approx(np.quantile(world["df"]["eps_i"], 0.5), rel=5e-3, abs=1e-3)
    assert summary["metrics"]["score"]["subset"]["min"] == pytest.approx(summary["cut"]["score"])


@pytest.mark.parametrize("preset", sorted(PRESET_WEIGHTS))
def test_presets_select_the_reference_top_for_their_weights(world, tmp_path, preset):
    out = tmp_path / f"{preset}.npy"
    run_cli("--scores", str(world["run"]), "--frac", "0.25", "--preset", preset, "--out", str(out))
    assert array_to_uids(load_subset(out)) == reference_top(world["df"], PRESET_WEIGHTS[preset], 150)


def test_hype_beats_clip_score_on_the_noise_it_is_meant_to_catch(world, tmp_path):
    # On the synthetic truth, cos θ alone cannot see underspecified texts/images; HYPE's sum can.
    truth = pd.read_parquet(world["world"] / "truth.parquet").set_index("uid")["noise"]
    shares = {}
    for preset in ("hype", "cos-only"):
        out = tmp_path / f"{preset}.npy"
        run_cli("--scores", str(world["run"]), "--frac", "0.3", "--preset", preset, "--out", str(out))
        noise = truth.loc[array_to_uids(load_subset(out))]
        shares[preset] = float(noise.isin(["underspecified_text", "underspecified_image"]).mean())
    assert shares["hype"] < shares["cos-only"]


def test_weights_option_and_json_output(world, tmp_path):
    out = tmp_path / "w.npy"
    text = run_cli(
        "--scores",
        str(world["run"]),
        "--top-k",
        "33",
        "--weights",
        "eps_i=2,cos_theta=0.5",
        "--out",
        str(out),
        "--json",
    )
    summary = json.loads(text)
    assert summary["selected_rows"] == 33 and summary["target"] == {"mode": "top_k", "k": 33}
    assert array_to_uids(load_subset(out)) == reference_top(world["df"], {"eps_i": 2, "cos_theta": 0.5}, 33)


@pytest.mark.parametrize(
    ("n", "frac", "k"), [(7, "0.5", 4), (5, "0.3", 2), (10, "0.25", 3), (3, "1", 3), (600, "0.2", 120)]
)
def test_frac_rounds_half_up_exactly(tmp_path, n, frac, k):
    df = table(n, seed=n)
    write_scores(df, tmp_path / "run", parts=1)
    s = select_subset(
        SelectRequest(scores=tmp_path / "run", out=tmp_path / "s.npy", frac=frac, progress=False)
    )
    assert s["selected_rows"] == k == s["target"]["k"]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [1, 17, 2500, 4999, 5000])
def test_reducer_matches_reference_with_and_without_ties(tmp_path, monkeypatch, ties, k):
    # A small pruning threshold makes the candidate buffer prune many times mid-stream.
    monkeypatch.setattr(reducer_module, "MIN_PRUNE_ROWS", 64)
    df = table(5000, seed=1, ties=ties)
    write_scores(df, tmp_path / "run", parts=4, row_group_size=333)
    s = select_subset(SelectRequest(scores=tmp_path / "run", out=tmp_path / "s.npy", top_k=k, progress=False))
    assert array_to_uids(load_subset(tmp_path / "s.npy")) == reference_top(df, ALL, k)
    score = sum(df[m].to_numpy(np.float64) for m in METRICS)
    cut = np.sort(score)[::-1][k - 1]
    assert s["cut"]["score"] == cut
    assert s["cut"]["rows_at_cut_score"] == int((score == cut).sum())
    assert s["cut"]["kept_at_cut_score"] == k - int((score > cut).sum())


def test_selection_does_not_depend_on_partitioning_order_or_threads(tmp_path):
    df = table(3000, seed=2, ties=True)
    write_scores(df, tmp_path / "a", parts=1, row_group_size=3000)
    write_scores(df.sample(frac=1.0, random_state=0), tmp_path / "b", parts=5, row_group_size=101)
    outs = []
    for run, workers in (("a", 1), ("b", 3)):
        out = tmp_path / f"{run}.npy"
        select_subset(
            SelectRequest(scores=tmp_path / run, out=out, frac=0.1, workers=workers, progress=False)
        )
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_threshold_and_keep_all(world, tmp_path):
    df = world["df"]
    score = sum(df[m].to_numpy(np.float64) for m in METRICS)
    t = float(np.quantile(score, 0.6))
    s = select_subset(SelectRequest(scores=world["run"], out=tmp_path / "t.npy", threshold=t, progress=False))
    assert array_to_uids(load_subset(tmp_path / "t.npy")) == sorted(df["uid"][score >= t])
    assert s["selected_rows"] == int((score >= t).sum()) and s["target"]["mode"] == "threshold"
    s = select_subset(
        SelectRequest(
            scores=world["run"],
            out=tmp_path / "all.npy",
            keep_all=True,
            filters=["image_cluster"],
            progress=False,
        )
    )
    assert array_to_uids(load_subset(tmp_path / "all.npy")) == sorted(df["uid"][df["c_in"] > 0])
    assert s["filters"][0]["removed_rows"] == int((df["c_in"] <= 0).sum())


def test_zscore_normalization_matches_a_float64_reference(tmp_path):
    df = table(4000, seed=3)
    df["neg_d_l"] = (df["neg_d_l"] * 50 - 300).astype(np.float32)  # very different units
    write_scores(df, tmp_path / "run", parts=3, row_group_size=500)
    select_subset(
        SelectRequest(
            scores=tmp_path / "run", out=tmp_path / "z.npy", top_k=400, normalize="zscore", progress=False
        )
    )
    z = pd.DataFrame({"uid": df["uid"]})
    for m in METRICS:
        x = df[m].to_numpy(np.float64)
        z[m] = (x - x.mean()) / x.std()
    assert array_to_uids(load_subset(tmp_path / "z.npy")) == reference_top(z, ALL, 400)


def test_rank_normalization_uses_pool_mid_ranks(tmp_path):
    df = table(3000, seed=4)
    rng = np.random.default_rng(4)
    for m in METRICS:  # well-separated distinct values (ties included) so that the 22-bit keys are exact
        df[m] = (rng.integers(1, 90, len(df)) * 0.25).astype(np.float32)
    write_scores(df, tmp_path / "run", parts=2, row_group_size=700)
    select_subset(
        SelectRequest(
            scores=tmp_path / "run",
            out=tmp_path / "r.npy",
            top_k=300,
            normalize="rank",
            weights="eps_i=1,eps_t=2,cos_theta=1",
            progress=False,
        )
    )
    r = pd.DataFrame({"uid": df["uid"]})
    for m in METRICS:
        r[m] = (df[m].rank(method="average").to_numpy() - 0.5) / len(df)
    assert array_to_uids(load_subset(tmp_path / "r.npy")) == reference_top(
        r, {"eps_i": 1, "eps_t": 2, "cos_theta": 1}, 300
    )


@pytest.mark.parametrize("layout", ["npy", "memmap"])
def test_intersect_and_union_with_external_subsets(world, tmp_path, layout):
    from hype.data.uids import save_subset

    # Either layout DataComp's README allows: np.save, or raw memmap records (no .npy header).
    save = save_subset if layout == "npy" else save_memmap_subset
    df = world["df"]
    dfn = list(df["uid"].iloc[::3]) + ["f" * 32, "e" * 32]  # a third of the pool plus two unknown uids
    save(tmp_path / "dfn.npy", dfn)
    s = select_subset(
        SelectRequest(
            scores=world["run"],
            out=tmp_path / "i.npy",
            top_k=50,
            intersect=[str(tmp_path / "dfn.npy")],
            progress=False,
        )
    )
    inside = df[df["uid"].isin(dfn)]
    assert array_to_uids(load_subset(tmp_path / "i.npy")) == reference_top(inside, ALL, 50)
    assert s["eligible_rows"] == len(inside)

    extra = ["0" * 32, "0" * 32, reference_top(df, ALL, 1)[0]]  # a repeated unscored uid and a selected one
    save(tmp_path / "extra.npy", extra)
    s = select_subset(
        SelectRequest(
            scores=world["run"],
            out=tmp_path / "u.npy",
            top_k=20,
            union=[str(tmp_path / "extra.npy")],
            progress=False,
        )
    )
    got = array_to_uids(load_subset(tmp_path / "u.npy"))
    assert got == sorted(reference_top(df, ALL, 20) + ["0" * 32, "0" * 32])
    assert s["union"][0]["added_rows"] == 2 and s["union"][0]["already_selected"] == 1
    assert s["subset_rows"] == 22 and s["selected_rows"] == 20


def test_frac_of_eligible_and_too_few_eligible(world, tmp_path):
    n_el = int((world["df"]["c_in"] > 0).sum())
    s = select_subset(
        SelectRequest(
            scores=world["run"],
            out=tmp_path / "e.npy",
            frac=0.5,
            frac_of="eligible",
            filters=["image_cluster"],
            progress=False,
        )
    )
    assert s["selected_rows"] == int(np.floor(0.5 * n_el + 0.5))
    with pytest.raises(SelectError, match="--frac-of eligible"):
        select_subset(
            SelectRequest(
                scores=world["run"],
                out=tmp_path / "e.npy",
                frac=0.9,
                filters=["image_cluster"],
                progress=False,
            )
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frac": 0}, r"--frac 0.0 is outside \(0, 1\]"),
        ({"frac": 1.5}, r"outside \(0, 1\]"),
        ({"frac": "abc"}, "not a number"),
        ({"frac": 0.0001}, "rounds to 0 samples"),
        ({"frac": 0.2, "top_k": 3}, "exactly one of"),
        ({}, "exactly one of"),
        ({"frac": 0.2, "weights": "eps_x=1"}, "unknown metric 'eps_x'"),
        ({"frac": 0.2, "weights": "eps_i=0"}, "every weight is 0"),
        ({"frac": 0.2, "weights": "eps_i"}, "not METRIC=WEIGHT"),
        ({"frac": 0.2, "preset": "nope"}, "no such preset"),
        ({"frac": 0.2, "filters": ["basic:min_sid=3"]}, "unknown parameter 'min_sid'"),
        ({"frac": 0.2, "filters": ["hype"]}, "not a filter"),
        ({"frac": 0.2, "rank": "basic"}, "not a ranking rule"),
        (
            {"frac": 0.2, "seed": 3},
            r"--seed applies to ranking rules that take a seed \(random\), not 'hype'",
        ),
        (
            {"frac": 0.2, "rank": "random", "weights": "eps_i=1"},
            r"--weights applies to ranking rules that take weights \(hype, combine\), not 'random'; "
            r"drop --weights",
        ),
        (
            {"frac": 0.2, "rank": "random:seed=2", "normalize": "zscore"},
            r"take a normalization \(hype, clip_score, specificity, combine\), not 'random'",
        ),
        ({"frac": 0.2, "rank": "nope", "seed": 3}, "unknown rule 'nope'"),
        ({"threshold": 1e9}, "empty selection"),
    ],
)
def test_bad_requests_say_what_to_fix(world, tmp_path, kwargs, message):
    with pytest.raises(SelectError, match=message):
        select_subset(SelectRequest(scores=world["run"], out=tmp_path / "x.npy", progress=False, **kwargs))


def test_bad_tables_say_what_to_fix(tmp_path):
    with pytest.raises(SelectError, match="no such run directory"):
        select_subset(SelectRequest(scores=tmp_path / "nope", out=tmp_path / "x.npy", frac=0.2))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SelectError, match="no scores found.*hype score"):
        select_subset(SelectRequest(scores=tmp_path / "empty", out=tmp_path / "x.npy", frac=0.2))

    df = table(50, seed=5)
    write_scores(df.drop(columns=["eps_t"]).assign(eps_t=np.float32(0)), tmp_path / "ok", parts=1)
    df_missing = df.copy()
    df_missing.loc[7, "cos_theta"] = np.nan
    write_scores(df_missing, tmp_path / "nan", parts=1)
    with pytest.raises(SelectError, match=f"'cos_theta' has 1 NaN.*uid {df.uid[7]}"):
        select_subset(
            SelectRequest(scores=tmp_path / "nan", out=tmp_path / "x.npy", frac=0.2, progress=False)
        )
    # The NaN column is not read when its weight is 0.
    select_subset(
        SelectRequest(
            scores=tmp_path / "nan", out=tmp_path / "x.npy", frac=0.2, weights="eps_i=1", progress=False
        )
    )

    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "cols" / "scores").mkdir(parents=True)
    pq.write_table(
        pa.table({"uid": df["uid"], "eps_i": df["eps_i"]}), tmp_path / "cols" / "scores" / "part-0.parquet"
    )
    with pytest.raises(
        SelectError, match=r"part-0.parquet: missing column\(s\) eps_t, neg_d_l, cos_theta, c_in"
    ):
        select_subset(
            SelectRequest(scores=tmp_path / "cols", out=tmp_path / "x.npy", frac=0.2, progress=False)
        )

    dup = pd.concat([df, df.iloc[:1]])
    write_scores(dup, tmp_path / "dup", parts=2)
    with pytest.raises(SelectError, match="appears more than once"):
        select_subset(
            SelectRequest(scores=tmp_path / "dup", out=tmp_path / "x.npy", top_k=51, progress=False)
        )
    bad = df.copy()
    bad.loc[3, "uid"] = "XYZ"
    bad.loc[3, "eps_i"] = 100.0  # uids are decoded (and checked) for the rows a selection keeps
    write_scores(bad, tmp_path / "baduid", parts=1)
    with pytest.raises(SelectError, match="malformed uid 'XYZ'"):
        select_subset(
            SelectRequest(scores=tmp_path / "baduid", out=tmp_path / "x.npy", frac=0.2, progress=False)
        )
    with pytest.raises(SelectError, match="must end in .npy"):
        select_subset(SelectRequest(scores=tmp_path / "ok", out=tmp_path / "x.txt", frac=0.2, progress=False))


def test_runs_hype_score_has_not_finished(tmp_path):
    df = table(40, seed=6)
    run = write_scores(df, tmp_path / "run", parts=1)
    (run / "summary.json").write_text(json.dumps({"status": "running"}))
    with pytest.raises(SelectError, match="still running"):
        select_subset(SelectRequest(scores=run, out=tmp_path / "x.npy", frac=0.5, progress=False))
    (run / "summary.json").write_text(
        json.dumps({"status": "failed", "shards": {"failed": [{"shard": "a"}]}})
    )
    with pytest.raises(SelectError, match=r"failed \(summary.json status 'failed': 1 shard\(s\) failed\)"):
        select_subset(SelectRequest(scores=run, out=tmp_path / "x.npy", frac=0.5, progress=False))
    assert not (tmp_path / "x.npy").exists()


def test_cli_reports_errors_without_a_traceback(world, tmp_path):
    res = CliRunner().invoke(
        main, ["select", "--scores", str(world["run"]), "--frac", "2", "--out", str(tmp_path / "x.npy")]
    )
    assert res.exit_code == 2 and "outside (0, 1]" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x.npy").exists()


def test_a_rule_from_another_package_takes_select_options(world, tmp_path):
    """A ranking rule registered outside `filters` (here, in this test) that names `seed` in its OPTIONS gets
    `--seed` and names itself in the printed summary: selection knows no rule by name."""
    from hype.select.rules import RULES, Rule

    class Nearest(Rule):
        name = "nearest_eps_i"
        kind = "score"
        summary = "rows whose eps_i is nearest the seed first"
        PARAMS = {"seed": (int, 0, "the eps_i wanted")}
        OPTIONS = ("seed",)

        def columns(self) -> list[str]:
            return ["eps_i"]

        def score(self, batch) -> np.ndarray:
            return -np.abs(batch.numeric("eps_i") - self.params["seed"])

        @classmethod
        def headline(cls, record) -> str:
            return f"{record['rule']} (eps_i nearest {record['seed']})"

    RULES.register(Nearest)
    try:
        out = tmp_path / "n.npy"
        text = run_cli(
            "--scores", str(world["run"]), "--rank", "nearest_eps_i", "--seed", "1", "--top-k", "9",
            "--out", str(out),
        )  # fmt: skip
        assert "ranked by nearest_eps_i (eps_i nearest 1)" in text
        df = world["df"]
        want = df.assign(d=(df["eps_i"].astype(np.float64) - 1).abs()).sort_values(["d", "uid"])["uid"]
        assert array_to_uids(load_subset(out)) == sorted(want[:9])
        summary = json.loads((tmp_path / "n.json").read_text())
        assert summary["rank"] == {"rule": "nearest_eps_i", "seed": 1}
        with pytest.raises(SelectError, match=r"take a seed \(random, nearest_eps_i\), not 'clip_score'"):
            select_subset(
                SelectRequest(
                    scores=world["run"], out=out, frac=0.2, rank="clip_score", seed=1, progress=False
                )
            )
    finally:
        RULES._items.pop("nearest_eps_i")


def test_the_audit_says_which_groups_were_too_small_to_judge_and_what_they_lost(world, tmp_path):
    """Groups under MIN_ROWS are not flagged one by one; the audit names them and what they lost together
    (they were dropped without a word: six language groups, 78 rows, all at 0%)."""
    from hype.select.audit import MIN_ROWS

    df = world["df"].copy()
    odd = df.index[:7]  # seven images of unknown size, all scored low: the cut keeps none of them
    df.loc[odd, ["width", "height"]] = 0
    df.loc[odd, "cos_theta"] = -5.0
    run = write_scores(df, tmp_path / "run", parts=2, row_group_size=100)
    out = tmp_path / "s.npy"
    text = run_cli("--scores", str(run), "--frac", "0.2", "--out", str(out), "--audit")
    size = json.loads(out.with_suffix(".json").read_text())["audit"]["size"]
    assert size["groups"]["unknown"] == {"rows": 7, "kept": 0, "kept_frac": 0.0}
    small = {g: v for g, v in size["groups"].items() if v["rows"] < MIN_ROWS}
    rows, kept = sum(v["rows"] for v in small.values()), sum(v["kept"] for v in small.values())
    assert size["too_small"] == {
        "min_rows": MIN_ROWS,
        "count": len(small),
        "groups": list(small),
        "rows": rows,
        "kept": kept,
        "dropped_frac": round(1 - kept / rows, 6),
    }
    assert not any("unknown" in f for f in size["flags"])  # too small to flag alone
    assert f"too small to judge (< {MIN_ROWS} rows each): {len(small)} group(s) (" in text
    assert f"{kept:,} of {rows:,} rows kept, {100 * (1 - kept / rows):.1f}% dropped" in text


def test_select_help_lists_every_registered_rule():
    """--rank and --filter list the rules of the plug-in registry, a plug-in's own included (the help was a
    hand-written list without dedup and decontaminate)."""
    from hype.select.rules import RULES, Rule, rule_names

    RULES.register(type("Watermark", (Rule,), {"name": "no_watermark", "kind": "mask"}))
    try:
        res = CliRunner().invoke(main, ["select", "--help"], terminal_width=100)
        text = " ".join(res.output.split())
        for kind, option in (("score", "--rank"), ("mask", "--filter")):
            names = rule_names(kind)
            assert f"Registered: {', '.join(names)}." in text.split(option + " ", 1)[1], (kind, text)
        assert set(RULES.names()) >= {"dedup", "decontaminate", "no_watermark", "hype", "basic"}
    finally:
        RULES._items.pop("no_watermark")


def test_a_rule_declares_only_options_it_can_take():
    from hype.select.rules import Rule

    with pytest.raises(TypeError, match=r"OPTIONS \['seed'\] must each be .* whose parameter is in PARAMS"):
        type("NoSeed", (Rule,), {"name": "no_seed", "kind": "score", "OPTIONS": ("seed",)})
    with pytest.raises(TypeError, match=r"OPTIONS \['temperature'\]"):
        type("Hot", (Rule,), {"PARAMS": {"temperature": (float, 1.0, "")}, "OPTIONS": ("temperature",)})
    seeded_mask = {"kind": "mask", "PARAMS": {"seed": (int, 0, "")}, "OPTIONS": ("seed",)}
    with pytest.raises(
        TypeError, match=r"OPTIONS \['seed'\] must each be a `hype select` option \(intersect\)"
    ):
        type("SeededMask", (Rule,), seeded_mask)


def test_a_recorded_selection_is_redone_with_its_rule_options(world, tmp_path):
    """`request_from_summary` (hype explain, hype report) passes back every option the ranking rule took,
    an explicit `--normalize none` over a preset's normalization included."""
    from hype.select.explain import request_from_summary

    preset = tmp_path / "zscore.yaml"
    preset.write_text("rank: hype\nnormalize: zscore\n")
    asked = [
        {"rank": "random", "seed": 7},
        {"preset": str(preset), "normalize": "none"},
        {"rank": "clip_score", "normalize": "rank"},
        {"weights": "eps_i=2,cos_theta=1"},
    ]
    for i, options in enumerate(asked):
        out = tmp_path / f"a{i}.npy"
        first = select_subset(SelectRequest(world["run"], out, frac=0.1, progress=False, **options))
        fields = request_from_summary(first)
        again = select_subset(SelectRequest(**fields, out=tmp_path / f"b{i}.npy", progress=False))
        assert again["rank"] == first["rank"], options
        assert load_subset(tmp_path / f"b{i}.npy").tolist() == load_subset(out).tolist()


def test_subset_json_is_written_by_the_run_contract(world, tmp_path):
    """subset.json is written as every marker is (`hype.io.runs.Marker`): UTF-8 text, state and fingerprint
    last (a folder with a non-ASCII name shows the difference from a hand-written summary)."""
    out = tmp_path / "sélection" / "s.npy"
    run_cli("--scores", str(world["run"]), "--frac", "0.2", "--out", str(out))
    text = out.with_suffix(".json").read_text(encoding="utf-8")
    marker = json.loads(text)
    assert list(marker)[-2:] == ["state", "fingerprint"] and "sélection" in text
    assert text == json_text(marker, sort_keys=False, ensure_ascii=False)


def test_a_rerun_of_the_same_selection_skips_and_a_changed_input_or_option_redoes_it(world, tmp_path):
    """Select on the run contract: subset.json is the marker; the same scores and options skip, another
    option or a rewritten scores part redo the selection."""
    out = tmp_path / "s.npy"
    first = run_cli("--scores", str(world["run"]), "--frac", "0.2", "--out", str(out))
    assert "already done" not in first
    marker = json.loads(out.with_suffix(".json").read_text())
    assert marker["state"] == "done" and len(marker["fingerprint"]) == 32
    stamp = out.stat().st_mtime_ns
    again = run_cli("--scores", str(world["run"]), "--frac", "0.2", "--out", str(out), "--workers", "1")
    assert "already done" in again and out.stat().st_mtime_ns == stamp  # --workers does not change outputs
    changed = run_cli("--scores", str(world["run"]), "--frac", "0.3", "--out", str(out))
    assert "already done" not in changed and len(load_subset(out)) == round(0.3 * len(world["df"]))
    run = tmp_path / "run"  # a copy of the scores whose part is rewritten (same bytes, new version)
    write_scores(world["df"], run, parts=3, row_group_size=97)
    run_cli("--scores", str(run), "--frac", "0.3", "--out", str(out))
    part = sorted((run / "scores").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes())
    assert "already done" not in run_cli("--scores", str(run), "--frac", "0.3", "--out", str(out))

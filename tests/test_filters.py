"""The rules of the `filters` package, each against an independent computation on a real scores table, and
how they are found (`hype.select.rules.RULES`, filled by the plug-ins themselves)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_select_helpers import write_scores

import hype.filters  # noqa: F401  (the bundled rules register themselves; the installed entry points may lag)
from hype.data.uids import save_subset
from hype.select import SelectError
from hype.select.rules import RULES, Rule, make_rule, parse_spec, rule_names
from hype.select.union import union
from hype.table.reader import ScoresTable
from hype.table.schema import METRICS
from hype.text.language import is_english

CAPTIONS = [
    "a large red circle on a white background",  # passes everything
    "two blue squares",  # 3 words, 16 chars: passes
    "red circle",  # 2 words: fails (DataComp wants > 2)
    "a b c",  # 5 characters: fails (> 5 needed)
    "un grand chat noir sur la table",  # French: fails the language rule
    "",
]


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    rng = np.random.default_rng(0)
    n = 600
    df = pd.DataFrame(
        {
            "uid": [f"{i * 7919 + 13:032x}" for i in range(n)],
            **{m: rng.normal(0, 1, n).astype(np.float32) for m in METRICS},
            "shard": ["s.tar"] * n,
            "key": [str(i) for i in range(n)],
            "text": [CAPTIONS[i % len(CAPTIONS)] for i in range(n)],
            "width": rng.integers(50, 700, n).astype(np.int32),
            "height": rng.integers(50, 700, n).astype(np.int32),
        }
    )
    df["c_in"] = np.where(rng.random(n) < 0.3, 10.0, 0.0).astype(np.float32)
    df.loc[5, ["width", "height"]] = [0, 0]  # unknown size
    run = write_scores(df, tmp_path_factory.mktemp("filters") / "run", parts=2, row_group_size=128)
    return df, ScoresTable(run)


def apply(rule: Rule, table: ScoresTable) -> np.ndarray:
    cols = list(dict.fromkeys(["uid", *rule.columns()]))
    if rule.needs_pool_pass:
        for b in table.iter_batches(cols, progress=None):
            rule.observe(b)
        rule.finish_observe()
    fn = rule.score if rule.kind == "score" else rule.mask
    return np.concatenate([fn(b) for b in table.iter_batches(cols, progress=None)])


def test_registry_lists_every_rule_with_its_kind():
    scores = {"hype", "clip_score", "specificity", "random", "combine", "negclip", "normsim", "dbp"}
    assert set(rule_names("score")) == scores
    assert set(rule_names("mask")) == {"image_cluster", "basic", "intersect", "decontaminate", "dedup"}
    for name, cls in RULES.items():
        assert cls.name == name and cls.kind in ("score", "mask") and cls.summary


def test_every_bundled_rule_is_a_declared_plug_in():
    """pyproject.toml's `hype.rules` entry points name each bundled rule's module, so an installed hype finds
    the rules without anyone importing `filters` (hype.plugins)."""
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"][RULES.group]
    bundled = {n: cls.__module__ for n, cls in RULES.items() if cls.__module__.startswith("hype.filters.")}
    assert declared == bundled


def test_weighted_sums(scored):
    df, table = scored
    x = {m: df[m].to_numpy(np.float64) for m in METRICS}
    np.testing.assert_array_equal(apply(make_rule("hype"), table), sum(x.values()))
    np.testing.assert_array_equal(apply(make_rule("clip_score"), table), x["cos_theta"])
    np.testing.assert_array_equal(apply(make_rule("specificity"), table), x["eps_i"] + x["eps_t"])
    got = apply(make_rule("hype", weights="eps_i=2,c_in=-0.5"), table)
    np.testing.assert_array_equal(got, 2 * x["eps_i"] + -0.5 * x["c_in"])


def test_one_hype_score_for_selection_and_the_quality_table(scored):
    """`hype_score` (paper Eq. 1) is what the `hype` rule ranks by and what the quality table measures;
    float32 columns give the sum of their exact float64 values."""
    from hype.scoring.quality import noise_auroc_table
    from hype.table.combine import hype_score, weighted_sum

    df, table = scored
    x32 = {m: df[m].to_numpy(np.float32) for m in METRICS}
    expected = sum(x.astype(np.float64) for x in x32.values())
    np.testing.assert_array_equal(hype_score(x32), expected)
    np.testing.assert_array_equal(
        hype_score({m: df[m].to_numpy() for m in METRICS}), apply(make_rule("hype"), table)
    )
    with pytest.raises(SelectError, match="every weight is 0"):
        weighted_sum(x32, {})
    labelled = df.assign(noise=np.where(np.arange(len(df)) % 3 == 0, "clean", "shuffled"))
    aurocs = noise_auroc_table(labelled)
    by_hand = noise_auroc_table(
        labelled.assign(eps_i=hype_score({m: df[m].to_numpy(np.float64) for m in METRICS}))
    )
    assert aurocs["hype"] == by_hand["eps_i"]


def test_image_cluster_is_c_in_positive(scored):
    df, table = scored
    np.testing.assert_array_equal(apply(make_rule("image_cluster"), table), df["c_in"].to_numpy() > 0)


def test_basic_filter_follows_datacomp_rules(scored):
    df, table = scored
    words = df["text"].str.split().str.len()
    short = np.minimum(df["width"], df["height"]).astype(float)
    long = np.maximum(df["width"], df["height"]).astype(float)
    expected = (
        is_english(list(df["text"]))
        & (words > 2).to_numpy()
        & (df["text"].str.len() > 5).to_numpy()
        & (short >= 200).to_numpy()
        & (long / short.where(short > 0) <= 3).to_numpy()
    )
    got = apply(make_rule("basic"), table)
    np.testing.assert_array_equal(got, expected)
    assert got.any() and not got.all() and not got[5]  # unknown size fails
    # Thresholds are parameters (the synthetic world's images are small).
    loose = apply(make_rule("basic:min_side=40,max_aspect=100,english=false"), table)
    np.testing.assert_array_equal(
        loose, (words > 2).to_numpy() & (df["text"].str.len() > 5).to_numpy() & (short >= 40).to_numpy()
    )


def test_random_is_seeded_uniform_and_order_free(scored, tmp_path):
    df, table = scored
    a = apply(make_rule("random"), table)
    b = apply(make_rule("random:seed=0"), table)
    c = apply(make_rule("random", seed=1), table)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert 0 <= a.min() and a.max() < 1 and abs(a.mean() - 0.5) < 0.05 and len(np.unique(a)) == len(a)
    # The same uid gets the same score whatever the table's order and partitioning.
    shuffled = df.sample(frac=1.0, random_state=3)
    other = ScoresTable(write_scores(shuffled, tmp_path / "shuffled", parts=5, row_group_size=50))
    got = pd.Series(apply(make_rule("random"), other), index=shuffled["uid"]).loc[df["uid"]]
    np.testing.assert_array_equal(got.to_numpy(), a)


def test_intersect_mask_and_union(scored, tmp_path):
    df, table = scored
    chosen = list(df["uid"].iloc[::4]) + ["f" * 32]
    save_subset(tmp_path / "dfn.npy", chosen + chosen[:3])  # duplicates are fine
    rule = make_rule(f"intersect:path={tmp_path / 'dfn.npy'}")
    np.testing.assert_array_equal(apply(rule, table), df["uid"].isin(chosen).to_numpy())

    import pyarrow as pa

    from hype.data.uids import arrow_to_pairs

    hi, lo = arrow_to_pairs(pa.array(sorted(df["uid"].iloc[:10])))
    mh, ml, info = union(hi, lo, tmp_path / "dfn.npy")
    merged = [f"{int(h):016x}{int(lo_):016x}" for h, lo_ in zip(mh, ml, strict=True)]
    expected = sorted([u for u in df["uid"].iloc[:10] if u not in chosen] + chosen + chosen[:3])
    assert merged == expected
    assert info["already_selected"] == sum(u in chosen for u in df["uid"].iloc[:10])


def test_specs_and_errors():
    assert parse_spec("basic:min_side=64, english=false") == ("basic", {"min_side": "64", "english": "false"})
    assert make_rule("basic:english=no").params["english"] is False
    assert make_rule("image-cluster").name == "image_cluster"
    assert make_rule("basic:min_side=64").spec() == "basic:min_side=64.0"
    for spec, message in [
        ("nope", "unknown rule 'nope'"),
        ("basic:min_side=big", "min_side='big' is not a valid float"),
        ("basic:english=maybe", "english='maybe' is not a valid bool"),
        ("random:seed=1.5", "rule .random.: seed=.1.5. is not a valid int"),
        ("basic:min_side", "is not KEY=VALUE"),
        ("hype:weights=eps_q=1", "unknown metric 'eps_q'"),
        ("intersect", "needs a file"),
    ]:
        with pytest.raises(SelectError, match=message):
            make_rule(spec)
    with pytest.raises(SelectError, match="not a filter"):
        make_rule("random", kind="mask")
    with pytest.raises(SelectError, match="not a ranking rule"):
        make_rule("basic", kind="score")

"""`negclip` (negCLIPLoss, Wang et al. NeurIPS 2024) against the paper's formula in float64, on a run's
scores table with embed tables beside it; the embed stage's opt-in `clip_txt` column it reads."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_select_helpers import write_scores

import hype.filters  # noqa: F401
from hype.scoring.embed_format import embed_schema, fixed_list
from hype.select import SelectError
from hype.select.rules import make_rule
from hype.table.reader import ScoresTable
from hype.table.schema import METRICS

N, D = 300, 24


def _unit(rng, n, d):
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _run(root, img, txt, uids, *, clip_txt=True, files=2, reverse=False):
    """A scores table of `uids` and RUN_DIR/embed/ tables of their embeddings (`files` shards)."""
    rng = np.random.default_rng(1)
    df = pd.DataFrame({"uid": uids, **{m: rng.normal(size=len(uids)).astype(np.float32) for m in METRICS}})
    df = df.assign(shard="s.tar", key=[str(i) for i in range(len(uids))], text="", width=1, height=1)
    df = df.astype({"width": np.int32, "height": np.int32})
    write_scores(df, root, parts=2, row_group_size=37)
    (root / "embed").mkdir()
    schema = embed_schema(4, D, 1.0, 0.1, clip_txt=clip_txt)
    for i, rows in enumerate(np.array_split(np.arange(len(uids)), files)):
        rows = rows[::-1] if reverse else rows
        n = len(rows)
        cols = {"uid": pa.array([uids[r] for r in rows]), "key": pa.array([str(r) for r in rows])}
        cols |= {"text": pa.array([""] * n), "width": pa.array([1] * n, pa.int32())}
        cols |= {"height": pa.array([1] * n, pa.int32())}
        cols |= {c: pa.array(np.zeros(n, np.float32)) for c in ("neg_d_l", "cos_theta")}
        cols |= {c: fixed_list(np.zeros((n, 4), np.float32)) for c in ("meru_img", "meru_txt")}
        cols |= {"clip_img": fixed_list(img[rows])} | (
            {"clip_txt": fixed_list(txt[rows])} if clip_txt else {}
        )
        pq.write_table(pa.Table.from_pydict(cols, schema=schema), root / "embed" / f"{i:05d}.parquet")
    return ScoresTable(root)


def _scores(table, rule="negclip", **params):
    rule = make_rule(rule, **params)
    rule.attach(table)
    cols = list(dict.fromkeys(["uid", *rule.columns()]))
    if rule.needs_pool_pass:
        for b in table.iter_batches(cols, progress=None):
            rule.observe(b)
        rule.finish_observe()
    uids = np.concatenate([b.texts("uid") for b in table.iter_batches(cols, progress=None)])
    vals = np.concatenate([rule.score(b) for b in table.iter_batches(cols, progress=None)])
    return dict(zip(uids, vals, strict=True))


def reference(img, txt, uids, tau, k, batch, seed):
    """The paper's definition: -τ × the mean over k random batches of the symmetric CLIP loss of pair i
    (cross-entropy of the softmax over its batch, image->text and text->image), float64; the batches are
    the seeded partitions of the pool in uid order."""
    order = np.argsort(uids, kind="stable")
    x, y = img[order].astype(np.float64), txt[order].astype(np.float64)
    loss = np.zeros(len(uids))
    for r in range(k):
        perm = np.random.default_rng([seed, r]).permutation(len(uids))
        for s in range(0, len(uids), batch):
            b = perm[s : s + batch]
            logits = x[b] @ y[b].T / tau
            p_i2t = np.exp(logits - logits.max(1, keepdims=True))
            p_i2t /= p_i2t.sum(1, keepdims=True)
            p_t2i = np.exp(logits - logits.max(0, keepdims=True))
            p_t2i /= p_t2i.sum(0, keepdims=True)
            loss[b] += -(np.log(np.diag(p_i2t)) + np.log(np.diag(p_t2i))) / 2
    out = -tau * loss / k
    return dict(zip(np.asarray(uids)[order], out, strict=True))


def test_negclip_is_the_papers_formula_and_order_free(tmp_path):
    rng = np.random.default_rng(0)
    img = _unit(rng, N, D)
    txt = _unit(rng, N, D) * 0.3 + img * 0.7  # aligned pairs, some closer than others
    txt /= np.linalg.norm(txt, axis=1, keepdims=True)
    uids = [f"{(i * 7919 + 13) % 100003:032x}" for i in range(N)]
    params = {"k": 3, "batch": 64, "temperature": 0.05, "seed": 4}
    got = _scores(_run(tmp_path / "a", img, txt, uids), **params)
    want = reference(img, txt, uids, 0.05, 3, 64, 4)
    np.testing.assert_allclose([got[u] for u in uids], [want[u] for u in uids], rtol=0, atol=2e-6)
    # other files, row order and row groups: the same bytes
    again = _scores(_run(tmp_path / "b", img, txt, uids, files=3, reverse=True), **params)
    assert all(again[u] == got[u] for u in uids)
    other = _scores(_run(tmp_path / "c", img, txt, uids), **{**params, "seed": 5})
    assert any(other[u] != got[u] for u in uids)  # the seed draws the batches


def test_negclip_without_clip_txt_names_the_rerun(tmp_path):
    rng = np.random.default_rng(0)
    img = _unit(rng, 20, D)
    table = _run(tmp_path / "r", img, img, [f"{i:032x}" for i in range(20)], clip_txt=False)
    with pytest.raises(SelectError, match=r"no clip_txt column.*embed\.clip_txt=true"):
        make_rule("negclip").attach(table)


def test_score_stores_clip_txt_only_when_asked_and_select_ranks_by_negclip(tmp_path_factory, tmp_path):
    """embed.clip_txt=true reruns embed with unit CLIP text embeddings whose cosine with clip_img is cos θ;
    the default run has no such column (its bytes are as before); `--rank negclip` selects from it."""
    import shutil

    from test_score_support import baseline, models, run_cli, score_args, world

    from hype.scoring.embed_format import read_embeddings
    from hype.select.run import SelectRequest, select_subset

    base = baseline(tmp_path_factory)
    assert all("clip_txt" not in pq.read_schema(f).names for f in (base / "embed").glob("*.parquet"))
    run = tmp_path / "run"
    shutil.copytree(base, run)
    meru, clip = models(tmp_path_factory)
    result = run_cli([*score_args(world(tmp_path_factory), meru, clip, run), "embed.clip_txt=true"])
    assert result.exit_code == 0, result.output
    f = sorted((run / "embed").glob("*.parquet"))[0]
    img, txt = read_embeddings(f, "clip_img"), read_embeddings(f, "clip_txt")
    cos = pq.read_table(f, columns=["cos_theta"]).column("cos_theta").to_numpy()
    np.testing.assert_allclose(np.linalg.norm(txt, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose((img.astype(np.float64) * txt).sum(1), cos, atol=1e-5)
    out = tmp_path / "s.npy"
    select_subset(SelectRequest(scores=run, out=out, frac=0.5, rank="negclip:batch=64,k=2", progress=False))
    assert out.exists()


def norm_sim_reference(img, target, p):
    """NormSim_p (the paper): the p-norm over the target set of the image's cosine with each target image."""
    t = target.astype(np.float64)
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    sims = img.astype(np.float64) @ t.T
    return np.sqrt((sims**2).sum(1)) if p == "2" else np.abs(sims).max(1)


@pytest.mark.parametrize("p", ["2", "inf"])
def test_normsim_is_the_papers_norm_over_a_streamed_target(tmp_path, p):
    rng = np.random.default_rng(2)
    img = _unit(rng, N, D)
    uids = [f"{i * 31 + 7:032x}" for i in range(N)]
    target = rng.normal(size=(5000, D)).astype(np.float32)  # two blocks, unnormalized
    (tmp_path / "t").mkdir()
    np.save(tmp_path / "t" / "a.npy", target[:3000])
    np.save(tmp_path / "t" / "b.npy", target[3000:])
    got = _scores(
        _run(tmp_path / "r", img, img, uids, clip_txt=False), "normsim", target=str(tmp_path / "t"), p=p
    )
    want = norm_sim_reference(img, target, p)
    np.testing.assert_allclose([got[u] for u in uids], want, rtol=1e-6, atol=1e-6)
    again = _scores(
        _run(tmp_path / "r2", img, img, uids, clip_txt=False, files=3, reverse=True),
        "normsim",
        target=str(tmp_path / "t"),
        p=p,
    )
    assert all(again[u] == got[u] for u in uids)


def test_normsim_refuses_the_evaluation_images_and_bad_targets(tmp_path):
    rng = np.random.default_rng(0)
    img = _unit(rng, 20, D)
    table = _run(tmp_path / "r", img, img, [f"{i:032x}" for i in range(20)], clip_txt=False)
    (tmp_path / "eval" / "feats").mkdir(parents=True)
    np.save(tmp_path / "eval" / "feats" / "f.npy", img)
    (tmp_path / "r" / "config.yaml").write_text(f"decontam:\n  eval_dir: {tmp_path / 'eval'}\n")
    with pytest.raises(SelectError, match="overlaps the run's evaluation images"):
        make_rule("normsim", target=str(tmp_path / "eval" / "feats")).attach(table)
    (tmp_path / "bad").mkdir()
    np.save(tmp_path / "bad" / "f.npy", img[:, :5])
    with pytest.raises(SelectError, match="not rows of the run's CLIP width 24"):
        make_rule("normsim", target=str(tmp_path / "bad")).attach(table)
    (tmp_path / "bad" / "f.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(SelectError, match="is not a .npy array"):
        make_rule("normsim", target=str(tmp_path / "bad")).attach(table)


def test_dbp_keeps_the_papers_cluster_quotas_and_the_inner_rules_best_inside(tmp_path):
    """DBP (Abbas et al. 2024): shares softmax(d_intra·d_inter/τ) computed here in float64 from the
    definitions, quotas N·P(c) capped at the cluster's size with the excess handed on (the paper's loop),
    and inside each cluster the inner rule's (cos θ's) best rows."""
    from hype.scoring.clusters import kmeans_centroids, nearest_centroid

    rng = np.random.default_rng(3)
    centers = _unit(rng, 4, D)
    spread = np.repeat([0.05, 0.2, 0.4, 0.8], 100)
    img = np.repeat(centers, 100, axis=0) + rng.normal(size=(400, D)).astype(np.float32) * spread[:, None] / 5
    img = (img / np.linalg.norm(img, axis=1, keepdims=True)).astype(np.float32)
    uids = [f"{(i * 7919 + 13) % 100003:032x}" for i in range(400)]
    table = _run(tmp_path / "r", img, img, uids, clip_txt=False)
    got = _scores(table, "dbp", inner="clip_score", clusters=4, neighbors=2, tau=0.02)
    # the reference, on rows in uid order (as the rule sees them)
    order = np.argsort(uids, kind="stable")
    x, su = img[order].astype(np.float64), np.asarray(uids)[order]
    label = nearest_centroid(img[order], kmeans_centroids(img[order], 4, backend="torch"), backend="torch")
    mu = np.stack([x[label == c].sum(0) for c in range(4)])
    mu /= np.linalg.norm(mu, axis=1, keepdims=True)
    d_intra = np.array([(1 - x[label == c] @ mu[c]).mean() for c in range(4)])
    cd = 1 - mu @ mu.T
    d_inter = np.array([np.sort(np.delete(cd[c], c))[:2].mean() for c in range(4)])
    share = np.exp(d_intra * d_inter / 0.02)
    share /= share.sum()
    size, quota, left, n = np.bincount(label, minlength=4), np.zeros(4), np.ones(4, bool), 120.0
    while True:  # the paper's quotas: cap at the size, hand the excess to the uncapped in proportion
        q = n * share * left / (share * left).sum()
        over = left & (q >= size - quota)
        if not over.any():
            quota[left] += q[left]
            break
        quota[over] = size[over]
        left &= ~over
        n = 120.0 - quota[~left].sum()
    keep = sorted(su, key=lambda u: -got[u])[:120]
    counts = np.bincount(label[np.searchsorted(su, keep)], minlength=4)
    assert np.abs(counts - quota).max() <= 1, (counts, quota)
    assert counts.max() > 2 * counts.min()  # the shares differ: the case tests the quotas
    scores = pd.read_parquet(tmp_path / "r" / "scores").set_index("uid")["cos_theta"]
    cos = dict(zip(uids, scores.loc[uids], strict=True))
    for c in range(4):  # inside each cluster: its best rows by cos θ
        members = su[label == c]
        best = sorted(members, key=lambda u: (-cos[u], u))[: counts[c]]
        assert set(best) == {u for u in keep if u in set(members)}


def _zscore(v):
    v = np.asarray(v, np.float64)
    return (v - v.mean()) / v.std()


def test_combine_sums_any_numeric_column_and_any_ranking_rule_zscored(tmp_path):
    """`combine` over a column a plug-in stage wrote (here `aesthetic`) and over a rule's score (negclip),
    each z-scored over the pool as the HYPE terms are; an unknown name lists what there is."""
    rng = np.random.default_rng(5)
    img = _unit(rng, N, D)
    txt = _unit(rng, N, D) * 0.5 + img
    txt /= np.linalg.norm(txt, axis=1, keepdims=True)
    uids = [f"{i * 131 + 5:032x}" for i in range(N)]
    table = _run(tmp_path / "r", img, txt, uids)
    for f in sorted((tmp_path / "r" / "scores").glob("*.parquet")):  # a plug-in stage's extra column
        t = pq.read_table(f)
        extra = pa.array(rng.normal(size=t.num_rows).astype(np.float32))
        pq.write_table(t.append_column("aesthetic", extra), f, row_group_size=37)
    table = ScoresTable(tmp_path / "r")
    got = _scores(table, "combine", weights="aesthetic=1,cos_theta=0.5,negclip=2", normalize="zscore")
    df = pd.read_parquet(tmp_path / "r" / "scores").set_index("uid").loc[uids]
    neg = reference(img, txt, uids, 0.01, 10, 32768, 0)
    want = _zscore(df["aesthetic"]) + 0.5 * _zscore(df["cos_theta"]) + 2 * _zscore([neg[u] for u in uids])
    # negclip's grid rounding (~1e-6 here), divided by its small pool std and weighted 2
    np.testing.assert_allclose([got[u] for u in uids], want, rtol=0, atol=5e-4)
    with pytest.raises(SelectError, match=r"'nope' is neither a numeric column .*aesthetic.*cos_theta"):
        make_rule("combine", weights="nope=1").attach(table)


def test_a_workflow_select_step_ranks_by_the_new_rules(tmp_path):
    """`hype run`: a select step names negclip/dbp like any rule (`rank:`), and selects what
    `hype select` does."""
    import yaml

    from hype.data.uids import array_to_uids, load_subset
    from hype.select.run import SelectRequest, select_subset
    from hype.workflow import load_workflow

    rng = np.random.default_rng(6)
    img = _unit(rng, 200, D)
    uids = [f"{i * 17 + 3:032x}" for i in range(200)]
    _run(tmp_path / "r", img, _unit(rng, 200, D), uids)
    rank = "dbp:inner=negclip:k=1,clusters=3"
    spec = {
        "name": "rules",
        "out": str(tmp_path / "wf"),
        "steps": [
            {
                "name": "pick",
                "run": "select",
                "args": {"scores": str(tmp_path / "r"), "rank": rank, "frac": 0.25},
            }
        ],
    }
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    wf = load_workflow(tmp_path / "w.yaml")
    assert [o.state for o in wf.run(echo=lambda _: None)] == ["ran"]
    select_subset(
        SelectRequest(scores=tmp_path / "r", out=tmp_path / "s.npy", frac=0.25, rank=rank, progress=False)
    )
    got = array_to_uids(load_subset(tmp_path / "wf" / "pick" / "subset.npy"))
    assert got == array_to_uids(load_subset(tmp_path / "s.npy")) and len(got) == 50

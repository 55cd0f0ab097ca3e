"""The rules that read a run's CLIP embeddings (negclip, normsim, dbp: `hype.filters.embeddings`) see the
pool the scores table holds: the embed outputs of the shards plan.json lists, one row per uid. A run
directory keeps the embed outputs of earlier generations (a pool moved and scored again into the same
--out, a rerun of fewer shards); the rules' values equal those of a clean run."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_negclip import D, _run, _scores, _unit
from test_score_support import baseline, models, run_cli, score_args, world

import hype.filters  # noqa: F401
from hype.select import SelectError
from hype.select.rules import make_rule
from hype.table.reader import ScoresTable


def _rescore(run, pool, tmp_path_factory) -> None:
    """`hype score` of `pool` into `run`, with the baseline's settings."""
    meru, clip = models(tmp_path_factory)
    args = score_args(world(tmp_path_factory), meru, clip, run)
    args[args.index("--pool") + 1] = str(pool)
    result = run_cli(args)
    assert result.exit_code == 0, result.output


def _values(run, target: str) -> dict:
    """normsim's and dbp's value of each uid on the run's scores table."""
    table = ScoresTable(run)
    return {
        "normsim": _scores(table, "normsim", p="2", target=target),
        "dbp": _scores(table, "dbp", inner="clip_score", clusters=3, neighbors=2),
    }


def test_embedding_rules_read_only_the_runs_shards_after_the_pool_moved_and_a_rerun_of_fewer(
    tmp_path_factory, tmp_path
):
    base = baseline(tmp_path_factory)
    dim = pq.read_schema(next((base / "embed").glob("*.parquet"))).field("clip_img").type.list_size
    np.save(tmp_path / "target.npy", np.random.default_rng(0).normal(size=(40, dim)).astype(np.float32))
    target = str(tmp_path / "target.npy")
    clean = _values(base, target)
    # The pool moved (copied elsewhere) and scored again into the same --out: the run grows by the new
    # paths' shards, whose rows are all duplicates of the old ones (dropped from the scores table).
    run = tmp_path / "run"
    shutil.copytree(base, run)
    moved = tmp_path / "moved" / "shards"
    shutil.copytree(world(tmp_path_factory) / "pool" / "shards", moved)
    _rescore(run, moved, tmp_path_factory)
    assert len(list((run / "embed").glob("*.parquet"))) == 2 * len(list((base / "embed").glob("*.parquet")))
    assert _values(run, target) == clean
    # A rerun of fewer shards: plan.json lists them, embed/ still holds the others' outputs.
    run = tmp_path / "fewer"
    shutil.copytree(base, run)
    tars = sorted((world(tmp_path_factory) / "pool" / "shards").glob("*.tar"))
    _rescore(run, "::".join(map(str, tars[:2])), tmp_path_factory)
    listed = {s["id"] for s in json.loads((run / "plan.json").read_text())["shards"]}
    assert len(listed) == 2 < len(list((run / "embed").glob("*.parquet")))
    alone = tmp_path / "alone"  # the same run without the stale outputs
    shutil.copytree(run, alone)
    for f in (alone / "embed").glob("*.parquet"):
        if f.stem not in listed:
            f.unlink()
    assert _values(run, target) == _values(alone, target)


def test_negclip_reads_the_planned_shards_once_per_uid(tmp_path):
    """negclip's random batches partition the pool: a stale output or a repeated shard would change them."""
    rng = np.random.default_rng(7)
    img = _unit(rng, 120, D)
    txt = _unit(rng, 120, D) * 0.4 + img
    txt /= np.linalg.norm(txt, axis=1, keepdims=True)
    uids = [f"{i * 97 + 11:032x}" for i in range(120)]
    params = {"k": 2, "batch": 16, "temperature": 0.05}
    clean = _scores(_run(tmp_path / "clean", img, txt, uids), **params)
    _run(tmp_path / "r", img, txt, uids)
    embed = tmp_path / "r" / "embed"
    shards = [
        {"index": i, "path": f"{f.stem}.tar", "id": f.stem} for i, f in enumerate(sorted(embed.iterdir()))
    ]
    shutil.copy(embed / "00000.parquet", embed / "00002.parquet")  # a repeated shard, listed
    shards.append({"index": 2, "path": "again/00000.tar", "id": "00002"})
    (tmp_path / "r" / "plan.json").write_text(json.dumps({"shards": shards}))
    (tmp_path / "r" / "summary.json").write_text(json.dumps({"status": "complete"}))
    shutil.copy(embed / "00001.parquet", embed / "00009.parquet")  # an earlier generation's, not listed
    assert _scores(ScoresTable(tmp_path / "r"), **params) == clean
    (embed / "00001.parquet").unlink()  # a listed shard's output lost: one line, the fix
    with pytest.raises(SelectError, match=r"cannot read .*00001.parquet, the embed output .* rescore"):
        make_rule("negclip").attach(ScoresTable(tmp_path / "r"))

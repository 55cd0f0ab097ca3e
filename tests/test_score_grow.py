"""Pools that grow (`hype.scoring.grow`): a complete run scores new shards against its frozen reference,
centroids and models, and equals a from-scratch run over all shards with the same frozen parts; a grow
that would not is refused; `hype select` reads several runs as one table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner
from test_score_support import digests, models, run_cli, score_args, world

from hype.cli import main

_CACHE: dict = {}


def _shards(w: Path) -> tuple[list[Path], list[Path]]:
    """The world's pool split into old shards (the first two tars) and new ones (the rest)."""
    tars = sorted((w / "pool" / "shards").glob("*.tar"))
    assert len(tars) >= 3
    return tars[:2], tars[2:]


def _score(out: Path, pool: str, *extra: str, ok: bool = True, tmp_path_factory=None):
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    args = score_args(w, meru, clip, out, *extra)
    args[args.index("--pool") + 1] = pool
    if "--class-features" in extra:  # instead of the class images
        i = args.index("--class-images")
        del args[i : i + 2]
    r = run_cli(args)
    if ok:
        assert r.exit_code == 0, r.output
    return r


def _spec(paths: list[Path]) -> str:
    return "::".join(str(p) for p in paths)


def _old_run(tmp_path_factory) -> Path:
    """A complete run over the old shards only (copy it before growing it)."""
    if "old" not in _CACHE:
        old, _ = _shards(world(tmp_path_factory))
        out = tmp_path_factory.mktemp("grow-old") / "run"
        _score(out, _spec(old), tmp_path_factory=tmp_path_factory)
        _CACHE["old"] = out
    return _CACHE["old"]


def _from_scratch(tmp_path_factory) -> Path:
    """All shards scored at once with the old run's reference sets and centroids (same class images)."""
    if "scratch" not in _CACHE:
        a = _old_run(tmp_path_factory)
        old, new = _shards(world(tmp_path_factory))
        out = tmp_path_factory.mktemp("grow-scratch") / "run"
        frozen = [
            "--reference",
            str(a / "reference.safetensors"),
            "--centroids",
            str(a / "clusters/centroids.npy"),
        ]
        _score(out, _spec(old + new), *frozen, tmp_path_factory=tmp_path_factory)
        _CACHE["scratch"] = out
    return _CACHE["scratch"]


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)  # copy2: data and modification times as they were
    return dest


def _rows(run: Path):
    return ds.dataset(run / "scores", format="parquet").to_table()


def _files(run: Path, stages: tuple[str, ...]) -> dict[str, tuple[int, str]]:
    out = {}
    for stage in stages:
        for p in sorted((run / stage).glob("*")):
            out[f"{stage}/{p.name}"] = (p.stat().st_mtime_ns, digests(p.parent, p.name)[p.name])
    return out


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


STAGES = ("embed", "classes", "specificity", "captions", "clusters", "reference", "scores", "merge")


def test_a_grown_run_equals_a_from_scratch_run_with_its_frozen_reference(tmp_path_factory, tmp_path):
    w = world(tmp_path_factory)
    old, new = _shards(w)
    a = _copy(_old_run(tmp_path_factory), tmp_path / "a")
    frozen = {p: (a / p).read_bytes() for p in ("reference.safetensors", "clusters/centroids.npy")}
    before = _files(a, STAGES)
    r = _score(a, _spec(new), tmp_path_factory=tmp_path_factory)  # --pool NEW_SHARDS

    s = _summary(a)
    # where the reference came from: frozen, the run's own file, first selected from the old shards' pool
    # (it said "selected from the pool", as if selected from this one)
    ref = s["reference"]
    assert (
        ref["frozen"] and ref["file"] == str(a / "reference.safetensors") and str(old[0]) in ref["first_pool"]
    )
    assert ref["digest"] == json.loads((a / "card.json").read_text())["reference"]
    line = next(x for x in r.output.splitlines() if x.strip().startswith("reference "))
    assert f"frozen as the pool grew: {a / 'reference.safetensors'}" in line, line
    assert f"first selected from {ref['first_pool']}: N=" in line, line
    assert s["status"] == "complete" and s["shards"]["total"] == len(old) + len(new)
    for stage in ("embed", "specificity", "clusters", "merge"):
        assert (s["stages"][stage]["shards_run"], s["stages"][stage]["shards_reused"]) == (len(new), len(old))
    assert "reference" not in s["stages"] or not s["stages"]["reference"].get("shards_run")
    assert {p: (a / p).read_bytes() for p in frozen} == frozen  # S_i/S_t and centroids as they were
    after = _files(a, STAGES)
    assert {k: after[k] for k in before} == before  # no old output rewritten, not even in place
    plan = json.loads((a / "plan.json").read_text())
    assert plan["frozen"] and [s["path"] for s in plan["shards"]] == [str(p) for p in old + new]

    b = _from_scratch(tmp_path_factory)
    assert _rows(a).equals(_rows(b))  # the scores table, bit for bit
    assert digests(a / "scores") == digests(b / "scores")  # even the part files' bytes
    card_a, card_b = (json.loads((r / "card.json").read_text()) for r in (a, b))
    assert {k: card_a[k] for k in ("models", "reference", "centroids", "targets")} == {
        k: card_b[k] for k in ("models", "reference", "centroids", "targets")
    }

    # Listing every shard now, or the new ones again, is a rerun of the grown run: nothing is redone.
    done = _files(a, STAGES)
    for pool in (str(w / "pool" / "shards"), _spec(new)):
        _score(a, pool, tmp_path_factory=tmp_path_factory)
        assert _files(a, STAGES) == done and _rows(a).equals(_rows(b))


def test_new_shards_repeating_old_uids_lose_them_and_old_parts_stay(tmp_path_factory, tmp_path):
    """Dedup runs over all shards with the earlier ones winning: a new shard that repeats old samples
    loses those rows, and the old parts (their drops unchanged) are not merged again."""
    old, _ = _shards(world(tmp_path_factory))
    a = _copy(_old_run(tmp_path_factory), tmp_path / "a")
    before = _files(a, STAGES)
    rows = _rows(a)
    again = tmp_path / "again" / old[0].name  # the same samples under another path: a new shard
    again.parent.mkdir()
    shutil.copy2(old[0], again)
    _score(a, str(again), tmp_path_factory=tmp_path_factory)
    s = _summary(a)
    assert s["samples"]["duplicates"] == s["samples"]["embedded"] - rows.num_rows > 0
    assert s["stages"]["merge"]["shards_run"] == 1 and _rows(a).equals(rows)
    after = _files(a, STAGES)
    assert {k: after[k] for k in before} == before


def test_a_failed_grow_resumes_against_the_frozen_reference(tmp_path_factory, tmp_path):
    """A grow that stops short (here: a new shard's output cannot be written) is resumed by the rerun
    with the frozen reference, not with one selected again from the larger pool."""
    from hype.scoring.rundir import shard_id

    _, new = _shards(world(tmp_path_factory))
    a = _copy(_old_run(tmp_path_factory), tmp_path / "a")
    frozen = (a / "reference.safetensors").read_bytes()
    blocked = a / "specificity" / f"{shard_id(new[0])}.parquet"
    blocked.mkdir()  # every attempt fails
    r = _score(a, _spec(new), "executor.retries=0", ok=False, tmp_path_factory=tmp_path_factory)
    assert r.exit_code == 2 and _summary(a)["status"] == "failed", r.output
    blocked.rmdir()
    w = world(tmp_path_factory)
    _score(a, str(w / "pool" / "shards"), tmp_path_factory=tmp_path_factory)  # all shards, no new one now
    assert (a / "reference.safetensors").read_bytes() == frozen
    assert _summary(a)["stages"]["embed"]["shards_run"] == 0
    assert digests(a / "scores") == digests(_from_scratch(tmp_path_factory) / "scores")
    (a / "card.json").unlink()  # a grown run without its card: nothing says what is frozen any more
    r = _score(a, str(w / "pool" / "shards"), ok=False, tmp_path_factory=tmp_path_factory)
    assert r.exit_code != 0 and "card.json: missing" in r.output and "new --out" in r.output


def test_a_grow_with_other_frozen_parts_is_refused(tmp_path_factory, tmp_path):
    import torch

    from hype.checkpoint import save_checkpoint
    from hype.models import create_model
    from hype.scoring.reference import load_reference

    w = world(tmp_path_factory)
    old, new = _shards(w)
    a = _copy(_old_run(tmp_path_factory), tmp_path / "a")
    before = _files(a, STAGES)
    torch.manual_seed(1)
    other = tmp_path / "other-meru.safetensors"
    save_checkpoint(other, create_model("tiny-hyperbolic"))
    r = _score(a, _spec(new), "--meru", str(other), ok=False, tmp_path_factory=tmp_path_factory)
    assert r.exit_code != 0 and f"--meru {other}" in r.output and "card.json" in r.output
    assert "new --out" in r.output and str(models(tmp_path_factory)[0]) in r.output  # the fix: which model

    refs = load_reference(a / "reference.safetensors")
    refs.img.mul_(2)
    refs.save(tmp_path / "ref.safetensors")
    r = _score(
        a,
        _spec(new),
        "--reference",
        str(tmp_path / "ref.safetensors"),
        ok=False,
        tmp_path_factory=tmp_path_factory,
    )
    assert r.exit_code != 0 and "not the run's frozen reference" in r.output

    np.save(tmp_path / "c.npy", np.load(a / "clusters" / "centroids.npy")[::-1].copy())
    r = _score(
        a, _spec(new), "--centroids", str(tmp_path / "c.npy"), ok=False, tmp_path_factory=tmp_path_factory
    )
    assert r.exit_code != 0 and "not the run's frozen centroids" in r.output

    centroids = np.load(a / "clusters" / "centroids.npy")
    np.save(tmp_path / "classes.npy", centroids[:1])  # one class, nearest to centroid 0: targets [0]
    assert len(np.load(a / "clusters" / "targets.npy")) > 1
    r = _score(
        a,
        _spec(new),
        "--class-features",
        str(tmp_path / "classes.npy"),
        ok=False,
        tmp_path_factory=tmp_path_factory,
    )
    assert r.exit_code != 0 and "other c_IN targets than the run's frozen ones" in r.output

    r = _score(a, _spec([old[0], *new]), ok=False, tmp_path_factory=tmp_path_factory)
    assert r.exit_code != 0 and "leaves out 1 of its shards" in r.output and str(old[1]) in r.output

    (a / "reference.safetensors").write_bytes(b"x" + (a / "reference.safetensors").read_bytes()[1:])
    r = _score(a, _spec(new), ok=False, tmp_path_factory=tmp_path_factory)
    assert r.exit_code != 0 and "changed after it completed" in r.output
    changed = _files(a, STAGES)
    assert {k: changed[k] for k in before} == before  # nothing of the run was touched by the refusals
    assert not any(new[0].stem in k for k in changed)


def _select(*args: str) -> dict:
    r = CliRunner().invoke(main, ["select", *args, "--no-progress", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_select_over_several_runs_is_select_over_one_run_of_their_pools(tmp_path_factory, tmp_path):
    w = world(tmp_path_factory)
    old, new = _shards(w)
    a, b = _old_run(tmp_path_factory), _from_scratch(tmp_path_factory)
    c = tmp_path / "c"  # the new shards in a run of their own, with the old run's frozen parts
    frozen = [
        "--reference",
        str(a / "reference.safetensors"),
        "--centroids",
        str(a / "clusters/centroids.npy"),
    ]
    _score(c, _spec(new), *frozen, tmp_path_factory=tmp_path_factory)

    two = _select("--scores", str(a), "--scores", str(c), "--frac", "0.3", "--out", str(tmp_path / "two.npy"))
    one = _select("--scores", str(b), "--frac", "0.3", "--out", str(tmp_path / "one.npy"))
    assert np.array_equal(np.load(tmp_path / "two.npy"), np.load(tmp_path / "one.npy"))
    assert two["pool_rows"] == one["pool_rows"] and two["selected_rows"] == one["selected_rows"]
    assert two["scores"] == [str(a / "scores"), str(c / "scores")] and two["duplicates_across_runs"] == 0
    kept = ds.dataset(tmp_path / "two.parquet").to_table()
    assert kept.num_rows == two["selected_rows"] and kept.equals(
        ds.dataset(tmp_path / "one.parquet").to_table()
    )

    # A uid in several runs is counted and kept once: the same run twice is that run.
    twice = _select("--scores", str(a), "--scores", str(a), "--frac", "0.3", "--out", str(tmp_path / "t.npy"))
    alone = _select("--scores", str(a), "--frac", "0.3", "--out", str(tmp_path / "a.npy"))
    assert twice["duplicates_across_runs"] == alone["pool_rows"] and twice["pool_rows"] == alone["pool_rows"]
    assert np.array_equal(np.load(tmp_path / "t.npy"), np.load(tmp_path / "a.npy"))


@pytest.mark.parametrize("status", ["running", "failed"])
def test_select_refuses_several_runs_when_one_is_unfinished(tmp_path_factory, tmp_path, status):
    a = _old_run(tmp_path_factory)
    c = _copy(a, tmp_path / "c")
    s = _summary(c) | {"status": status}
    (c / "summary.json").write_text(json.dumps(s))
    r = CliRunner().invoke(
        main,
        ["select", "--scores", str(a), "--scores", str(c), "--frac", "0.3", "--out", str(tmp_path / "x.npy")],
    )
    assert r.exit_code != 0 and str(c) in r.output and status in r.output

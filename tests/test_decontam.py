"""Decontamination end to end: `hype score --decontaminate` on a pool with injected copies of evaluation
images (exact, JPEG re-encoded, resized, cropped by 10%: `hype.synth.contaminate`), then
`hype select --filter decontaminate`.

The world and the scorers are the score tests' (tests/test_score_support.py): the synthetic world's real
images, tiny randomly initialised MERU and CLIP. A random CLIP's image features of unrelated synthetic
scenes are nearly collinear (41 of the 50 clean samples have an evaluation image at cosine >= 0.98): CLIP
alone flags them (`--no-copy-check`), the pixel copy check (the default) rejects all but 1 and keeps every
copy (recall 1.0 >= 0.99). A new copy threshold redoes the matches only. bench/decontam.py measures
recall and false positives with the demo's trained CLIP, which sets the default thresholds.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_score_support import BASE_OVERRIDES, models, run_cli, world

import hype.filters  # noqa: F401  (registers the bundled rules for select without the CLI)
from hype.cli import main
from hype.data.uids import array_to_uids, load_subset
from hype.scoring.config import DecontamConfig
from hype.scoring.decontam import DecontamError
from hype.scoring.stage_decontam import eval_sets, task_name
from hype.synth.contaminate import KINDS, eval_images, write_copies

PER_TASK = 2  # evaluation images copied per task (x 4 kinds)
TEST_THRESHOLD = 0.98  # recorded by the run; the filter may ask for more
CLEAN_CLIP_ONLY_AT_LEAST = 30  # of the 50 clean samples, flagged by CLIP alone; measured 41
CLEAN_VERIFIED_AT_MOST = 3  # of the 50 clean samples, flagged after the copy check; measured 1


@pytest.fixture(scope="module")
def contaminated(tmp_path_factory):
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    root = tmp_path_factory.mktemp("decontam")
    chosen = []
    for s in eval_sets(str(w / "eval"))[0]:
        chosen += eval_images(s.shards)[:PER_TASK]
    truth = pd.DataFrame(write_copies(chosen, root / "copies" / "copies.tar"))
    truth["task"] = [task_name(shard.split("/test/")[0]) for shard in truth.eval_shard]
    args = [
        "--pool",
        f"{w / 'pool' / 'shards' / '00000000.tar'}::{root / 'copies'}",
        "--meru",
        str(meru),
        "--clip",
        str(clip),
        "--out",
        str(root / "run"),
        "--decontaminate",
        str(w / "eval"),
        f"decontam.threshold={TEST_THRESHOLD}",
        *BASE_OVERRIDES,
    ]
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    assert "decontam    " in result.output and "decontam/matches.parquet" in result.output
    return {"root": root, "run": root / "run", "truth": truth, "args": args, "world": w}


def _select(*args: str) -> str:
    res = CliRunner().invoke(main, ["select", *args, "--no-progress"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def test_every_kind_of_copy_is_found_and_clean_samples_are_counted(contaminated):
    run, truth = contaminated["run"], contaminated["truth"]
    m = pq.read_table(run / "decontam" / "matches.parquet").to_pandas()
    marker = json.loads((run / "decontam" / "matches.json").read_text())
    assert marker["threshold"] == TEST_THRESHOLD and (m.similarity >= TEST_THRESHOLD).all()
    assert set(marker["tasks"]) == set(truth.task) and len(marker["tasks"]) == 7
    assert all(t["eval_images"] == 10 for t in marker["tasks"].values())
    own = m.merge(truth, on=["uid", "task"], suffixes=("", "_src"))
    for kind in KINDS:
        copies = truth[truth.kind == kind]
        found = own[own.kind == kind].uid.nunique()
        assert found / len(copies) >= 0.99, (kind, found, len(copies))
    # Exact, re-encoded and resized copies: the match in the source's task is the source image itself.
    near = own[own.kind != "crop10"]
    assert (near.eval_key == near.eval_key_src).all() and (near.eval_shard == near.eval_shard_src).all()
    clean = m[~m.uid.isin(truth.uid)]
    assert clean.uid.nunique() <= CLEAN_VERIFIED_AT_MOST
    # Exact copies are cosine 1: at 0.99999 all of them are found and no clean sample is.
    strict = m[m.similarity >= 0.99999]
    assert set(truth[truth.kind == "exact"].uid) <= set(strict.uid)
    assert not set(strict.uid) & set(clean.uid)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["decontam"]["flagged_samples"] == m.uid.nunique()
    assert summary["decontam"]["eval_skipped"] == 0


def test_rerun_reuses_and_a_new_threshold_recomputes_only_the_matches(contaminated):
    run, args = contaminated["run"], contaminated["args"]
    before = (run / "decontam" / "matches.parquet").read_bytes()
    assert run_cli(args).exit_code == 0
    stages = json.loads((run / "summary.json").read_text())["stages"]
    assert stages["decontam_eval"]["shards_run"] == 0 and stages["decontam_eval"]["shards_reused"] == 7
    assert (run / "decontam" / "matches.parquet").read_bytes() == before
    stricter = [a if not a.startswith("decontam.threshold=") else "decontam.threshold=0.999" for a in args]
    assert run_cli(stricter).exit_code == 0
    stages = json.loads((run / "summary.json").read_text())["stages"]
    assert stages["decontam_eval"]["shards_run"] == 0 and stages["embed"]["shards_run"] == 0
    m = pq.read_table(run / "decontam" / "matches.parquet").to_pandas()
    assert json.loads((run / "decontam" / "matches.json").read_text())["threshold"] == 0.999
    assert (m.similarity >= 0.999).all()
    # A new copy threshold is a new fingerprint: only the matches are redone.
    assert run_cli([*args, "--copy-threshold", "0.999"]).exit_code == 0
    stages = json.loads((run / "summary.json").read_text())["stages"]
    assert stages["decontam_eval"]["shards_run"] == 0 and stages["embed"]["shards_run"] == 0
    marker = json.loads((run / "decontam" / "matches.json").read_text())
    m = pq.read_table(run / "decontam" / "matches.parquet").to_pandas()
    assert marker["copy_check"]["threshold"] == 0.999 and (m.copy_similarity >= 0.999).all()
    exact = contaminated["truth"].query("kind == 'exact'")  # a pixel-identical copy is similarity 1
    assert set(exact.uid) <= set(m.uid)
    assert run_cli(args).exit_code == 0  # back to the fixture's settings for the other tests
    assert (run / "decontam" / "matches.parquet").read_bytes() == before


def test_the_copy_check_in_blocks_of_any_size_gives_the_same_matches(contaminated, tmp_path, monkeypatch):
    """Candidates are checked in blocks of pool shards (each evaluation image's windows computed once per
    block); a block per image, or per pair, must give the same matches byte for byte."""
    from hype.scoring import stage_decontam

    run = contaminated["run"]
    before = (run / "decontam" / "matches.parquet").read_bytes()
    marker = json.loads((run / "decontam" / "matches.json").read_text())
    for limit in ("BLOCK_IMAGES", "BLOCK_PAIRS"):
        again = tmp_path / limit
        shutil.copytree(run, again, ignore=shutil.ignore_patterns("decontam"))
        args = [str(again) if a == str(run) else a for a in contaminated["args"]]
        with monkeypatch.context() as m:
            m.setattr(stage_decontam, limit, 1)
            assert run_cli(args).exit_code == 0
        assert (again / "decontam" / "matches.parquet").read_bytes() == before
        redone = json.loads((again / "decontam" / "matches.json").read_text())
        assert redone["copy_check"]["candidates_checked"] == marker["copy_check"]["candidates_checked"] > 0


def test_the_copy_check_rejects_clean_neighbours_that_clip_alone_flags(contaminated, tmp_path):
    run, truth = contaminated["run"], contaminated["truth"]
    verified = pq.read_table(run / "decontam" / "matches.parquet").to_pandas()
    marker = json.loads((run / "decontam" / "matches.json").read_text())
    threshold = DecontamConfig().copy_threshold  # the default
    assert marker["copy_check"]["threshold"] == threshold == 0.94 and marker["candidates"] == 30
    assert (verified.copy_similarity >= threshold).all()
    clip_only = tmp_path / "run"  # the same run, matched on CLIP features alone (as DataComp did)
    shutil.copytree(run, clip_only)
    args = [str(clip_only) if a == str(run) else a for a in contaminated["args"]]
    assert run_cli([*args, "--no-copy-check"]).exit_code == 0
    stages = json.loads((clip_only / "summary.json").read_text())["stages"]
    assert stages["embed"]["shards_run"] == 0 and stages["decontam_eval"]["shards_run"] == 0
    plain = pq.read_table(clip_only / "decontam" / "matches.parquet").to_pandas()
    assert json.loads((clip_only / "decontam" / "matches.json").read_text())["copy_check"] is None
    assert plain.copy_similarity.isna().all() and (plain.similarity >= TEST_THRESHOLD).all()
    for found in (verified, plain):  # every copy, in its source's task, either way
        own = found.merge(truth, on=["uid", "task"])
        assert own.groupby("kind").uid.nunique().to_dict() == truth.groupby("kind").uid.nunique().to_dict()
    clean_plain = set(plain.uid) - set(truth.uid)
    clean_verified = set(verified.uid) - set(truth.uid)
    assert len(clean_plain) >= CLEAN_CLIP_ONLY_AT_LEAST and len(clean_verified) <= CLEAN_VERIFIED_AT_MOST
    assert clean_verified <= clean_plain  # the check only removes candidates


def test_select_filter_drops_the_matches_and_reports_them_per_task(contaminated, tmp_path):
    run, truth = contaminated["run"], contaminated["truth"]
    m = pq.read_table(run / "decontam" / "matches.parquet").to_pandas()
    out = tmp_path / "keep.npy"
    _select("--scores", str(run), "--keep-all", "--filter", "decontaminate", "--out", str(out))
    kept = set(array_to_uids(load_subset(out)))
    assert not kept & set(m.uid) and len(kept) == 50 + len(truth) - m.uid.nunique()
    record = json.loads(out.with_suffix(".json").read_text())["filters"][0]
    per_task = m.groupby("task").uid.nunique().to_dict()
    assert record["rule"] == "decontaminate" and record["threshold"] == TEST_THRESHOLD
    assert record["matches"] == per_task and record["removed_rows"] == m.uid.nunique()
    assert record["would_have_leaked"] == per_task  # --keep-all: every flagged sample would have leaked

    exact = tmp_path / "exact.npy"
    _select(
        "--scores", str(run), "--keep-all", "--filter", "decontaminate:threshold=0.99999", "--out", str(exact)
    )
    dropped = set(truth.uid) | set(m.uid) - set(array_to_uids(load_subset(exact)))
    assert set(truth[truth.kind == "exact"].uid) <= dropped
    top = tmp_path / "top.npy"
    _select("--scores", str(run), "--top-k", "5", "--filter", "decontaminate", "--out", str(top))
    leaked = json.loads(top.with_suffix(".json").read_text())["filters"][0]["would_have_leaked"]
    assert sum(leaked.values()) <= sum(per_task.values()) and set(leaked) == set(per_task)


def test_select_refuses_a_threshold_below_the_recorded_one_and_an_undecontaminated_run(
    contaminated, tmp_path
):
    res = CliRunner().invoke(
        main,
        ["select", "--scores", str(contaminated["run"]), "--keep-all", "--out", str(tmp_path / "a.npy")]
        + ["--filter", "decontaminate:threshold=0.5", "--no-progress"],
    )
    assert res.exit_code != 0 and "recorded at cosine >= 0.98" in res.output
    plain = tmp_path / "plain"  # the same run without --decontaminate's outputs
    shutil.copytree(contaminated["run"], plain, ignore=shutil.ignore_patterns("decontam"))
    res = CliRunner().invoke(
        main,
        ["select", "--scores", str(plain), "--keep-all", "--out", str(tmp_path / "b.npy")]
        + ["--filter", "decontaminate", "--no-progress"],
    )
    assert res.exit_code != 0 and "--decontaminate EVAL_DIR" in res.output


def test_eval_sets_of_a_task_folder_a_webdataset_folder_and_bad_folders(contaminated, tmp_path):
    w = contaminated["world"]
    sets, empty = eval_sets(str(w / "eval"))
    assert [s.task for s in sets] == [
        "synth-background",
        "synth-color",
        "synth-count",
        "synth-objects",
        "synth-position",
        "synth-retrieval",
        "synth-shape",
    ]
    assert empty == [] and all(s.shards and all(p.endswith(".tar") for p in s.shards) for s in sets)
    # Any webdataset folder of images (no wds_* folders): one task named after it.
    one, _ = eval_sets(str(w / "eval" / "wds_synth-shape_test" / "test"))
    assert [s.task for s in one] == ["test"] and one[0].shards == sets[-1].shards
    with pytest.raises(DecontamError, match="no such folder"):
        eval_sets(str(tmp_path / "missing"))
    (tmp_path / "wds_x_test" / "test").mkdir(parents=True)
    with pytest.raises(DecontamError, match="no .tar shards"):
        eval_sets(str(tmp_path))


def test_matches_written_before_the_copy_check_still_read(tmp_path):
    """A run decontaminated on CLIP features alone by an older hype has no copy_similarity column: the
    filter and the report still read it (copy similarity null)."""
    import pyarrow as pa

    from hype.scoring.decontam import MATCH_SCHEMA, marker_path, matches_path, read_matches

    old = pa.schema([f for f in MATCH_SCHEMA if f.name != "copy_similarity"])
    row = {"uid": "0" * 32, "shard": "p.tar", "key": "k", "task": "t", "eval_shard": "e.tar", "eval_key": "e"}
    matches_path(tmp_path).parent.mkdir()
    pq.write_table(
        pa.table({**{k: [v] for k, v in row.items()}, "similarity": [0.97]}, old), matches_path(tmp_path)
    )
    marker_path(tmp_path).write_text(json.dumps({"threshold": 0.95}))
    found = read_matches(tmp_path, 0.96)
    assert found.table.num_rows == 1 and found.table.column("copy_similarity").null_count == 1
    assert read_matches(tmp_path, 0.98).table.num_rows == 0


def _tar(path, samples: list[tuple[str, str, bytes]]) -> None:
    """A webdataset tar of (key, extension, bytes) members, in this order."""
    import io
    import tarfile

    path.parent.mkdir(parents=True)
    with tarfile.open(path, "w") as tar:
        for key, ext, data in samples:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_repeated_eval_keys_are_each_checked_and_a_task_without_images_is_a_counted_skip(
    contaminated, tmp_path
):
    """An evaluation tar whose images all share one key: every image is checked on its own (the copies of
    each are found, not only of the last), and the marker and the summary count them; a task whose images
    all fail to decode is skipped with a warning naming it, not a traceback."""
    run, truth = contaminated["run"], contaminated["truth"]
    chosen = [
        im
        for s in eval_sets(str(contaminated["world"] / "eval"))[0]
        for im in eval_images(s.shards)[:PER_TASK]
    ]
    evals = tmp_path / "eval"
    _tar(evals / "wds_same_test" / "test" / "0.tar", [("x", ext, data) for _, _, data, ext in chosen])
    _tar(evals / "wds_broken_test" / "test" / "0.tar", [(f"b{i}", "jpg", b"not an image") for i in range(3)])
    again = tmp_path / "run"
    shutil.copytree(run, again, ignore=shutil.ignore_patterns("decontam*"))
    args = [str(again) if a == str(run) else a for a in contaminated["args"]]
    result = run_cli([*(str(evals) if a == str(contaminated["world"] / "eval") else a for a in args)])
    assert result.exit_code == 0, result.output
    assert "broken has no image that could be embedded (3 skipped" in result.output
    assert f"same: {len(chosen)} images share a key" in result.output
    marker = json.loads((again / "decontam" / "matches.json").read_text())
    assert marker["tasks_without_usable_images"] == {"broken": 3}
    assert (
        marker["tasks"]["same"]["repeated_keys"] == len(chosen)
        and marker["tasks"]["same"]["eval_skipped"] == 0
    )
    m = pq.read_table(again / "decontam" / "matches.parquet").to_pandas()
    assert set(m.task) == {"same"} and set(m.eval_key) == {"x"}
    exact = set(truth[truth.kind == "exact"].uid)
    assert exact <= set(m.uid) and len(exact) == len(chosen)  # was: the copies of the last image only


def test_the_defaults_match_every_copy_crops_included_to_its_own_source(contaminated, tmp_path):
    """All 70 evaluation images in one task: a 10% crop's source is then often beyond the CLIP's 3 nearest
    (the old default candidates; the tiny CLIP ranks a crop's source beyond its 3 nearest for ~25% of
    crops on the demo world, bench/RESULTS.md): the defaults still match every copy to its source."""
    chosen, names = [], {}
    for s in eval_sets(str(contaminated["world"] / "eval"))[0]:
        chosen += eval_images(s.shards)
    folder = tmp_path / "all"
    folder.mkdir()
    with tarfile.open(folder / "0.tar", "w") as tar:
        for n, (shard, key, data, ext) in enumerate(chosen):
            names[(shard, key)] = f"{n:04d}"
            info = tarfile.TarInfo(f"{n:04d}.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    run = tmp_path / "run"
    shutil.copytree(contaminated["run"], run)
    args = [str(run) if a == str(contaminated["run"]) else a for a in contaminated["args"]]
    args[args.index("--decontaminate") + 1] = str(folder)
    assert run_cli(args).exit_code == 0
    truth = contaminated["truth"]
    source = [names[k] for k in zip(truth.eval_shard, truth.eval_key, strict=True)]
    found = pq.read_table(run / "decontam" / "matches.parquet").to_pandas().set_index("uid").eval_key
    assert found.reindex(truth.uid).tolist() == source, truth.kind.tolist()

"""`hype plan` and `hype score --dry-run`: the pool's size from its shards, tars or metadata, the plan's
shape and units from a real probe on the tiny world, and a dry run that writes nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from click.testing import CliRunner
from test_score_support import (
    NEARDUP_OVERRIDES,
    POOL_SIZE,
    SHARD_SIZE,
    baseline,
    models,
    run_cli,
    score_args,
    world,
)

from hype.scoring.plan import (
    PlanError,
    energy_per_row,
    estimate,
    fit_linear,
    pool_size,
    probe_from_run,
    probe_shard_sizes,
)
from hype.scoring.stage_decontam import copy_check_seconds

PROBE = 60  # two shards of 30: the probe is a real run, kept small


def _tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def test_plan_has_every_stage_in_seconds_bytes_and_requests_and_extrapolates_the_shard_fit(
    tmp_path_factory, tmp_path, monkeypatch
):
    from hype.cli.plan import plan

    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the probe's folder lands here
    out = tmp_path / "never"
    extra = ["--decontaminate", str(w / "eval"), *NEARDUP_OVERRIDES]  # every stage of STAGES runs
    args = [*score_args(w, meru, clip, out, *extra), "--probe-samples", str(PROBE), "--json"]
    result = CliRunner().invoke(plan, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    p = json.loads(result.stdout)
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, the probe's folder deleted
    assert p["pool"]["samples"] == POOL_SIZE and p["pool"]["shards"] == POOL_SIZE // SHARD_SIZE
    assert p["probe"]["samples"] == PROBE and p["probe"]["shards"] == 3  # sized 15, 30, 15: two sizes
    assert p["device"] == "cpu" and p["executor"] == {"kind": "local", "workers": 1}
    stages = {r["stage"]: r for r in p["stages"]}
    assert {
        "start-up",
        "embed",
        "dedup",
        "reference cands",
        "reference select",
        "specificity",
        "classes",
    } <= set(stages)
    assert {"captions", "clusters train", "clusters assign", "merge", "card"} <= set(stages)
    assert {"decontam eval", "decontam search", "neardup split", "neardup groups"} <= set(stages)
    # every second of the probe is in one row (the decontam and neardup stages were left out before)
    measured = sum(r["probe_s"] for r in p["stages"] if r["stage"] not in ("start-up", "local start"))
    assert measured == pytest.approx(p["probe"]["seconds"], abs=0.05)
    for r in p["stages"]:
        assert 0 <= r["fixed_s"] <= r["estimate_s"] + 1e-6, r
        assert r["bytes"] >= 0 and all(isinstance(v, (int, float)) and v >= 0 for v in r["requests"].values())
    # a per-shard stage: its variable part is the fit's per-shard and per-sample costs over the pool's
    # shards and samples (one worker); a fixed one stays
    # (a fit of a stage this small can have a zero slope when the machine is loaded: the costs are clamped
    # at 0, never negative; only embed's per-sample cost is large enough to be sure of)
    assert stages["embed"]["per_sample_s"] > 0, stages["embed"]
    for name in ("embed", "specificity", "captions", "merge"):
        e = stages[name]
        assert e["per_sample_s"] >= 0 and e["per_shard_s"] >= 0, e
        assert e["estimate_s"] - e["fixed_s"] == pytest.approx(
            e["per_shard_s"] * p["pool"]["shards"] + e["per_sample_s"] * POOL_SIZE, rel=0.01, abs=2e-3
        )
    # every stage the run's summary.json times has its rows in the plan (what bench/plan_accuracy.py
    # compares), and no row estimates a stage the run does not have
    run_stages = {r["run_stage"] for r in p["stages"]}
    assert set(p["probe"]["stages"]) <= run_stages <= set(p["probe"]["stages"]) | {"other"}
    assert (
        stages["start-up"]["run_stage"] == "other" and stages["reference cands"]["run_stage"] == "reference"
    )
    assert stages["classes"]["estimate_s"] == stages["classes"]["probe_s"]
    # the decontamination search: loading the evaluation set (features, index, work images) is a fixed cost,
    # the copy check was timed apart (it was all scaled with the pool: 1.30x the measured time)
    search = stages["decontam search"]
    assert 0 < search["fixed_s"] <= search["probe_s"], search
    assert p["probe"]["copy_check"]["image_s"] > 0 and p["probe"]["copy_check"]["pair_s"] >= 0
    # specificity scales with M: the probe's reference is cut to its 60 samples, the run's is 80; the L_e
    # kernel was timed at both sizes (and at the run's N = 100)
    assert p["scaling"]["M"] == 80 and p["scaling"]["probe"]["M"] == PROBE
    assert set(p["probe"]["energy_s_per_row"]) == {"60", "80", "100"}  # M and N of probe and run
    assert p["probe"]["load"]["start"] is not None
    t = p["total"]
    assert t["seconds"] == pytest.approx(sum(r["estimate_s"] for r in p["stages"]), abs=0.1)
    assert t["output_bytes"] == sum(r["bytes"] for r in p["stages"]) > 0
    assert t["gpus"] == 0 and t["device_hours"] == 0 and t["cpu_core_hours"] > 0
    # a fresh run writes each per-shard output and its marker: embed's PUTs are 2 per shard
    assert stages["embed"]["requests"]["put"] == 2 * p["pool"]["shards"]
    assert t["requests"]["put"] == sum(r["requests"].get("put", 0) for r in p["stages"])


def test_the_plan_of_a_run_from_itself_writes_what_the_run_wrote(tmp_path_factory):
    """A plan whose probe is the whole pool (a finished run) estimates the run folder's bytes: every file
    it writes is in a row (reference/top_n.safetensors was left out: 0.80x)."""
    import yaml

    from hype.scoring.config import load_score_config

    run = baseline(tmp_path_factory)
    cfg = load_score_config(yaml.safe_load((run / "config.yaml").read_text()))
    size = pool_size(cfg.pool)
    summary = json.loads((run / "summary.json").read_text())
    probe = probe_from_run(run, summary, samples=size.total, shards=len(size.shards), workers=1)
    planned = estimate(cfg, size, probe)["total"]["output_bytes"]
    written = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
    # left out: the per-shard markers and the run's records (a few KB each, 6% of this tiny run, not more
    # as shards grow); before: 0.77
    assert 0.9 * written <= planned <= written, (planned, written)


def test_the_copy_check_grows_with_the_pool_images_not_with_the_evaluation_set():
    """The copy check windows every pool image with candidates and, per block, the evaluation images its
    pairs hit: at most all of them. A probe that hit all 1,000 evaluation images with 100 pool images: a pool
    twice as large windows 200 pool images and the same 1,000 (1.09x the time, not 2x); one that hit few of
    them grows nearly linearly; a pool past a block's BLOCK_IMAGES windows them again in each block."""
    from hype.scoring.stage_decontam import BLOCK_IMAGES

    cost = {"image_s": 1e-3, "pair_s": 0.0}
    probe = {"blocks": 1, "pool_images_windowed": 100, "eval_images_windowed": 1000}
    probe |= {"candidates_checked": 300, "check_seconds": 11.0}
    assert copy_check_seconds(probe, 1000, 2.0, cost) == pytest.approx(11.0 * 1200 / 1100)
    few = probe | {"eval_images_windowed": 10}
    assert copy_check_seconds(few, 1000, 2.0, cost) == pytest.approx(11.0 * (200 + 10 * 1.99) / 110, rel=1e-3)
    big = 4 * BLOCK_IMAGES / 100  # 4 blocks of pool images, each hitting every evaluation image
    assert copy_check_seconds(probe, 1000, big, cost) == pytest.approx(11.0 * (400 * big / 4 + 4000) / 1100)
    # a pair's cost counts as the timing says; an older marker without the counts scales the whole check
    assert copy_check_seconds(probe, 1000, 2.0, {"image_s": 1e-3, "pair_s": 1e-3}) == pytest.approx(
        11.0 * (1200 + 600) / 1400
    )
    assert copy_check_seconds({"check_seconds": 3.0}, 1000, 2.0, cost) == 6.0


def test_dry_run_prints_the_plan_writes_nothing_and_does_not_wait_for_the_lock(tmp_path_factory, tmp_path):
    """A dry run reads nothing of the run folder, so it plans next to a run that holds the lock."""
    from hype.scoring.rundir import RunDir

    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    run = tmp_path / "run"
    RunDir(run).create()
    (run / "summary.json").write_text('{"status": "running"}')
    with RunDir(run).lock():
        before = _tree(run)
        refused = run_cli(score_args(w, meru, clip, run))  # the lock is held: a real run is refused
        assert refused.exit_code != 0 and "is running on this run directory" in refused.output
        result = run_cli([*score_args(w, meru, clip, run), "--dry-run"])
        assert result.exit_code == 0, result.output
        assert _tree(run) == before
    assert "hype plan: 150 samples in 3 shards" in result.output
    assert "total:" in result.output and "bucket requests" in result.output


def test_sizes_from_shard_stats_tar_headers_and_metadata_agree(tmp_path_factory):
    w = world(tmp_path_factory)
    shards = str(w / "pool" / "shards")
    from_stats = pool_size(shards)
    from_tars = pool_size(shards, count_tars=True)
    with_meta = pool_size(shards, str(w / "pool" / "metadata"))
    assert from_stats.source == "shard stats" and from_tars.source == "tar members"
    assert from_stats.samples == from_tars.samples == [SHARD_SIZE] * (POOL_SIZE // SHARD_SIZE)
    assert with_meta.nominal == from_stats.total == POOL_SIZE and with_meta.metadata_files >= 1


def test_a_pool_without_sizes_names_the_file_and_the_fix(tmp_path_factory, tmp_path):
    w = world(tmp_path_factory)
    shutil.copy(w / "pool" / "shards" / "00000000.tar", tmp_path / "00000000.tar")
    with pytest.raises(PlanError) as e:
        pool_size(str(tmp_path))
    msg = str(e.value)
    assert str(tmp_path / "00000000_stats.json") in msg and "--metadata" in msg and "--count-tars" in msg
    assert pool_size(str(tmp_path), count_tars=True).samples == [SHARD_SIZE]  # the fix works
    meta = pool_size(str(tmp_path), str(w / "pool" / "metadata"))  # so does the other
    assert meta.source == "metadata" and meta.total == POOL_SIZE
    (tmp_path / "00000000.tar").write_bytes(b"not a tar" * 100)
    with pytest.raises(PlanError, match="00000000.tar: unreadable tar"):
        pool_size(str(tmp_path), count_tars=True)


def test_the_median_fit_recovers_fixed_and_per_unit_costs_from_timings_with_a_slow_moment():
    """Timings a + b x n of two sizes, one taken while the machine was busy (x 4): the fit finds a and b; a
    least-squares line or a plain seconds / samples rate would not."""
    a, b = 0.03, 0.002
    sizes = [128, 256, 128, 256, 128, 256, 128]
    t = [a + b * n for n in sizes]
    t[3] *= 4  # one shard in a slow moment
    fa, fb = fit_linear([float(n) for n in sizes], t)
    assert fa == pytest.approx(a, rel=1e-9) and fb == pytest.approx(b, rel=1e-9)
    assert sum(t) / sum(sizes) > 1.2 * (a / 192 + b)  # the old rate, pulled up by the slow shard
    # a cost that does not grow with M (the L_e kernel within one tile): the fit says so, M x 2 adds ~0
    energy = {1024: 1e-3, 2000: 1e-3}
    assert energy_per_row(energy, 2000) - energy_per_row(energy, 1024) == pytest.approx(0, abs=1e-12)
    grows = {1000: 0.5e-3 + 1000e-6, 4000: 0.5e-3 + 4000e-6}  # a + b M: extrapolated beyond the sizes
    assert energy_per_row(grows, 20000) == pytest.approx(0.5e-3 + 20000e-6)
    assert fit_linear([], []) == (0.0, 0.0) and fit_linear([100.0, 100.0], [1.0, 3.0]) == (0.0, 0.02)
    # costs never come out negative, even from timings that fall with size
    assert fit_linear([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])[1] == 0.0


def test_probe_shards_have_two_sizes_that_add_up():
    assert probe_shard_sizes(60, 3) == [15, 30, 15]
    for samples, shards in ((1024, 6), (1000, 4), (7, 5)):
        sizes = probe_shard_sizes(samples, shards)
        assert sum(sizes) == samples and len(set(sizes[:-1])) == (2 if shards > 2 else 1) and min(sizes) >= 1


def test_plan_sets_the_shared_core_policy_before_torch_loads(tmp_path):
    """OpenMP reads OMP_WAIT_POLICY when torch loads it: `hype plan` must set it (as `hype score` does)
    before anything imports torch, or the probe's threads spin against its decode processes and the probe
    runs ~2x slower than the run it plans (measured: 0.038 vs 0.018 s per sample, back to back)."""
    import subprocess
    import sys

    code = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
        return None
sys.meta_path.insert(0, Watch())
from click.testing import CliRunner
from hype.cli.plan import plan
res = CliRunner().invoke(plan, ["--config", "tiny"])
assert "--pool is required" in res.output, res.output
print(seen)
"""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['PASSIVE']"


def test_the_probes_start_up_imports_are_found_outside_the_checkout(tmp_path):
    """The probe times a fresh process importing the scoring stack: each module it names must be found from
    a folder outside the checkout (the plug-ins install as hype.pipelines, not as a top-level name)."""
    from hype.scoring.plan import STARTUP_MODULES

    find = "import importlib.util as u, sys; print(*(m for m in sys.argv[1:] if u.find_spec(m) is None))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", find, *STARTUP_MODULES], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "", (
        f"not found outside the checkout: {done.stdout}"
    )

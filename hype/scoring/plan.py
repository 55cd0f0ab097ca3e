"""`hype plan` / `hype score --dry-run`: what a scoring run will cost, before it runs.

The pool's size comes from its shards' img2dataset `<shard>_stats.json` (`successes`), else from their tar
member lists (headers only, `count_tars`), else from the `--metadata` parquet row counts (the nominal size:
samples that failed to download count). Then a short probe runs the real `run_score` on the actual
device, models and executor over the first `probe_samples` samples (copied into a temporary folder, with
the class set of the real run) and every stage is extrapolated with its own scaling:

    embed, captions, merge, dedup, reference selection (driver)   linear in samples
    reference candidates                                          samples x N (the top pairs)
    specificity                                                   samples x M (the reference sets)
    clusters: k-means training                                    K x training points (x niter)
    clusters: assignment                                          samples x K
    classes (class images), metadata index, card, Ray start-up    fixed: measured as they are
    decontam: evaluation images embedded, loaded                  fixed (the marker's eval_setup_seconds)
    decontam: the search                                          linear in samples
    decontam: the copy check (stage_decontam.copy_check_seconds)  images windowed: the pool's linear in
                                                                  samples, the evaluation's at most all
                                                                  of them per block
    neardup: pixels (partition=pixel), split, groups of clusters  linear in samples (groups of fixed rows)

The rows follow the stages the run takes, in its order (`hype.scoring.stages.STAGES` and the conditions
there); each stage's file gives its rows (its `plan` hook, on `_Estimate`'s three kinds of row: a per-shard
map, a driver step, a fixed cost), and this module names none of them.

A per-shard stage's probe time splits into its shards' own seconds (their markers) and the rest (workers
set up, models loaded, scheduled): the rest is a fixed cost. The shards' seconds are fitted as a + b x n
(a per shard, b per sample; `fit_linear`): the probe's shards have two sizes (alternately 1 and 2 parts)
and the fit is a median one (Theil-Sen), so a shard caught in a slow moment of a shared machine moves it
little. Each worker's first shard (lazy imports, decoder pools, first allocations) is left out of the fit,
its extra time counted as fixed; the scaled time is spread over the executor's concurrent workers.
The cost of the L_e kernel that reference candidates (x N) and specificity (x M) run is not all
proportional to N or M (tiles, per-call set-up): it is timed apart on the device at the probe's and the
run's sizes (up to `stage_reference.ENERGY_CALIBRATION_REFS`), fitted as a + b x M, and only the
difference between the two sizes is added to the probe's per-sample cost. k-means is timed apart at (up to
20,000 points of) the run's K and points; the copy check per image windowed and per pair, whose ratio
splits the probe's check time: each stage's `calibrate` (`Calibration`). The load average at the probe's
start and end is recorded: the estimate holds for that load. Nothing is written into the run folder; the
probe's folder is deleted.

Bucket requests: each stage's rows count them from the prices of `hype.scoring.pricing` (its docstring
says how each storage operation is priced, and what was measured).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hype.executor import usable_cpus
from hype.io import read_json, storage
from hype.scoring import stages
from hype.scoring.config import ScoreConfig
from hype.scoring.pricing import REQUEST_KINDS, ShardReads, add, run_requests, stage_requests

PROBE_SAMPLES = 1024
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


class PlanError(ValueError):
    """A pool whose size cannot be known, or a probe that cannot run; the message says what to do."""


# --- the pool's size ------------------------------------------------------------------------------


@dataclass
class PoolSize:
    shards: list[str]  # tar paths as given
    samples: list[int]  # per shard (the successes img2dataset recorded, or the tar's image members)
    tar_bytes: list[int]
    source: str  # "shard stats" | "tar members" | "metadata"
    nominal: int | None = None  # metadata rows (uids listed, downloaded or not)
    metadata_files: int = 0

    @property
    def total(self) -> int:
        return sum(self.samples)

    def to_dict(self) -> dict:
        return {
            "samples": self.total,
            "shards": len(self.shards),
            "tar_bytes": sum(self.tar_bytes),
            "source": self.source,
            "nominal": self.nominal,
            "metadata_files": self.metadata_files,
        }


def stats_path(tar: str) -> str:
    """img2dataset's `<shard>_stats.json` beside `<shard>.tar`."""
    return tar[: -len(".tar")] + "_stats.json" if tar.endswith(".tar") else tar + "_stats.json"


def count_tar_samples(tar: str) -> int:
    """Samples (keys with an image member) of a tar, from its headers only."""
    from hype.data.samples import SkipStats
    from hype.io.tar import index_samples

    problems = SkipStats()
    n = sum(1 for _, files in index_samples(tar, problems) if any(e in files for e in IMAGE_EXTS))
    if problems.counts:
        shown = "; ".join(m for msgs in problems.examples.values() for m in msgs[:1])
        raise PlanError(f"{tar}: unreadable tar ({shown}); re-download it or leave it out of --pool")
    return n


def metadata_rows(folder: str) -> tuple[int, int]:
    """(rows, files) of a DataComp metadata folder's <hash>.parquet files (footers only)."""
    import pyarrow.parquet as pq

    from hype.io import open_input
    from hype.scoring.metadata import MetadataError, metadata_files

    try:
        files = metadata_files(folder)
    except MetadataError as e:
        raise PlanError(str(e)) from None
    rows = 0
    for f in files:
        with open_input(f) as fh:
            rows += pq.ParquetFile(fh).metadata.num_rows
    return rows, len(files)


def pool_size(pool: str, metadata: str | None = None, *, count_tars: bool = False) -> PoolSize:
    """The pool's samples per shard, from the shards' stats (or tar headers with `count_tars`), else from
    `metadata`'s rows spread over the shards; a shard without either is an error naming it and the fix."""
    from hype.data.shards import ShardError, expand_shards

    try:
        paths = [str(p) for p in expand_shards(pool).paths]
    except ShardError as e:
        raise PlanError(str(e).replace("--data", "--pool")) from None
    sizes = [storage.size(p) for p in paths]
    nominal, files = metadata_rows(metadata) if metadata else (None, 0)
    counts: list[int] = []
    source = "tar members" if count_tars else "shard stats"
    for p in paths:
        if count_tars:
            counts.append(count_tar_samples(p))
            continue
        stats = read_json(stats_path(p))
        if stats is not None and isinstance(stats.get("successes"), int):
            counts.append(stats["successes"])
            continue
        if nominal is not None:  # the metadata's rows stand in for the shards' (an upper bound)
            share, extra = divmod(nominal, len(paths))
            counts = [share + (i < extra) for i in range(len(paths))]
            source = "metadata"
            break
        raise PlanError(
            f"{stats_path(p)}: missing or without `successes`, so the size of {p} is unknown; pass "
            "--metadata DIR (the pool's <hash>.parquet files), or --count-tars to count the tars' samples "
            "from their headers (reads every tar)"
        )
    return PoolSize(paths, counts, sizes, source, nominal, files)


# --- fitting a + b x n -------------------------------------------------------------------------------


def fit_linear(x: list[float], t: list[float]) -> tuple[float, float]:
    """(a, b) of t = a + b x, by medians (Theil-Sen: the median slope over pairs of distinct x, then the
    median intercept), so one timing taken in a slow moment barely moves it. Both are clamped at 0 (a cost
    does not shrink with size); with a single distinct x, b = median(t / x) and a = 0."""
    if not x:
        return 0.0, 0.0
    pairs = [
        (t[j] - t[i]) / (x[j] - x[i]) for i in range(len(x)) for j in range(i + 1, len(x)) if x[j] != x[i]
    ]
    if not pairs:
        return 0.0, max(0.0, _median([ti / xi for xi, ti in zip(x, t, strict=True) if xi]))
    b = max(0.0, _median(pairs))
    return max(0.0, _median([ti - b * xi for xi, ti in zip(x, t, strict=True)])), b


def _median(v: list[float]) -> float:
    v = sorted(v)
    if not v:
        return 0.0
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


def probe_shard_sizes(samples: int, shards: int) -> list[int]:
    """Samples per probe shard: alternately 1 and 2 parts of `samples`, so the per-shard fit sees two
    sizes."""
    weights = [1 + i % 2 for i in range(shards)]
    sizes = [max(1, samples * w // sum(weights)) for w in weights]
    sizes[-1] += max(0, samples - sum(sizes))
    return sizes


# --- the probe ------------------------------------------------------------------------------------


@dataclass
class Probe:
    samples: int
    shards: int
    workers: int  # concurrent workers of the executor (1 in process)
    executor_start_s: float
    startup_s: float  # a fresh `hype` process importing the scoring stack
    summary: dict
    stats: dict[str, list[dict]]  # stage -> the shards' markers
    markers: dict[str, dict]  # driver steps' markers, by the names the stages give them (`StageSpec.markers`)
    folder_bytes: dict[str, int]  # run-folder bytes per top-level entry
    device: str = "cpu"  # where the workers ran the models
    settings: dict = field(default_factory=dict)
    kmeans: dict | None = None  # k-means timed at (up to) the run's size: points, k, seconds
    energy: dict[int, float] = field(default_factory=dict)  # reference size -> seconds per pool row of L_e
    load: dict = field(default_factory=dict)  # 1-minute load average at the probe's start and end
    copy_check: dict | None = None  # the copy check timed apart: seconds per image windowed and per pair
    card_files: dict[str, int] = field(default_factory=dict)  # files the card digests -> their bytes


@dataclass(frozen=True)
class Calibration:
    """What a stage's `calibrate` hook times apart from (the probe's run folder, on the run's device) and
    records in `probe` (its field of the `Probe`)."""

    cfg: ScoreConfig
    samples: int  # the pool's
    probe: Probe
    run: Path  # the probe's run folder
    device: str


def _probe_pool(size: PoolSize, samples: int, shards: int, folder: Path) -> int:
    """Copies of the first samples of the pool's first shards (`probe_shard_sizes`) into `folder`."""
    from hype.data.samples import SkipStats
    from hype.io.tar import read_samples, write_tar

    folder.mkdir(parents=True)
    total = 0
    for i, (path, per) in enumerate(
        zip(size.shards[:shards], probe_shard_sizes(samples, shards), strict=False)
    ):
        members: list[tuple[str, bytes]] = []
        n = 0
        for key, files in read_samples(path, SkipStats()):
            if n >= per:
                break
            members += [(f"{key}.{ext}", data) for ext, data in files.items()]
            n += any(e in files for e in IMAGE_EXTS)
        write_tar(folder / f"{i:08d}.tar", members)
        total += n
    return total


_STARTUP: list[float] = []  # measured once per process
# What `hype score` imports before its first stage (the executors' plug-ins: `hype.pipelines`, importable
# from any folder once installed, not only from a checkout).
STARTUP_MODULES = (
    "torch",
    "open_clip",
    "pyarrow.parquet",
    "hype.scoring.runner",
    "hype.scoring.embed",
    "hype.pipelines",
)


def _startup_seconds() -> float:
    """A fresh process importing what `hype score` imports before its first stage."""
    if _STARTUP:
        return _STARTUP[0]
    code = "import " + ", ".join(STARTUP_MODULES)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    _STARTUP.append(time.perf_counter() - t0)
    return _STARTUP[0]


def _workers(executor) -> int:
    capacity = getattr(executor, "capacity", None)
    workers = int(getattr(executor, "workers", 1) or 0)
    if capacity is not None:  # Ray: the actors the cluster fits (or those asked for)
        return max(1, workers or capacity())
    return max(1, workers)


def _load() -> float | None:
    import os

    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def energy_per_row(energy: dict[int, float], refs: int) -> float:
    """Seconds per pool row of the L_e kernel against `refs` references: a + b x refs fitted to the timed
    sizes (0 when nothing was timed)."""
    if not energy:
        return 0.0
    a, b = fit_linear(list(map(float, energy)), list(energy.values()))
    return a + b * refs


def _device(executor, device: str) -> str:
    from hype.scoring.stagebase import resolve_device

    resolve = getattr(executor, "worker_device", None)
    return resolve_device(resolve(device) if resolve is not None else device)


def probe_from_run(run: Path, summary: dict, *, samples: int, shards: int, workers: int) -> Probe:
    """What the estimate takes from a finished run folder on local disk (the probe's): the shards' markers,
    the driver steps' markers, the bytes of each top-level entry and of the files the card digests.
    Timings beyond the summary's (k-means, the L_e kernel, start-up) are left empty."""
    from hype.scoring.rundir import RunDir

    stats = {
        d.name: [read_json(f) for f in sorted(d.glob("*_stats.json"))] for d in run.iterdir() if d.is_dir()
    }
    markers = {name: read_json(run / path) or {} for spec in stages.STAGES for name, path in spec.markers}
    folder_bytes = {
        p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
        for p in run.iterdir()
    }
    rd = RunDir(run)
    card_files = {
        p.name: p.stat().st_size for p in (rd.reference, rd.centroids, rd.targets, rd.config) if p.exists()
    }
    return Probe(
        samples=samples,
        shards=shards,
        workers=workers,
        executor_start_s=0.0,
        startup_s=0.0,
        summary=summary,
        stats=stats,
        markers=markers,
        folder_bytes=folder_bytes,
        card_files=card_files,
    )


def run_probe(
    cfg: ScoreConfig, size: PoolSize, samples: int = PROBE_SAMPLES, *, log: Callable[[str], None] = print
) -> Probe:
    """Score the first `samples` samples with `cfg`'s models, device and executor in a temporary folder
    (deleted after); the timings and outputs the estimate extrapolates from."""
    from hype.executor import make_executor
    from hype.scoring.runner import ScoreError, ScoreFailed, run_score

    if size.total == 0:
        raise PlanError(f"{cfg.pool}: the pool has no samples to probe")
    t0 = time.perf_counter()
    executor = make_executor(cfg)
    start_s = 0.0 if executor.in_process else time.perf_counter() - t0
    tmp = Path(tempfile.mkdtemp(prefix="hype-plan-"))
    try:
        workers = _workers(executor)
        device = _device(executor, cfg.device)
        # three shards per worker and four in all at least: each worker's first one is its warm-up, the
        # rest (of two sizes) fit a + b x n (`_shard_fit`); the larger size (2 of 1.5 parts) fits a shard
        per_shard = max(1, max(size.samples[:1] or [1]))
        want = max(4, 3 * workers, math.ceil(samples * 4 / (3 * per_shard)))
        shards = max(1, min(len(size.shards), want))
        load_start = _load()
        n = _probe_pool(size, min(samples, size.total), shards, tmp / "pool")
        rows = max(1, n)
        cc = cfg.clusters
        k = max(1, min(cc.num_clusters or 0, rows // 40) or rows // 40 or 1)
        probe_cfg = dataclasses.replace(
            cfg,
            pool=str(tmp / "pool"),
            out=str(tmp / "run"),
            progress=False,
            clusters=dataclasses.replace(cc, num_clusters=k if cc.centroids is None else None),
        )
        log(f"probing {n} samples in {shards} shard(s) on {cfg.executor.kind} ...")
        try:
            summary = run_score(probe_cfg, executor=executor, progress=False)
        except ScoreFailed as e:
            raise PlanError(f"the probe failed: {e}") from None
        except ScoreError as e:
            raise PlanError(str(e)) from None
        probe = probe_from_run(tmp / "run", summary, samples=n, shards=shards, workers=workers)
        for spec in stages.active(cfg):  # what the probe is too small to time, timed apart
            if spec.calibrate is not None:
                spec.calibrate(Calibration(cfg, size.total, probe, tmp / "run", device))
        return dataclasses.replace(
            probe,
            executor_start_s=start_s,
            startup_s=_startup_seconds(),
            settings={"num_clusters": k},
            device=device,
            load={"start": load_start, "end": _load()},
        )
    finally:
        executor.close()
        shutil.rmtree(tmp, ignore_errors=True)


# --- the estimate ---------------------------------------------------------------------------------


@dataclass
class Row:
    stage: str
    scales_with: str
    probe_s: float  # measured in the probe
    fixed_s: float  # part of the estimate that does not grow with the pool
    estimate_s: float  # for the whole pool, fixed included
    bytes: int = 0
    requests: dict = field(default_factory=dict)
    per_shard_s: float = 0.0  # a per-shard stage's fit for the run: seconds per shard (one worker)
    per_sample_s: float = 0.0  # and per sample (the run's N, M or K)
    run_stage: str = "other"  # the stage of the run's summary.json it estimates ("other": outside the stages)


def _stage_seconds(probe: Probe, name: str) -> float:
    return float((probe.summary.get("stages", {}).get(name) or {}).get("seconds", 0.0))


def _samples(stats: dict) -> int:
    return int((stats.get("counts") or {}).get("samples", 0) or (stats.get("output") or {}).get("rows", 0))


@dataclass
class ShardFit:
    """A per-shard stage in the probe: its shards' seconds as `per_shard` + `per_sample` x samples."""

    per_shard: float
    per_sample: float
    samples: int  # Σ over the probe's shards
    out_bytes: int
    shards: int

    def seconds(self, shards: float, samples: float) -> float:
        return shards * self.per_shard + samples * self.per_sample


def _shard_fit(probe: Probe, name: str) -> ShardFit:
    """`fit_linear` of one per-shard stage's shard seconds against their samples.

    Each worker's first shard pays for lazy imports, thread and decoder pools, the first allocations; that
    shard (the slowest per sample of each worker) is left out of the fit and its extra time counts as
    fixed. A worker that ran one shard only gives no steady shard; if none did, all count."""
    st = [s for s in probe.stats.get(name, []) if s]
    by_worker: dict = {}
    for s in st:
        by_worker.setdefault((s.get("worker") or {}).get("pid"), []).append(s)
    steady = []
    for shards in by_worker.values():
        if len(shards) > 1:
            warm = max(shards, key=lambda s: float(s.get("seconds", 0.0)) / max(1, _samples(s)))
            steady += [s for s in shards if s is not warm]
    steady = steady or st
    a, b = fit_linear([float(_samples(s)) for s in steady], [float(s.get("seconds", 0.0)) for s in steady])
    out = sum(int((s.get("output") or {}).get("bytes", 0)) for s in st)
    return ShardFit(a, b, sum(_samples(s) for s in st), out, len(st))


class _Estimate:
    """The rows of a plan: the probe's timings, bytes and requests scaled to the pool, stage by stage."""

    def __init__(self, cfg: ScoreConfig, size: PoolSize, probe: Probe):
        self.cfg, self.probe = cfg, probe
        self.N, self.S, n = size.total, len(size.shards), max(1, probe.samples)
        self.W = probe.workers
        self.par = max(1, min(self.W, self.S))
        self.lin = self.N / n
        # The run's sizes that several stages' rows share (the plan's `scaling`), set by the stages that
        # know them (`stage_reference.plan`: N top pairs, M; `stage_clusters.plan_clusters`: K, points), _r
        # the run's, _p the probe's; `m_more`: extra L_e seconds per row at the run's M; `cl`: the probe's
        # k-means marker.
        self.top_p = self.m_p = self.top_r = self.m_r = 0
        self.k_p = self.k_r = self.pts_p = self.pts_r = 1
        self.m_more = 0.0
        self.cl: dict = {}
        self.tar_bytes = sum(size.tar_bytes) / max(1, self.S)
        self.embed_bytes = 0.0  # the embed output per shard, most stages' main input (`stage_embed.plan`)
        self.markers_of: dict[str, int] = {}  # a stage folder's markers in the run, where not one per shard
        self.rows: list[Row] = []

    def seconds(self, name: str) -> float:
        """A stage's seconds in the probe's summary."""
        return _stage_seconds(self.probe, name)

    def fit(self, name: str) -> ShardFit:
        """A per-shard stage's shard seconds in the probe, fitted (`_shard_fit`)."""
        return _shard_fit(self.probe, name)

    def energy_per_row(self, refs: int) -> float:
        """Seconds per pool row of the L_e kernel against `refs` references (`energy_per_row`)."""
        return energy_per_row(self.probe.energy, refs)

    def model_copies(self, models: int, tasks: int) -> dict:
        """Models fetched by a stage's workers on an executor whose workers copy them (`copies_models`: Ray's
        actors; none on the local executor: it runs in the driver's process, whose copies the run's row
        counts): each a LIST (a folder?) and one GET (`cached_copy`)."""
        if not storage.is_url(str(self.cfg.meru)) or not self.cfg.executor.plugin().copies_models:
            return {}
        n = models * min(self.W, tasks)
        return {"pool_get": n, "pool_list": n}

    def shard_bytes(self, stage: str) -> float:
        """A per-shard stage's output bytes per shard of the run (its probe shards' bytes per sample)."""
        return _shard_fit(self.probe, stage).out_bytes / max(1, self.probe.samples) * self.N / max(1, self.S)

    # --- rows of the three kinds ------------------------------------------------------------------

    def map(
        self,
        name: str,
        label: str,
        scales: str,
        factor: float = 1.0,
        *,
        reads: ShardReads | None = None,
        in_bytes: float | None = None,
        fixed_only: bool = False,
        driver_s: float = 0.0,
        extra_per_sample: float = 0.0,
        requests: dict | None = None,
        more_requests: dict | None = None,
    ) -> None:
        """A per-shard stage (`name`: its folder, its entry in the run's summary): its probe shards' fit
        (`_shard_fit`) extrapolated to the pool, plus its fixed cost. `requests`: its bucket requests when
        the caller counts them (else `stage_requests` of what it `reads`, `in_bytes` per shard of its main
        input: the embed output's unless given), plus `more_requests`."""
        probe, W = self.probe, self.W
        fit = _shard_fit(probe, name)
        if fit.shards == 0:
            return
        wall = max(0.0, _stage_seconds(probe, name) - driver_s)
        fixed = max(0.0, wall - fit.seconds(fit.shards, fit.samples) / max(1, min(W, fit.shards)))
        per_sample = max(0.0, fit.per_sample * factor + extra_per_sample)
        run_fit = dataclasses.replace(fit, per_sample=per_sample)
        est = wall if fixed_only else fixed + run_fit.seconds(self.S, self.N) / self.par
        out_r = fit.out_bytes if fixed_only else fit.out_bytes * self.lin
        per_shard_in = self.embed_bytes if in_bytes is None else in_bytes
        shards_r = fit.shards if fixed_only else self.S
        req = requests
        if req is None:
            req = stage_requests(reads or ShardReads(), shards_r, out_r / max(1, shards_r), per_shard_in, W)
        req = add(req, more_requests or {})
        row = Row(
            label, scales, round(wall, 3), round(fixed, 3), round(est, 3), int(out_r), req, run_stage=name
        )
        if not fixed_only:
            row.per_shard_s, row.per_sample_s = run_fit.per_shard, run_fit.per_sample
        self.rows.append(row)

    def fixed(
        self,
        label: str,
        seconds: float,
        nbytes: int = 0,
        req: dict | None = None,
        *,
        run_stage: str = "other",
    ) -> None:
        """A fixed cost: its probe seconds stay (`run_stage`: the run's summary stage it is part of)."""
        r = round(seconds, 3)
        self.rows.append(Row(label, "fixed", r, r, r, nbytes, req or {}, run_stage=run_stage))

    def driver(
        self,
        label: str,
        seconds: float,
        factor: float,
        scales: str,
        nbytes: float,
        req: dict,
        *,
        fixed: float = 0.0,
        apart: tuple[float, float] = (0.0, 0.0),
        run_stage: str = "other",
    ) -> None:
        """A driver step of the run's stage `run_stage`: its probe `seconds` scaled by `factor`, but for
        `fixed` seconds, which stay, and a part estimated `apart` (its probe seconds, its run seconds)."""
        est = fixed + max(0.0, seconds - fixed - apart[0]) * factor + apart[1]
        self.rows.append(
            Row(
                label,
                scales,
                round(seconds, 3),
                round(fixed, 3),
                round(est, 3),
                int(nbytes),
                req,
                run_stage=run_stage,
            )
        )


def estimate(cfg: ScoreConfig, size: PoolSize, probe: Probe) -> dict:
    """Extrapolate the probe to the pool (module docstring), stage by stage in the order the run takes
    (`hype.scoring.stages.STAGES`: each stage's `plan` adds its rows); the plan as a JSON-able dict."""
    est = _Estimate(cfg, size, probe)
    est.fixed("start-up", probe.startup_s)
    if probe.executor_start_s:
        est.fixed(f"{cfg.executor.kind} start", probe.executor_start_s)
    for spec in stages.active(cfg):
        if spec.plan is not None:
            spec.plan(est)
    other = float(probe.summary.get("seconds", 0.0)) - sum(
        _stage_seconds(probe, k) for k in probe.summary.get("stages", {})
    )
    models = sum(storage.is_url(str(m)) for m in (cfg.meru, cfg.clip) if m)
    req = add(run_requests(), {"pool_get": models, "pool_list": models})
    est.fixed("driver other", max(0.0, other), 0, req)
    return _plan_dict(cfg, size, probe, est)


def _plan_dict(cfg: ScoreConfig, size: PoolSize, probe: Probe, est: _Estimate) -> dict:
    rows, W, par = est.rows, est.W, est.par
    total_s = sum(r.estimate_s for r in rows)
    fixed_s = sum(r.fixed_s for r in rows)
    requests = {k: int(sum(r.requests.get(k, 0) for r in rows)) for k in REQUEST_KINDS}
    device = probe.device
    gpus = 0
    if str(device).startswith("cuda"):
        gpus = par * cfg.executor.plugin().gpus_per_worker(cfg.executor)
    return {
        "pool": {"path": cfg.pool, **size.to_dict()},
        "run": {
            "out": cfg.out,
            "bucket": bool(cfg.out and storage.is_url(cfg.out)),
            "pool_bucket": storage.is_url(str(size.shards[0])) if size.shards else False,
        },
        "device": str(device),
        "executor": {"kind": cfg.executor.kind, "workers": W},
        "scaling": {
            "N_top": est.top_r,
            "M": est.m_r,
            "K": est.k_r,
            "kmeans_points": est.pts_r,
            "probe": {"N_top": est.top_p, "M": est.m_p, "K": est.k_p, "kmeans_points": est.pts_p},
        },
        "probe": {
            "samples": probe.samples,
            "shards": probe.shards,
            "seconds": round(float(probe.summary.get("seconds", 0)), 3),
            "stages": list(probe.summary.get("stages", {})),
            "load": probe.load,
            "energy_s_per_row": {str(k): v for k, v in probe.energy.items()},
            "copy_check": probe.copy_check,
        },
        "stages": [dataclasses.asdict(r) for r in rows],
        "total": {
            "seconds": round(total_s, 1),
            "fixed_seconds": round(fixed_s, 1),
            "device_hours": round(total_s * gpus / 3600, 4),
            "gpus": gpus,
            "cpu_core_hours": round(total_s * (usable_cpus() if not gpus else 0) / 3600, 4),
            "output_bytes": int(sum(r.bytes for r in rows)),
            "requests": requests,
        },
    }


def plan_score(
    cfg: ScoreConfig,
    *,
    probe_samples: int = PROBE_SAMPLES,
    count_tars: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """The whole `hype plan`: the pool's size, the probe, the estimate."""
    if not cfg.pool:
        raise PlanError("--pool is required: the shards to plan for")
    size = pool_size(cfg.pool, cfg.metadata.dir, count_tars=count_tars)
    probe = run_probe(cfg, size, probe_samples, log=log)
    return estimate(cfg, size, probe)


def _fmt_s(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def _fmt_b(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if b < 1000 or unit == "TB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1000
    return ""


def format_plan(plan: dict) -> str:
    """The plan as a text table."""
    p, t = plan["pool"], plan["total"]
    ex, pr = plan["executor"], plan["probe"]
    nominal = f", {p['nominal']:,} in the metadata" if p["nominal"] is not None else ""
    lines = [
        f"hype plan: {p['samples']:,} samples in {p['shards']:,} shards ({p['source']}{nominal}), "
        f"{_fmt_b(p['tar_bytes'])} of tars",
        f"  device {plan['device']}, executor {ex['kind']} x{ex['workers']}; probe: {pr['samples']} samples "
        f"in {pr['shards']} shard(s), {pr['seconds']:.1f} s",
        f"  {'stage':<17}{'scales with':<13}{'probe':>9}{'fixed':>9}{'estimate':>11}{'output':>10}"
        f"{'GET':>9}{'PUT':>8}{'LIST':>6}",
    ]
    for r in plan["stages"]:
        q = r["requests"]
        lines.append(
            f"  {r['stage']:<17}{r['scales_with']:<13}{r['probe_s']:>8.1f}s{r['fixed_s']:>8.1f}s"
            f"{_fmt_s(r['estimate_s']):>11}{_fmt_b(r['bytes']):>10}"
            f"{int(q.get('get', 0)):>9,}{int(q.get('put', 0)):>8,}{int(q.get('list', 0)):>6,}"
        )
    q = t["requests"]
    hours = (
        f"{t['device_hours']:.3f} GPU-hours ({t['gpus']} GPU)"
        if t["gpus"]
        else (f"{t['cpu_core_hours']:.3f} CPU core-hours")
    )
    lines += [
        f"  total: {_fmt_s(t['seconds'])} (fixed {_fmt_s(t['fixed_seconds'])}), {hours}, "
        f"{_fmt_b(t['output_bytes'])} written",
        f"  bucket requests (fresh run): run folder {q['get']:,} GET/HEAD, {q['put']:,} PUT, "
        f"{q['list']:,} LIST, {q['delete']:,} DELETE; pool {q['pool_get']:,} GET/HEAD, "
        f"{q['pool_list']:,} LIST",
    ]
    return "\n".join(lines)

"""`hype fit --proxy`: weights over score columns chosen on a proxy target, never on the evaluation tasks.

Each candidate weighting is judged by what its subset trains: `hype select --rank combine --weights W
--normalize zscore --frac F` on the scored pool, a `hype train --config PRESET --subset ...` at a fixed
samples-seen budget for every training seed, and `hype eval --tasks T` on the PROXY task set only (the
synthetic world's `proxy/`, `hype synth --proxy-size N`: eval's task families, other images). A
candidate's proxy score is the mean over training seeds of the unweighted mean of the tasks' main metrics;
the best one wins (a tie keeps the earlier candidate).

The candidates: Eq. 1's weights first (every column 1, the centre of the simplex), then points drawn
uniformly on the simplex (Dirichlet(1), seeded), scaled to sum to the number of columns. Under zscore a
weighting's scale does not change the ranking, so the simplex is every non-negative weighting; random
points spread a handful of training runs over all of it without an order of moves (coordinate steps
would spend them near the start), and Eq. 1 among them means the search never picks a weighting the
proxy measured worse than the paper's.

A proxy folder that is, holds or lies in an evaluation tasks' folder is refused before anything runs:
the scoring run's `decontam.eval_dir`, the `eval/` of any synthetic world the proxy, the training data
or the scores lie in, and every `--eval-dir` given. The weights file is `hype.select.fit.FORMAT`, read by
`hype select --rank combine --weights FILE`; its `data` says what the search saw: the proxy folder and
its digest, every candidate with its proxy scores, the budget and the seeds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hype.checkpoint import load_model_file, model_file_digest
from hype.config import ConfigError, parse_yaml
from hype.data.pipeline import DataError
from hype.data.shards import ShardError
from hype.data.subset_index import SubsetError
from hype.data.uids import UidError
from hype.eval.compare import task_average
from hype.eval.results import ResultsFileError
from hype.eval.runner import EvalError, RunOptions, run_eval
from hype.eval.tasks import TaskConfigError, select_tasks
from hype.io import StorageError, overlap, read_bytes, sha256_chunks, sha256_file
from hype.select.errors import SelectError
from hype.select.fit import FORMAT
from hype.select.request import SelectRequest
from hype.select.run import select_subset
from hype.table.reader import ScoresTable
from hype.train import InitError, ResumeError, TrainingDiverged, train
from hype.train.config import load_train_config
from hype.workflow import fmt_seconds


class ProxyFitError(SelectError):
    """A proxy search that cannot run as asked; the message names the input and the fix."""


# What a candidate's select, train or eval raises on unusable inputs (each stage's own one-line errors).
STEP_ERRORS: tuple[type[Exception], ...] = (
    ConfigError, ShardError, SubsetError, UidError, DataError, ResumeError, InitError, TrainingDiverged,
    EvalError, ResultsFileError,
)  # fmt: skip


@dataclass
class ProxySearch:
    """What `hype fit --proxy` runs: the inputs, the search and each candidate's training."""

    scores: list[str]
    data: str  # the pool's training shards (`hype train --data`)
    proxy: str
    work: str  # candidates' subsets, models and proxy results (a rerun reuses finished trainings)
    columns: list[str] | None = None
    candidates: int = 4
    seed: int = 0
    train_seeds: list[int] = field(default_factory=lambda: [0])
    preset: str = "tiny-clip"
    samples_seen: int | None = None  # None: the preset's
    frac: float = 0.2
    tasks: str = "synthetic"
    eval_dirs: list[str] = field(default_factory=list)
    train_overrides: list[str] = field(default_factory=list)
    device: str | None = None


def candidate_weights(columns: Sequence[str], n: int, seed: int) -> list[dict[str, float]]:
    """Eq. 1 (every column 1), then `n - 1` seeded Dirichlet(1) points scaled to sum to len(columns)."""
    rng = np.random.default_rng(seed)
    points = [np.ones(len(columns))] + [
        len(columns) * rng.dirichlet(np.ones(len(columns))) for _ in range(n - 1)
    ]
    return [{c: float(w) for c, w in zip(columns, p, strict=True)} for p in points]


def weights_spec(weights: dict[str, float]) -> str:
    """`--weights` text that gives exactly these floats back."""
    return ",".join(f"{c}={w!r}" for c, w in weights.items())


def folder_digest(folder: str | os.PathLike) -> str:
    """sha256 over every file's relative path and sha256, in path order: the proxy set the search saw."""
    root = Path(folder)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return sha256_chunks(f"{f.relative_to(root).as_posix()}\0{sha256_file(f)}\n".encode() for f in files)


def evaluation_folders(search: ProxySearch, table: ScoresTable) -> list[Path]:
    """The evaluation tasks' folders the proxy must stay out of: `--eval-dir`s, the scoring runs'
    decontam.eval_dir, and the eval/ of every synthetic world (a folder with world.json) above the proxy,
    the training data or the scores."""
    found = [Path(d) for d in search.eval_dirs]
    for folder in table.folders:
        config = folder.parent / "config.yaml"  # what `hype score` recorded, local or in a bucket
        try:
            recorded = parse_yaml(read_bytes(config), str(config))
        except (OSError, StorageError, ConfigError):
            recorded = None  # not a `hype score` run (a folder of Parquet files): nothing recorded
        decontam = recorded.get("decontam") if isinstance(recorded, dict) else None
        if isinstance(decontam, dict) and decontam.get("eval_dir"):
            found.append(Path(str(decontam["eval_dir"])))
    for start in (search.proxy, search.data, *map(str, table.folders)):
        path = Path(os.path.abspath(start))
        found += [p / "eval" for p in (path, *path.parents) if (p / "world.json").is_file()]
    return list(dict.fromkeys(Path(os.path.realpath(p)) for p in found))


def check_proxy(proxy: str, eval_folders: Sequence[Path]) -> Path:
    """The proxy folder (real path) when it exists and is disjoint from every evaluation folder."""
    path = Path(os.path.realpath(proxy))
    if not path.is_dir():
        raise ProxyFitError(
            f"--proxy {proxy}: no such folder; make a proxy task set with `hype synth --out WORLD ... "
            "--proxy-size 200` and pass WORLD/proxy"
        )
    for e in eval_folders:
        how = overlap(path, e)
        if how:
            raise ProxyFitError(
                f"--proxy {proxy} {how} the evaluation tasks' folder {e}; weights are never chosen on the "
                "evaluation tasks: pass a proxy task set disjoint from it (e.g. WORLD/proxy)"
            )
    return path


def run_search(search: ProxySearch, echo: Callable[[str], None] = lambda _: None) -> dict:
    """Run the search; returns the weights record (`FORMAT`)."""
    if search.candidates < 1 or not search.train_seeds:
        raise ProxyFitError("--candidates and --train-seeds: at least one candidate and one training seed")
    if not 0 < search.frac <= 1:
        raise ProxyFitError(f"--frac {search.frac}: a fraction of the pool in (0, 1]")
    table = ScoresTable(search.scores if len(search.scores) > 1 else search.scores[0])
    eval_folders = evaluation_folders(search, table)
    proxy = check_proxy(search.proxy, eval_folders)  # first: nothing runs near the evaluation tasks
    table.require_finished()
    columns = list(search.columns or table.present_metrics())
    if not columns:
        raise ProxyFitError(f"{table.source}: no metric columns to weight; pass --columns")
    try:
        tasks = select_tasks(search.tasks)
    except TaskConfigError as e:
        raise ProxyFitError(f"--proxy-tasks: {e}") from None
    digest = folder_digest(proxy)  # before the search: the set every candidate was scored on
    work = Path(search.work)
    results, start = [], time.perf_counter()
    weights = candidate_weights(columns, search.candidates, search.seed)
    for i, w in enumerate(weights):
        t0 = time.perf_counter()
        folder = work / f"candidate-{i}"
        try:
            results.append(_candidate(search, proxy, digest, tasks, folder, w))
        except STEP_ERRORS as e:  # one line naming the candidate: its logs and outputs are in `folder`
            raise ProxyFitError(f"candidate {i} ({folder}): {type(e).__name__}: {e}") from None
        done, took = i + 1, time.perf_counter() - t0
        rate = done / (time.perf_counter() - start)
        eta = (len(weights) - done) / rate
        echo(
            f"candidate {done}/{len(weights)}: proxy {results[-1]['proxy_score']:.4f} "
            f"({_short(w)}) in {fmt_seconds(took)}; {rate * 60:.2f} candidates/min, "
            f"ETA {fmt_seconds(eta)}"
        )
    best = max(range(len(results)), key=lambda i: (results[i]["proxy_score"], -i))
    return {
        "format": FORMAT,
        "weights": results[best]["weights"],
        "normalize": "zscore",
        "fit": {
            "method": "proxy-search",
            "search": "Eq. 1, then seeded Dirichlet(1) points on the simplex",
            "seed": search.seed,
            "chosen": best,
            "elapsed_s": round(time.perf_counter() - start, 3),
        },
        "data": {
            "proxy": str(proxy),
            "proxy_sha256": digest,
            "proxy_tasks": [t.key for t in tasks],
            "evaluation_folders_refused": [str(e) for e in eval_folders],
            "scores": table.source,
            "scores_rows": table.num_rows,
            "columns": columns,
            "train_data": search.data,
            "preset": search.preset,
            "samples_seen": results[0]["samples_seen"],
            "frac": search.frac,
            "train_seeds": list(search.train_seeds),
            "train_overrides": list(search.train_overrides),
            "candidates": results,
        },
    }


def _candidate(
    search: ProxySearch, proxy: Path, proxy_sha: str, tasks: list, folder: Path, weights: dict[str, float]
) -> dict:
    """Select, train (every seed) and evaluate one weighting on the proxy; its record. Trainings are kept
    under the subset's digest and proxy results under the proxy's, so a rerun reuses only what still
    holds (other scores, another subset or another proxy set: trained and evaluated afresh)."""
    folder.mkdir(parents=True, exist_ok=True)
    subset = folder / "subset.npy"
    req = SelectRequest(
        scores=search.scores if len(search.scores) > 1 else search.scores[0],
        out=str(subset),
        frac=search.frac,
        rank="combine",
        weights=weights_spec(weights),
        normalize="zscore",
        progress=False,
    )
    kept = select_subset(req)["subset_rows"]
    subset_sha = sha256_file(subset)
    per_seed, per_task, samples_seen = [], {}, None
    for s in search.train_seeds:
        run = folder / f"train-{subset_sha[:16]}-seed{s}"
        model, samples_seen = _train(search, subset, run, s)
        metrics = _evaluate(search, model, proxy, tasks, run / f"proxy-{proxy_sha[:16]}.jsonl")
        per_seed.append(task_average(metrics, list(metrics)))
        for k, v in metrics.items():
            per_task.setdefault(k, []).append(v)
    return {
        "weights": weights,
        "proxy_score": float(np.mean(per_seed)),
        "per_seed": per_seed,
        "per_task": {k: float(np.mean(v)) for k, v in per_task.items()},
        "subset_rows": kept,
        "subset_sha256": subset_sha,
        "samples_seen": samples_seen,
    }


def _train(search: ProxySearch, subset: Path, out: Path, seed: int) -> tuple[Path, int]:
    """Train the preset on the subset (a finished run of the same recipe is reused); (model, samples)."""
    overrides = [
        *search.train_overrides,
        *([f"samples_seen={search.samples_seen}"] if search.samples_seen is not None else []),
        f"seed={seed}",
        *([f"device={search.device}"] if search.device else []),
        *(
            f"{k}={json.dumps(str(v))}"
            for k, v in (("data.train", search.data), ("data.subset", subset), ("out", out))
        ),
    ]
    try:
        cfg = load_train_config(search.preset, overrides)
    except ConfigError as e:
        raise ProxyFitError(f"--preset {search.preset}: {e}") from None
    summary = train(cfg, progress=False, echo=lambda _: None)
    if summary.get("state") != "done":
        raise ProxyFitError(f"training in {out} did not finish ({summary.get('status')}); rerun to resume it")
    return out / "model.safetensors", cfg.samples_seen


def _evaluate(search: ProxySearch, model: Path, proxy: Path, tasks: list, out: Path) -> dict[str, float]:
    """{task: main metric} of the model on the proxy tasks; every task must be there."""
    net = load_model_file(model)
    identity = {"checkpoint_sha256": model_file_digest(model), "config": net.config.name}
    options = RunOptions(device=search.device, progress=False)
    summary = run_eval(net, tasks, proxy, out, options, identity=identity)
    if summary["data_dir"] != str(proxy):  # run_eval reads a world root's eval/: never here
        raise ProxyFitError(
            f"--proxy {proxy}: hype eval read {summary['data_dir']} instead; pass the proxy folder"
        )
    bad = [r for r in summary["tasks"] if r.get("main_metric") is None]
    if bad:
        why = "; ".join(f"{r['key']}: {r.get('reason') or r.get('error') or r['status']}" for r in bad[:3])
        raise ProxyFitError(
            f"--proxy {proxy}: {len(bad)} proxy task(s) not evaluated ({why}); pass a complete proxy set"
        )
    return {r["key"]: float(r["main_metric"]) for r in summary["tasks"]}


def describe(record: dict) -> str:
    """The summary lines: every candidate's proxy score, the chosen weights and what the search saw."""
    data, chosen = record["data"], record["fit"]["chosen"]
    lines = [
        f"searched {len(data['candidates'])} weightings on the proxy {data['proxy']} "
        f"({len(data['proxy_tasks'])} tasks, sha256 {data['proxy_sha256'][:12]}); never the evaluation tasks",
        f"each: {data['frac']:.0%} subset, {data['preset']} trained for {data['samples_seen']} samples seen, "
        f"seeds {','.join(map(str, data['train_seeds']))}",
    ]
    for i, c in enumerate(data["candidates"]):
        mark = "*" if i == chosen else " "
        lines.append(f" {mark} {i}: proxy {c['proxy_score']:.4f}  {_short(c['weights'])}")
    lines.append(f"chosen (zscore over the pool): {_short(record['weights'])}")
    return "\n".join(lines)


def _short(weights: dict[str, float]) -> str:
    return ", ".join(f"{c}={w:.3g}" for c, w in weights.items())

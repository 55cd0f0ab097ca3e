"""Score cards: what a third party needs to check a published selection (`RUN_DIR/card.json`).

A card names everything a run's scores depend on by digest (the two models, the reference sets S_i/S_t,
the k-means centroids and c_IN targets, the resolved config, the code version), the digest of every stage's
outputs (from the stage markers, so writing a card reads no output), and a seeded sample of scored rows
(uid, ε_i, ε_t, −d_L, cos θ, c_IN) with its checksum. Published next to a subset, with `reference.safetensors`
and `clusters/centroids.npy` + `targets.npy` beside it (the run directory holds them), it lets anyone run

    hype verify RUN_DIR/card.json --pool SHARDS [--meru M --clip C] [--device cuda]

which recomputes the sampled rows from the pool with the named models, through the same embed and
specificity stages `hype score` runs, and reports the largest difference per column against a stated
tolerance (fp32 on the same kind of device: float rounding, ~1e-5; bf16 towers or another device: larger,
see `TOLERANCE`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as pads

import hype
from hype.data.samples import SkipStats, iter_tar_samples, sample_uid
from hype.data.shards import expand_shards
from hype.io import load_npy, read_json, read_parquet, storage
from hype.scoring.rundir import SHARD_STAGES, RunDir, atomic_write_json, file_digest, fingerprint, make_tasks
from hype.table.schema import scores_dir

FORMAT = "hype-score-card/1"
COLUMNS = ("eps_i", "eps_t", "neg_d_l", "cos_theta", "c_in")
SAMPLE_ROWS = 256
SAMPLE_PARTS = 16  # parts read for the sample: bounded cost on a 100M-row table
# Largest |difference| accepted per column, by how the towers ran: fp32 against fp32 differs by float
# rounding (thread counts, BLAS kernels, TF32 convolutions on a GPU); bf16 towers by their 8-bit mantissa.
TOLERANCE = {"fp32": 2e-3, "bf16": 0.05, "fp16": 0.02}


class CardError(ValueError):
    """A card that cannot be written or checked; the message names the file and the fix."""


def _checksum(rows: list[list]) -> str:
    return fingerprint(rows)


def _sample(run: RunDir, seed: int, n: int) -> list[list]:
    """`n` rows of the scores table, seeded: up to SAMPLE_PARTS parts drawn, rows drawn within them."""
    folder = scores_dir(run.root)
    names = storage.list_names(folder) if storage.exists(folder) else []
    parts = [
        storage.join(folder, n) for n in sorted(names) if n.startswith("part-") and n.endswith(".parquet")
    ]
    if not parts:
        return []
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(len(parts), size=min(SAMPLE_PARTS, len(parts)), replace=False))
    tables = [read_parquet(parts[i], columns=["uid", *COLUMNS]) for i in chosen]  # a URL: read by ranges
    rows = [
        r for t in tables for r in zip(*(t.column(c).to_pylist() for c in ["uid", *COLUMNS]), strict=True)
    ]
    take = sorted(rng.choice(len(rows), size=min(n, len(rows)), replace=False))
    return [[rows[i][0], *(float(v) for v in rows[i][1:])] for i in take]


def _stage_digests(run: RunDir) -> dict[str, str]:
    """Per stage, the digest of its outputs' digests as its markers record them (no output is read)."""
    out = {}
    for stage in SHARD_STAGES:
        folder = run.root / stage
        names = (
            sorted(n for n in storage.list_names(folder) if n.endswith("_stats.json"))
            if storage.exists(folder)
            else []
        )
        recorded = [
            (n, (read_json(storage.join(folder, n)) or {}).get("output", {}).get("digest")) for n in names
        ]
        if recorded:
            out[stage] = fingerprint(recorded)
    return out


def _optional_digest(path) -> str | None:
    return file_digest(path) if storage.is_file(path) else None


def write_card(
    run: RunDir, settings: dict, models: dict[str, str | None], paths: dict | None = None, seed: int = 0
) -> dict:
    """Write RUN_DIR/card.json for a complete run. `settings`: what decides the numbers (precision,
    device kind, embed and specificity settings); `models`: role -> model digest (None: from metadata)."""
    rows = _sample(run, seed, SAMPLE_ROWS)
    card = {
        "format": FORMAT,
        "code": {"hype": hype.__version__},
        "models": models,
        "model_paths": paths or {},  # where this run read them (verify's default; --meru/--clip override)
        "reference": _optional_digest(run.reference),
        "centroids": _optional_digest(run.centroids),
        "targets": _optional_digest(run.targets),
        "config": _optional_digest(run.config),
        "settings": settings,
        "stages": _stage_digests(run),
        "sample": {"seed": seed, "columns": ["uid", *COLUMNS], "rows": rows, "checksum": _checksum(rows)},
    }
    atomic_write_json(run.root / "card.json", card)
    return card


def load_card(path: str | Path) -> dict:
    card = read_json(path)
    if not isinstance(card, dict) or card.get("format") != FORMAT:
        raise CardError(f"{path}: not a hype score card ({FORMAT}); `hype score` writes RUN_DIR/card.json")
    sample = card.get("sample") or {}
    if _checksum(sample.get("rows", [])) != sample.get("checksum"):
        raise CardError(f"{path}: the sample's checksum does not match its rows: the card was altered")
    return card


def _check_file(card: dict, key: str, path: Path, card_path: Path) -> None:
    want = card.get(key)
    if want is not None and _optional_digest(path) != want:
        raise CardError(
            f"{card_path}: {path} is missing or is not the {key} the card names (digest {want}); publish "
            "the run directory's file beside the card"
        )


def _sample_tar(pool: str, uids: set[str], out: Path) -> int:
    """The raw members of the first occurrence of each of `uids` in the pool (in pool order) as one tar."""
    found, skipped = set(), SkipStats()
    with tarfile.open(out, "w") as tar:
        for task in make_tasks(expand_shards(pool).paths):
            for sample in iter_tar_samples(task.source, SkipStats()):
                uid = sample_uid(sample, skipped)
                if uid in uids and uid not in found:
                    found.add(uid)
                    for ext, data in sample.files.items():
                        info = tarfile.TarInfo(f"{len(found):09d}.{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
    return len(found)


def verify_card(
    card_path: str | Path,
    pool: str,
    *,
    meru: str | None = None,
    clip: str | None = None,
    device: str = "cpu",
    precision: str | None = None,
    tolerance: float | None = None,
) -> dict:
    """Recompute the card's sampled rows from `pool`; the report (`ok`, max |difference| per column)."""
    from hype.scoring.clusters import c_in, nearest_centroid
    from hype.scoring.embed import EmbedStage, ModelRef, resolve_precision
    from hype.scoring.embed_format import read_embeddings
    from hype.scoring.stage_specificity import SpecificityStage
    from hype.text.language import datacomp_caption_ok

    card_path = Path(card_path)
    card = load_card(card_path)
    source, s = RunDir(card_path.parent), card["settings"]
    for key, path in (("reference", source.reference), ("centroids", source.centroids)):
        _check_file(card, key, path, card_path)
    _check_file(card, "targets", source.targets, card_path)
    refs = {}
    for role, given in (("meru", meru), ("clip", clip)):
        path = given or (card.get("model_paths") or {}).get(role)
        want = card["models"].get(role)
        if want is None:
            continue
        if path is None or not storage.is_file(path):
            raise CardError(
                f"--{role}: the card's {role} model is needed (digest {want}); pass --{role} FILE"
            )
        if file_digest(path) != want:
            raise CardError(f"--{role} {path}: not the model the card names (digest {want})")
        refs[role] = ModelRef(str(path), want)
    if "clip" not in refs:
        raise CardError(f"{card_path}: cos θ came from metadata; verify needs a run scored with --clip")
    precision = precision or s["precision"]
    rows = card["sample"]["rows"]
    want = {r[0]: r[1:] for r in rows}
    with tempfile.TemporaryDirectory(prefix="hype-verify-") as tmp:
        tar = Path(tmp) / "sample.tar"
        found = _sample_tar(pool, set(want), tar)
        run = RunDir(Path(tmp) / "run")
        run.create()
        (task,) = make_tasks([str(tar)])
        kw = {"device": device, "threads": 0}
        embed = EmbedStage(run, meru=refs["meru"], clip=refs["clip"], precision=precision, **s["embed"], **kw)
        embed.setup()
        try:
            embed.run(task)
        finally:
            embed.teardown()
        Path(run.reference).write_bytes(Path(source.reference).read_bytes())
        spec = SpecificityStage(run, reference_digest=card["reference"], **s["specificity"], **kw)
        spec.setup()
        spec.run(task)
        got = _table(run, task)
        feats = read_embeddings(run.shard_output("embed", task), "clip_img")
        if card.get("centroids") is not None:
            cluster = nearest_centroid(feats, load_npy(source.centroids))
            ok = datacomp_caption_ok(got["text"]) if s.get("caption_filter", True) else None
            got["c_in"] = c_in(cluster, load_npy(source.targets), ok)
        else:
            got["c_in"] = np.zeros(len(got["uid"]))
    index = {u: i for i, u in enumerate(got["uid"])}
    diffs = {c: 0.0 for c in COLUMNS}
    missing = [u for u in want if u not in index]
    for uid, values in want.items():
        if uid in index:
            for c, v in zip(COLUMNS, values, strict=True):
                diffs[c] = max(diffs[c], abs(float(got[c][index[uid]]) - v))
    resolved = resolve_precision(device, precision)
    tol = tolerance if tolerance is not None else max(TOLERANCE[resolved], TOLERANCE[s["resolved_precision"]])
    c_in_flips = sum(
        1 for u, v in want.items() if u in index and float(got["c_in"][index[u]]) != v[COLUMNS.index("c_in")]
    )
    return {
        "card": str(card_path),
        "rows": len(want),
        "found_in_pool": found,
        "missing": missing[:10],
        "max_abs_diff": {c: round(v, 8) for c, v in diffs.items() if c != "c_in"},
        "c_in_flips": c_in_flips,
        "tolerance": tol,
        "precision": resolved,
        "device": device,
        "ok": not missing
        and all(v <= tol for c, v in diffs.items() if c != "c_in")
        and c_in_flips <= max(1, len(want) // 100),
    }


def _table(run: RunDir, task) -> dict[str, Any]:
    embed = pads.dataset(str(run.shard_output("embed", task)), format="parquet").to_table(
        columns=["uid", "text", "neg_d_l", "cos_theta"]
    )
    spec = pads.dataset(str(run.shard_output("specificity", task)), format="parquet").to_table()
    out = {c: embed.column(c).to_pylist() for c in ("uid", "text")}
    out |= {c: embed.column(c).to_numpy() for c in ("neg_d_l", "cos_theta")}
    out |= {c: spec.column(c).to_numpy() for c in ("eps_i", "eps_t")}
    return out


def card_settings(cfg, resolved_precision: str, curv: float, K: float) -> dict:
    """What decides a run's numbers, as `verify_card` needs it to run the same stages."""
    return {
        "precision": cfg.precision,
        "resolved_precision": resolved_precision,
        "embed": {
            "batch_size": cfg.batch_size,
            "decode_workers": cfg.embed.decode_workers,
            "decode": cfg.embed.decode,
            "prefetch_batches": cfg.embed.prefetch_batches,
            "jpeg_draft": cfg.embed.jpeg_draft,
        },
        "specificity": {
            "curv": curv,
            "K": K,
            "hinge": cfg.specificity.hinge,
            "budget_elems": cfg.specificity.budget_elems,
        },
        "caption_filter": cfg.clusters.caption_filter,
        "config": dataclasses.asdict(cfg.specificity) | {"n_top": cfg.reference.n_top, "m": cfg.reference.m},
    }


def dumps(report: dict) -> str:
    return json.dumps(report, indent=2)

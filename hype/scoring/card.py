"""Score cards: what a third party needs to check a published selection (`RUN_DIR/card.json`).

A card names everything a run's scores depend on by digest (the two models, the reference sets S_i/S_t,
the k-means centroids and c_IN targets, the resolved config, the code version), the digest of every stage's
outputs (from the stage markers, so writing a card reads no output), and a seeded sample of scored rows
(uid, ε_i, ε_t, −d_L, cos θ, c_IN) with its checksum. Published next to a subset, with `reference.safetensors`
and `clusters/centroids.npy` + `targets.npy` beside it (the run directory holds them), it lets anyone run

    hype verify RUN_DIR/card.json --pool SHARDS [--meru M --clip C] [--device cuda] [--subset SUBSET]

which recomputes the sampled rows from the pool with the named models, through the same embed and
specificity stages `hype score` runs, and reports the largest difference per column against a stated
tolerance (fp32 on the same kind of device: float rounding, ~1e-5; bf16 towers or another device: larger,
see `TOLERANCE`).

What a card binds, and what a verifier can establish: the card names every scores part by its digest and
row count (from the merge markers), and carries its own content digest (`digest`, over everything else in
it). `hype verify` checks the parts beside the card against those digests, redoes the stage digests from
the markers when they are there, and recomputes the sample from the pool. The content digest detects a
card edited by hand (a stage digest, the code version) or cut short; it is not a signature: whoever can
write the card can recompute it. A card proves who made it only when its digest is signed or published
through a channel the reader trusts.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as pads

import hype
from hype.data.samples import SkipStats, iter_tar_samples, sample_uid
from hype.data.shards import expand_shards
from hype.executor import available_memory, usable_cpus
from hype.io import blake2b128_file, load_npy, open_input, read_json, read_parquet, storage
from hype.scoring.context import RunContext, StageSpec
from hype.scoring.pricing import JSON_GET, lists, parquet_get, stream_get
from hype.scoring.rundir import SHARD_STAGES, STAGE_NAME, RunDir, atomic_write_json, fingerprint, make_tasks
from hype.table.schema import scores_dir

FORMAT = "hype-score-card/2"
OLD_FORMATS = ("hype-score-card/1",)  # without the bindings `hype verify` checks now
MAX_CARD_BYTES = 16 << 20  # a card is ~50 KiB (256 sampled rows); more is not a card, read no further
RECREATE = (
    "re-create it: rerun `hype score --config RUN_DIR/config.yaml` (complete stages are reused) and publish "
    "the new RUN_DIR/card.json"
)
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


def _stage_outputs(run: RunDir, also: tuple[str, ...] = ()) -> dict[str, list[tuple[str, dict]]]:
    """Per stage folder of the run (and `also`: those a card names), each marker's name and the output it
    records, read once (no output is read)."""
    out = {}
    for stage in dict.fromkeys((*run.stage_folders, *also)):
        folder = run.root / stage
        names = (
            sorted(n for n in storage.list_names(folder) if n.endswith("_stats.json"))
            if storage.exists(folder)
            else []
        )
        recorded = [(n, (read_json(storage.join(folder, n)) or {}).get("output") or {}) for n in names]
        if recorded:
            out[stage] = recorded
    return out


def _stage_digests(outputs: dict[str, list[tuple[str, dict]]]) -> dict[str, str]:
    """Per stage, the digest of its outputs' digests as its markers record them."""
    return {stage: fingerprint([(n, o.get("digest")) for n, o in rec]) for stage, rec in outputs.items()}


def _scores_binding(outputs: dict[str, list[tuple[str, dict]]]) -> dict:
    """The scores parts as their merge markers record them: total rows, count, and one digest of every
    part's name and digest (a list would make a 1M-shard pool's card ~100 MB)."""
    merged = [o for _, o in outputs.get("merge", [])]
    parts = {o["file"]: o["digest"] for o in merged}
    return {"rows": sum(o["rows"] for o in merged), "parts": len(parts), "digest": _parts_digest(parts)}


def _parts_digest(parts: dict[str, str]) -> str:
    return fingerprint(sorted(parts.items()))


def seal(card: dict) -> dict:
    """`card` with its content digest: the fingerprint of everything else in it."""
    body = {k: v for k, v in card.items() if k != "digest"}
    return body | {"digest": fingerprint(body)}


def _optional_digest(path) -> str | None:
    return blake2b128_file(path) if storage.is_file(path) else None


def write_card(
    run: RunDir, settings: dict, models: dict[str, str | None], paths: dict | None = None, seed: int = 0
) -> dict:
    """Write RUN_DIR/card.json for a complete run. `settings`: what decides the numbers (precision,
    device kind, embed and specificity settings); `models`: role -> model digest (None: from metadata)."""
    rows, outputs = _sample(run, seed, SAMPLE_ROWS), _stage_outputs(run)
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
        "stages": _stage_digests(outputs),
        "scores": _scores_binding(outputs),
        "sample": {"seed": seed, "columns": ["uid", *COLUMNS], "rows": rows, "checksum": _checksum(rows)},
    }
    card = seal(card)
    atomic_write_json(run.root / "card.json", card)
    return card


_DIGEST = (str, None)
# The card's schema, in one place: a type (tuple: any of them, None: null), a dict of required keys, or
# {"*": spec} for a mapping of any keys.
SCHEMA: dict = {
    "format": str,
    "code": {"hype": str},
    "models": {"meru": _DIGEST, "clip": _DIGEST},
    "model_paths": {"*": _DIGEST},
    "reference": _DIGEST,
    "centroids": _DIGEST,
    "targets": _DIGEST,
    "config": _DIGEST,
    "settings": {
        "precision": str,
        "resolved_precision": str,
        "embed": {
            "batch_size": int,
            "decode_workers": int,
            "decode": str,
            "prefetch_batches": int,
            "jpeg_draft": bool,
        },
        "specificity": {"curv": float, "K": float, "hinge": bool, "budget_elems": int},
        "caption_filter": bool,
        "config": dict,
    },
    "stages": {"*": str},
    "scores": {"rows": int, "parts": int, "digest": str},
    "sample": {"seed": int, "columns": list, "rows": list, "checksum": str},
    "digest": str,
}
_VALUES = {  # (keys path, check, what it must be)
    ("settings", "precision"): (lambda v: v in ("auto", "fp32", "bf16", "fp16"), "auto, fp32, bf16 or fp16"),
    ("settings", "resolved_precision"): (lambda v: v in TOLERANCE, "fp32, bf16 or fp16"),
    ("settings", "embed", "batch_size"): (lambda v: v >= 1, "at least 1"),
    ("settings", "embed", "decode_workers"): (lambda v: v >= 0, "at least 0"),
    ("settings", "embed", "prefetch_batches"): (lambda v: v >= 1, "at least 1"),
    ("settings", "embed", "decode"): (lambda v: v in ("processes", "threads"), "processes or threads"),
    ("settings", "specificity", "curv"): (lambda v: math.isfinite(v) and v > 0, "a positive number"),
    ("settings", "specificity", "K"): (lambda v: math.isfinite(v), "a finite number"),
    ("settings", "specificity", "budget_elems"): (lambda v: v >= 1, "at least 1"),
    ("sample", "columns"): (lambda v: v == ["uid", *COLUMNS], f"{['uid', *COLUMNS]}"),
    ("sample", "rows"): (lambda v: all(_row_ok(r) for r in v), "rows of a uid and 5 finite numbers"),
    ("scores", "rows"): (lambda v: v >= 1, "at least 1 (a card must certify some rows)"),
    ("scores", "parts"): (lambda v: v >= 1, "at least 1"),
}


def _row_ok(row: Any) -> bool:
    return (
        isinstance(row, list)
        and len(row) == 1 + len(COLUMNS)
        and isinstance(row[0], str)
        and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in row[1:])
    )


def _schema_problem(value: Any, spec: Any, where: str) -> str | None:
    """The first place where `value` does not follow `spec`, or None."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{where or 'the card'}: expected an object, got {type(value).__name__}"
        if "*" in spec:
            items = [(k, spec["*"]) for k in value]
        else:
            missing = [k for k in spec if k not in value]
            if missing:
                return f"{where + '.' if where else ''}{missing[0]}: missing"
            items = list(spec.items())
        for key, sub in items:
            problem = _schema_problem(value[key], sub, f"{where}.{key}" if where else key)
            if problem:
                return problem
        return None
    types = tuple(type(None) if t is None else t for t in (spec if isinstance(spec, tuple) else (spec,)))
    accepted = (*types, int) if float in types else types  # JSON writes 2.0 as 2
    if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        return f"{where}: expected {names}, got {type(value).__name__}"
    return None


def validate_card(card: Any, path: str | Path) -> dict:
    """`card` when it follows the schema and binds what it certifies; else a CardError naming the key."""
    if not isinstance(card, dict) or (card.get("format") not in (FORMAT, *OLD_FORMATS)):
        raise CardError(f"{path}: not a hype score card ({FORMAT}); `hype score` writes RUN_DIR/card.json")
    if card["format"] in OLD_FORMATS:
        raise CardError(
            f"{path}: written by an earlier hype ({card['format']}): it does not bind the scores parts it "
            f"certifies; {RECREATE}"
        )
    problem = _schema_problem(card, SCHEMA, "")
    for keys, (ok, what) in _VALUES.items():
        if problem:
            break
        value = card
        for k in keys:
            value = value[k]
        if not ok(value):
            problem = f"{'.'.join(keys)}: must be {what}, got {str(value)[:60]}"
    if problem:
        raise CardError(f"{path}: not a valid score card ({problem}); {RECREATE}")
    rows = card["sample"]["rows"]
    if not rows or len(rows) > card["scores"]["rows"] or len({r[0] for r in rows}) != len(rows):
        raise CardError(
            f"{path}: the sample must hold 1 to {card['scores']['rows']} distinct rows of the scores table "
            f"(it holds {len(rows)}); {RECREATE}"
        )
    if _checksum(rows) != card["sample"]["checksum"]:
        raise CardError(f"{path}: the sample's checksum does not match its rows: the card was altered")
    if seal(card)["digest"] != card["digest"]:
        raise CardError(f"{path}: the card's content digest does not match its content: the card was altered")
    return card


def load_card(path: str | Path) -> dict:
    """The card at `path`, read no further than MAX_CARD_BYTES, parsed and validated (`validate_card`)."""
    try:
        with open_input(path) as f:
            data = f.read(MAX_CARD_BYTES + 1)
    except OSError as e:
        raise CardError(
            f"{path}: cannot be read ({e.strerror or e}); pass the card `hype score` wrote"
        ) from None
    if len(data) > MAX_CARD_BYTES:
        raise CardError(f"{path}: over {MAX_CARD_BYTES >> 20} MiB, not a score card (one is ~50 KiB)")
    try:
        card = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CardError(f"{path}: not JSON ({str(e)[:80]}); pass the card.json `hype score` wrote") from None
    return validate_card(card, path)


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


def _check_scores(card: dict, source: RunDir, card_path: Path) -> bool:
    """The scores parts beside the card are the ones it names (every part read and digested); False when
    none lie there."""
    folder = scores_dir(source.root)
    if not storage.exists(folder):
        return False
    names = [n for n in storage.list_names(folder) if n.startswith("part-") and n.endswith(".parquet")]
    if len(names) != card["scores"]["parts"]:
        raise CardError(
            f"{card_path}: {folder} holds {len(names)} scores parts, the card names "
            f"{card['scores']['parts']}: the scores were altered, or publish all of them"
        )
    if (
        _parts_digest({n: blake2b128_file(storage.join(folder, n)) for n in names})
        != card["scores"]["digest"]
    ):
        raise CardError(
            f"{card_path}: the scores parts in {folder} are not the ones the card names: the scores were "
            "altered"
        )
    return True


def _check_stages(card: dict, source: RunDir, card_path: Path) -> bool:
    """The stage digests redone from the markers beside the card; False when no markers lie there."""
    named = tuple(card["stages"])
    bad = [n for n in named if not STAGE_NAME.fullmatch(n)]
    if bad:  # a card is data: its stage names become folder names only when they are plain names
        raise CardError(f"{card_path}: stage {bad[0]!r} is not a stage name; the card was altered")
    redone = _stage_digests(_stage_outputs(source, named))
    if redone and redone != card["stages"]:
        stage = next(
            k for k in sorted(set(redone) | set(card["stages"])) if redone.get(k) != card["stages"].get(k)
        )
        raise CardError(f"{card_path}: the {stage} stage's outputs are not the ones the card names")
    return bool(redone)


IMAGE_BYTES = 3 * 224 * 224 * 4 * 4  # one decoded image in a batch (fp32 input), ~4x for the towers' copies


def machine_settings(settings: dict, rows: int) -> dict:
    """The card's settings fitted to this machine: a card is data, it does not size the run. Decode workers
    at most the usable CPUs; a batch at most the sample and what half the free memory holds; the
    specificity working set (elements, float32, a few copies) within half the free memory too. None of
    these changes a score (the stages' outputs do not depend on them)."""
    embed, memory = settings["embed"], available_memory()
    half = memory // 2 if memory else None
    fits = max(1, half // (IMAGE_BYTES * (1 + embed["prefetch_batches"]))) if half else rows
    budget = settings["specificity"]["budget_elems"]
    return settings | {
        "embed": embed
        | {
            "decode_workers": min(embed["decode_workers"] or usable_cpus(), usable_cpus()),
            "batch_size": max(1, min(embed["batch_size"], rows, fits)),
            "prefetch_batches": min(embed["prefetch_batches"], 4),
        },
        "specificity": settings["specificity"]
        | {"budget_elems": max(1024, min(budget, half // 16)) if half else budget},
    }


def verify_card(
    card_path: str | Path,
    pool: str,
    *,
    meru: str | None = None,
    clip: str | None = None,
    device: str = "cpu",
    precision: str | None = None,
    tolerance: float | None = None,
    fetch: Any = None,
) -> dict:
    """Recompute the card's sampled rows from `pool`; the report (`ok`, max |difference| per column).
    `fetch(role, url)`: a local copy of a model URL the card records (the CLI fetches it through the
    download's network guard); without it such a URL is refused, --meru/--clip FILE stand in."""
    from hype.scoring.clusters import c_in, nearest_centroid
    from hype.scoring.embed import EmbedStage, ModelRef, resolve_precision
    from hype.scoring.embed_format import read_embeddings
    from hype.scoring.stage_specificity import SpecificityStage
    from hype.text.language import datacomp_caption_ok

    card_path = Path(card_path)
    card = load_card(card_path)
    source, s = RunDir(card_path.parent), machine_settings(card["settings"], len(card["sample"]["rows"]))
    scores_checked = _check_scores(card, source, card_path)
    stages_checked = _check_stages(card, source, card_path)
    for key, path in (("reference", source.reference), ("centroids", source.centroids)):
        _check_file(card, key, path, card_path)
    _check_file(card, "targets", source.targets, card_path)
    refs = {}
    for role, given in (("meru", meru), ("clip", clip)):
        path = given or card["model_paths"].get(role)
        want = card["models"].get(role)
        if want is None:
            continue
        if not given and path is not None and storage.is_url(path):
            if fetch is None:
                raise CardError(f"{card_path}: the {role} model is a URL ({path}); pass --{role} FILE")
            path = fetch(role, path)
        if path is None or not storage.is_file(path):
            raise CardError(
                f"--{role}: the card's {role} model is needed (digest {want}); pass --{role} FILE"
            )
        if blake2b128_file(path) != want:
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
        "scores_rows": card["scores"]["rows"],
        "scores_checked": scores_checked,  # every part beside the card has the digest the card names
        "stages_checked": stages_checked,  # the stage digests redone from the markers beside the card
        "embed": s["embed"],  # as this machine runs them (`machine_settings`)
        "budget_elems": s["specificity"]["budget_elems"],
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


# --- the card as the last step of a `hype score` run -------------------------------------------------


def _write(ctx: RunContext, settings: None, inputs: dict) -> dict:
    """RUN_DIR/card.json: digests of what the scores depend on and a checksummed sample of them."""
    return ctx.timed("card", lambda: _card(ctx, inputs["embed"]))


def _card(ctx: RunContext, pool: Any) -> dict:
    from hype.scoring.embed import resolve_precision
    from hype.scoring.stagebase import resolve_device

    cfg = ctx.cfg
    resolved = resolve_precision(resolve_device(cfg.device), cfg.precision)
    settings = card_settings(cfg, resolved, pool.curv, pool.K)
    clip_from_metadata = ctx.metadata is not None and ctx.metadata.get("cos_theta") != "--clip"
    models = {"meru": pool.meru.digest, "clip": None if clip_from_metadata else pool.clip.digest}
    card = write_card(ctx.run, settings, models, {"meru": cfg.meru, "clip": models["clip"] and cfg.clip})
    return {"rows_sampled": len(card["sample"]["rows"])}


def card_requests(folders: dict[str, int], parts: int, part_bytes: float, files: list[float]) -> dict:
    """`write_card`'s bucket requests: each stage folder of SHARD_STAGES looked for (HEAD + LIST) and, when
    there (`folders`: stage -> markers), listed and every marker read; up to SAMPLE_PARTS scores parts
    read; the digest of each optional file (reference, centroids, targets, config: `files`, their sizes)."""
    req = {"get": 0.0, "put": 1, "list": 0.0}
    for stage in (*SHARD_STAGES, "scores"):
        n = parts if stage == "scores" else folders.get(stage, 0)
        there = n > 0
        req["get"] += 1 + (JSON_GET * n if stage != "scores" else 0)
        req["list"] += 1 + (lists(2 * n if stage != "scores" else n) if there else 0)
    req["get"] += min(SAMPLE_PARTS, parts) * parquet_get(part_bytes)
    req["get"] += sum(1 + stream_get(b) for b in files)  # is_file (HEAD), then streamed
    return req


def plan(est: Any) -> None:
    """The card reads the run folder the run will leave: a folder's markers, one per shard but where a
    stage said otherwise (`est.markers_of`); the reference and centroids as large as the run's M and K."""
    probe = est.probe
    folders = {k: est.markers_of.get(k, est.S) for k, v in probe.stats.items() if v}
    scale = {"reference.safetensors": est.m_r / max(1, est.m_p), "centroids.npy": est.k_r / est.k_p}
    files = [b * scale.get(name, 1.0) for name, b in probe.card_files.items()]
    part_bytes = probe.folder_bytes.get("scores", 0) * est.lin / max(1, est.S)
    req = card_requests(folders, est.S, part_bytes, files)
    est.fixed("card", est.seconds("card"), probe.folder_bytes.get("card.json", 0), req, run_stage="card")


STAGE = StageSpec("card", _write, reads=("embed",), per_shard=False, driver=True, plan=plan)

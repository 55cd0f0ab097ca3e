"""The embed stage of `hype score`: every shard's embeddings and pair scores (the per-shard work:
`hype.scoring.embed.EmbedStage`), with --metadata's uid index built first by the driver; its output is the
embedded pool (`Embedded`) the later stages read, its cost rows of `hype plan`, its fields of the summary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hype.scoring.config import ScoreConfig
from hype.scoring.context import RunContext, StageSpec, SummaryView
from hype.scoring.embed import EmbedStage, ModelRef
from hype.scoring.errors import ScoreError, ScoreFailed
from hype.scoring.pricing import ShardReads
from hype.scoring.rundir import ShardTask, fingerprint
from hype.scoring.summary import embed_fields

READS = ShardReads(tar=True)


@dataclass(frozen=True)
class EmbedSettings:
    """The settings of the embed stages (pool, class and evaluation images) that the config gives."""

    batch_size: int
    decode_workers: int
    decode: str
    prefetch_batches: int
    jpeg_draft: bool
    precision: str
    clip_txt: bool = False  # the pool's CLIP text embeddings too (embed.clip_txt)

    @classmethod
    def of(cls, cfg: ScoreConfig) -> EmbedSettings:
        e = cfg.embed
        return cls(
            cfg.batch_size,
            e.decode_workers,
            e.decode,
            e.prefetch_batches,
            e.jpeg_draft,
            cfg.precision,
            e.clip_txt,
        )

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Embedded:
    """The embedded pool, as the stages after embed see it (`drops`, `dups`: set by dedup)."""

    tasks: list[ShardTask]
    stats: list[dict]  # every shard's embed marker
    fingerprint: str  # of every shard's embed output
    rows: int  # embedded rows, duplicates included
    dims: dict  # feature widths: meru, clip
    curv: float
    K: float
    clip: ModelRef | None
    meru: ModelRef
    embed_kw: dict  # settings of the embed stages
    kw: dict  # settings of every stage
    drops: Any = None  # rows to leave out (`load_duplicates`)
    dups: dict | None = None  # the dedup step's info: digest, duplicates

    @property
    def unique(self) -> int:
        return self.rows - self.dups["duplicates"]


def _metadata(ctx: RunContext) -> dict | None:
    """The uid index of --metadata; with its .npz, its CLIP features and scores stand in for --clip."""
    cfg, run = ctx.cfg, ctx.run
    if cfg.metadata.dir is None:
        return None
    from hype.scoring.metadata import MetadataError, build_index, feature_source, metadata_files

    mc = cfg.metadata
    try:
        files = metadata_files(mc.dir)
        source, missing = feature_source(files, have_clip=cfg.clip is not None)
        if missing and len(missing) < len(files):
            ctx.warn(
                f"{len(missing)} of {len(files)} metadata files have no .npz (e.g. {missing[0]}): CLIP "
                "features and cos θ are computed with --clip for the whole pool"
            )
        score_column = mc.score_column if source == "npz" else None
        info = ctx.timed("metadata", lambda: build_index(mc.dir, run.metadata_index, score_column))
    except MetadataError as e:
        raise ScoreError(str(e)) from None
    ctx.metadata = {
        "dir": mc.dir,
        "files": len(files),
        "rows": info["rows"],
        "features": f".npz {mc.features_key}" if source == "npz" else "--clip",
        "cos_theta": score_column or "--clip",
    }
    return {
        "dir": mc.dir,
        "features_key": mc.features_key if source == "npz" else None,
        "index": info["fingerprint"],
    }


def embed(ctx: RunContext, settings: EmbedSettings, inputs: dict) -> Embedded:
    """Every shard's embeddings and pair scores (with --metadata, its uid index first)."""
    cfg, run, plan, tasks = ctx.cfg, ctx.run, ctx.plan, ctx.tasks
    meru, clip = ctx.model("meru"), ctx.model("clip")
    kw, embed_kw = ctx.stage_kwargs(), settings.kwargs()
    metadata = _metadata(ctx)
    stage = EmbedStage(run, meru=meru, clip=clip, metadata=metadata, **embed_kw, **kw)
    embed_stats = ctx.map(stage, tasks)
    ctx.check_failures("embed", plan)
    pool_rows = sum(s["output"]["rows"] for s in embed_stats)
    if pool_rows == 0:
        summary = ctx.summary(plan, status="failed", fields=embed_fields(embed_stats))
        reasons = summary["samples"]["skipped_by_reason"]
        raise ScoreFailed(
            f"no sample of the pool could be embedded (skipped: {reasons or 'none'}); see "
            f"{run.root}/embed/*_stats.json for examples",
            summary,
        )
    K = cfg.specificity.K if cfg.specificity.K is not None else next(s["K"] for s in embed_stats if "K" in s)
    return Embedded(
        tasks=tasks,
        stats=embed_stats,
        fingerprint=fingerprint([(t.shard_id, stage.upstream_digest("embed", t)) for t in tasks]),
        rows=pool_rows,
        dims=next(s["dims"] for s in embed_stats if "dims" in s),
        curv=next(s["curv"] for s in embed_stats if "curv" in s),
        K=K,
        clip=clip,
        meru=meru,
        embed_kw=embed_kw,
        kw=kw,
    )


def plan(est: Any) -> None:
    """--metadata's index (fixed), then the shards: both models read by each Ray worker."""
    est.embed_bytes = est.shard_bytes("embed")  # what the later stages read per shard
    if "metadata" in est.probe.summary.get("stages", {}):
        nbytes = est.probe.folder_bytes.get("metadata", 0)
        est.fixed("metadata index", est.seconds("metadata"), nbytes, run_stage="metadata")
    est.map(
        "embed",
        "embed",
        "samples",
        reads=READS,
        in_bytes=est.tar_bytes,
        more_requests=est.model_copies(2, est.S),
    )


def summary(view: SummaryView) -> dict:
    pool = view.outputs.get("embed")
    fresh = int((view.stages.get("embed") or {}).get("samples", 0))
    return embed_fields(pool.stats if pool else []) | {
        # Throughput of this invocation: samples embedded now (not those reused from an earlier run).
        "samples_per_s": round(fresh / view.seconds, 1) if view.seconds > 0 and fresh else None,
    }


# driver: --metadata's uid index
STAGE = StageSpec("embed", embed, EmbedSettings.of, driver=True, plan=plan, summary=summary)

"""The stages of `hype score`, in the order a run takes them: the one list the runner and the plan walk.

Each stage is declared in its own file (`StageSpec`: its per-shard work, driver step, `hype plan` rows and
summary fields); this list is data, the only place the stages are named together. A new stage is a new
file and one entry here, or, from outside hype (a test, a plug-in), `register(stage, after=...)`.

    embed        per shard   decode + MERU + CLIP (driver: --metadata's index)  -> embed/<id>.parquet
    dedup        driver      duplicate uids (keep the first)                  -> dedup/duplicates.parquet
    reference    driver + per shard + driver (HYPE §3.3), or --reference     -> reference.safetensors
    specificity  per shard   ε_i, ε_t                                         -> specificity/<id>.parquet
    classes      per class shard (--class-images) or --class-features read    -> classes/<id>.parquet
    captions     per shard   DataComp's caption filter (c_IN)                 -> captions/<id>.parquet
    clusters     driver k-means (or --centroids) + per shard                  -> clusters/<id>.parquet (c_IN)
    decontam     per eval shard + driver (--decontaminate)                    -> decontam/matches.parquet
    merge        per shard   THE scores table                                 -> scores/part-<index>.parquet
    neardup      per shard + per cluster group + driver (--neardup)           -> neardup/groups.parquet
    card         driver      digests of what the scores depend on, a sample  -> card.json
"""

from __future__ import annotations

from hype.scoring import (
    card,
    stage_clusters,
    stage_decontam,
    stage_dedup,
    stage_embed,
    stage_merge,
    stage_neardup,
    stage_reference,
    stage_specificity,
)
from hype.scoring.config import ScoreConfig
from hype.scoring.context import StageSpec

STAGES: tuple[StageSpec, ...] = (
    stage_embed.STAGE,
    stage_dedup.STAGE,
    stage_reference.STAGE,
    stage_specificity.STAGE,
    stage_clusters.CLASSES,
    stage_clusters.CAPTIONS,
    stage_clusters.CLUSTERS,
    stage_decontam.STAGE,
    stage_merge.STAGE,
    stage_neardup.STAGE,
    card.STAGE,
)
BUILT_IN = frozenset(
    s.name for s in STAGES
)  # their folders are the run directory's own (rundir.SHARD_STAGES)


def register(stage: StageSpec, *, after: str) -> None:
    """Add `stage` to `STAGES` right after the stage named `after` (it may read that one and those
    before it); a name taken, or an `after` that is not a stage, is refused."""
    global STAGES
    names = [s.name for s in STAGES]
    if stage.name in names:
        raise ValueError(f"a stage named {stage.name!r} is registered already")
    if after not in names:
        raise ValueError(f"no stage named {after!r}; the stages: {', '.join(names)}")
    i = names.index(after) + 1
    STAGES = (*STAGES[:i], stage, *STAGES[i:])


def unregister(name: str) -> None:
    """Remove the stage named `name` (one `register` added)."""
    global STAGES
    STAGES = tuple(s for s in STAGES if s.name != name)


def active(cfg: ScoreConfig) -> list[StageSpec]:
    """The stages the config asks for, in order."""
    return [s for s in STAGES if s.when(cfg)]


def added_folders(cfg: ScoreConfig) -> tuple[str, ...]:
    """The per-shard folders of the registered stages this config runs: the run directory creates, cleans
    and cards them as it does the built-in stages' folders."""
    return tuple(s.name for s in active(cfg) if s.per_shard and s.name not in BUILT_IN)

"""`hype score`: ε_i, ε_t, −d_L, cos θ and c_IN for every sample of a pool -> a scores table."""

from __future__ import annotations

import json
import logging
import sys

import click

from hype.cli import executor_choice

EXIT_FAILED_SHARDS = 2


def print_plan(cfg, *, as_json: bool, probe_samples: int | None = None, count_tars: bool = False) -> dict:
    """Plan `cfg` (nothing is written to its run folder, whose lock is not taken) and print the plan."""
    from hype.scoring.decode import share_cores_with_decoders
    from hype.scoring.plan import PROBE_SAMPLES, PlanError, format_plan, plan_score

    share_cores_with_decoders()  # as `hype score` does, before torch starts its threads
    try:
        plan = plan_score(
            cfg,
            probe_samples=probe_samples or PROBE_SAMPLES,
            count_tars=count_tars,
            log=lambda m: click.echo(f"hype plan: {m}", err=True),
        )
    except PlanError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(plan, indent=2) if as_json else format_plan(plan))
    return plan


class _Warnings(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"hype score: {record.levelname.lower()}: {record.getMessage()}", err=True)


@click.command("score", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--pool",
    metavar="DIR_OR_PATTERN",
    help="Pool shards: a folder of .tar, 'dir/{00000000..00000127}.tar' or a glob; join several with '::'.",
)
@click.option(
    "--meru",
    metavar="CKPT",
    help="MERU scorer (hype .safetensors checkpoint; `hype convert` for released ones).",
)
@click.option(
    "--clip",
    metavar="CKPT",
    help="CLIP scorer for cos θ and c_IN (optional with --metadata and its .npz): a hype checkpoint, or an "
    "open_clip model as is (OpenAI's ViT-L-14.pt, a Hugging Face folder, an open_clip_train run).",
)
@click.option(
    "--out",
    metavar="RUN_DIR",
    help="Run directory (created; a rerun resumes it). A complete run given new shards in --pool grows: they "
    "are scored against its frozen reference sets, centroids and models.",
)
@click.option("--executor", type=executor_choice(), help="Where per-shard work runs [default: local].")
@click.option(
    "--ray-address",
    metavar="ADDR",
    help="Join a Ray cluster (host:port or auto); default starts a local Ray.",
)
@click.option(
    "--reference",
    "reference_file",
    metavar="FILE",
    help="Reference sets S_i/S_t (hype .safetensors or HYPE's released {img, txt} .pt) instead of "
    "selecting them from the pool.",
)
@click.option(
    "--class-features",
    metavar="FILE",
    help="(N, d) CLIP features of the reference classes (.npy or "
    ".safetensors) for c_IN, e.g. ImageNet-1k train.",
)
@click.option(
    "--class-images",
    metavar="DIR_OR_PATTERN",
    help="Webdataset tars of reference-class images (.jpg + .cls), embedded with --clip, for c_IN.",
)
@click.option(
    "--centroids",
    metavar="FILE",
    help="k-means centroids for c_IN instead of training them: DataComp's released "
    "<scale>_centroids_l14.pt, a (K, d) .npy or a flat faiss index.",
)
@click.option(
    "--metadata",
    metavar="DIR",
    help="DataComp metadata folder: <hash>.parquet lists the pool's uids; with the .npz, cos θ and CLIP "
    "features come from it, without them --clip computes both. MERU still embeds the images.",
)
@click.option(
    "--decontaminate",
    metavar="EVAL_DIR",
    help="Flag pool images that are copies of an evaluation image: CLIP nearest neighbours at cosine >= "
    "decontam.threshold, verified from pixels (--copy-threshold). EVAL_DIR holds the wds_<task>_test "
    "folders, or is one webdataset folder. Output: RUN_DIR/decontam/matches.parquet; `hype select --filter "
    "decontaminate` drops them.",
)
@click.option(
    "--copy-check/--no-copy-check",
    default=None,
    help="With --decontaminate: verify CLIP candidates with the pixel copy check (exact, re-encoded, "
    "resized, <=15%-cropped copies) [default: on]; off: the CLIP nearest neighbour alone decides.",
)
@click.option(
    "--copy-threshold",
    type=float,
    metavar="SIM",
    help="With --decontaminate: copy similarity at or above which a candidate is a copy [default: 0.94].",
)
@click.option("--device", metavar="cpu|cuda", help="Device of the models [default: auto].")
@click.option("--batch-size", type=int, help="Samples per forward pass [default: 256].")
@click.option(
    "--hinge", is_flag=True, default=None, help="ε_i/ε_t as the paper's hinged L_e instead of the raw energy."
)
@click.option(
    "--num-clusters", type=int, help="k-means clusters for c_IN [default: ~128 samples per centroid]."
)
@click.option(
    "--config",
    "config",
    metavar="NAME|PATH",
    default="default",
    show_default=True,
    help="Score preset (configs/score/NAME.yaml) or a YAML file.",
)
@click.option(
    "--neardup/--no-neardup",
    default=None,
    help="Near-duplicate images after merge (neardup.*): RUN_DIR/neardup/groups.parquet, for "
    "`hype select --filter dedup` [default: off].",
)
@click.option("--progress/--no-progress", default=None, help="Progress bars on stderr [default: on].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of text.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print what the run would cost (`hype plan`: time, device-hours, bytes, bucket requests, from a "
    "probe in a temporary folder) and exit; nothing is written to RUN_DIR and its lock is not taken.",
)
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def score(
    pool,
    meru,
    clip,
    out,
    executor,
    ray_address,
    reference_file,
    class_features,
    class_images,
    centroids,
    metadata,
    decontaminate,
    copy_check,
    copy_threshold,
    device,
    batch_size,
    hinge,
    num_clusters,
    config,
    neardup,
    progress,
    as_json,
    dry_run,
    overrides,
) -> None:
    """Score every sample of a pool with the HYPE terms and write the scores table.

    \b
    Examples:
      hype score --pool world/pool/shards --meru meru.safetensors --clip clip.safetensors \\
          --class-images world/eval/reference/train --out runs/score
      hype score --pool 'pool/{00000000..00001287}.tar' --meru meru.safetensors --metadata pool/metadata \\
          --class-features in1k_l14.npy --out runs/small --executor ray --ray-address auto --device cuda

    Stages (each resumable; a rerun skips finished shards): embed -> dedup -> reference -> specificity ->
    [classes] -> captions -> clusters -> [decontam, with --decontaminate] -> merge [-> neardup, with
    --neardup]. Output: RUN_DIR/scores/part-*.parquet (uid, eps_i,
    eps_t, neg_d_l, cos_theta, c_in, shard, key, text, width, height), RUN_DIR/summary.json, per-shard stats
    under RUN_DIR/<stage>/ (with --neardup: RUN_DIR/neardup/groups.parquet, for --filter dedup).

    Growing a pool: `hype score --pool NEW_SHARDS --out RUN` on a complete run scores only the new shards,
    with the run's frozen reference sets, centroids and models (others are refused); the result equals a
    run over all shards given `--reference RUN/reference.safetensors --centroids RUN/clusters/centroids.npy`.

    KEY=VALUE overrides any config field (reference.n_top=5000, executor.workers=8, clusters.backend=torch).
    """
    from hype.scoring.decode import share_cores_with_decoders

    share_cores_with_decoders()  # before torch starts its OpenMP threads
    from hype.config import ConfigError
    from hype.scoring.runner import ScoreError, ScoreFailed, run_score
    from hype.scoring.summary import format_summary

    cfg = score_config(config, overrides, **{k: v for k, v in locals().items() if k in OPTION_KEYS})
    if dry_run:
        print_plan(cfg, as_json=as_json)
        return

    handler = _Warnings(logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("hype", "pipelines")]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
        lg.propagate = False
    try:
        summary = run_score(cfg)
    except ScoreFailed as e:
        click.echo(json.dumps(e.summary, indent=2) if as_json else format_summary(e.summary))
        click.echo(f"hype score: error: {e}", err=True)
        sys.exit(EXIT_FAILED_SHARDS)
    except (ScoreError, ConfigError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))


# command-line option -> config field
OPTION_KEYS = {
    "pool": "pool",
    "meru": "meru",
    "clip": "clip",
    "out": "out",
    "executor": "executor.kind",
    "ray_address": "executor.ray_address",
    "reference_file": "reference.file",
    "class_features": "clusters.class_features",
    "class_images": "clusters.class_images",
    "centroids": "clusters.centroids",
    "metadata": "metadata.dir",
    "decontaminate": "decontam.eval_dir",
    "copy_check": "decontam.copy_check",
    "copy_threshold": "decontam.copy_threshold",
    "device": "device",
    "batch_size": "batch_size",
    "hinge": "specificity.hinge",
    "num_clusters": "clusters.num_clusters",
    "progress": "progress",
    "neardup": "neardup.enabled",
}


def score_config(config: str, overrides: tuple[str, ...] | list[str], **options):
    """The ScoreConfig of `hype score`'s (and `hype plan`'s) options: the preset, KEY=VALUE overrides, then
    the options given."""
    from hype.config import ConfigError
    from hype.scoring.config import load_score_config

    extra = [
        f"{OPTION_KEYS[name]}={json.dumps(value)}"  # JSON scalars are YAML scalars: paths stay strings
        for name, value in options.items()
        if value is not None
    ]
    try:
        return load_score_config(config, [*overrides, *extra])
    except ConfigError as e:
        raise click.UsageError(str(e)) from None

"""`hype download`: a pool's images from its DataComp metadata (img2dataset with DataComp's settings)."""

from __future__ import annotations

import json
import sys

import click

EXIT_FAILED_SHARDS = 2


@click.command("download", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--metadata",
    metavar="DIR_OR_PARQUET",
    help="DataComp metadata: a folder of .parquet files (uid, url, text, ...) or one .parquet file; a URL "
    "(s3://, hf://, ...) works too.",
)
@click.option(
    "--out",
    metavar="DIR",
    help="Shard folder (created; a rerun skips finished shards). May be a URL (s3://...): img2dataset writes "
    "there with hype's --storage-options.",
)
@click.option(
    "--distributor",
    type=click.Choice(["multiprocessing", "ray"]),
    help="img2dataset's distributor [default: multiprocessing].",
)
@click.option(
    "--ray-address",
    metavar="ADDR",
    help="Join a Ray cluster (host:port or auto); default starts a local Ray.",
)
@click.option(
    "--allow-private-network",
    is_flag=True,
    default=None,
    help="Also download from loopback, private and link-local addresses (e.g. a local test server); "
    "refused by default, including after redirects.",
)
@click.option("--processes", type=int, help="Download processes [default: 16].")
@click.option("--threads", type=int, help="Concurrent downloads per process [default: 128].")
@click.option("--timeout", type=float, help="Seconds per request [default: 10].")
@click.option("--retries", type=int, help="Extra attempts per url [default: 2].")
@click.option("--image-size", type=int, help="Resize target in pixels [default: 512].")
@click.option(
    "--resize-mode",
    type=click.Choice(["no", "border", "keep_ratio", "keep_ratio_largest", "center_crop"]),
    help="img2dataset resize mode [default: keep_ratio_largest, only if bigger].",
)
@click.option("--samples-per-shard", type=int, help="Samples per shard [default: 10000].")
@click.option(
    "--config",
    metavar="NAME|PATH",
    default="datacomp",
    show_default=True,
    help="Download preset (configs/download/NAME.yaml) or a YAML file.",
)
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr [default: on].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of text.")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def download(
    metadata,
    out,
    distributor,
    ray_address,
    allow_private_network,
    processes,
    threads,
    timeout,
    retries,
    image_size,
    resize_mode,
    samples_per_shard,
    config,
    progress,
    as_json,
    overrides,
) -> None:
    """Download the images of a pool from its metadata into webdataset shards, with img2dataset and
    DataComp's settings (512 px keep_ratio_largest, 10,000 samples per shard named 00000000.tar, uid in
    each sample's json, 2 retries).

    \b
    Examples:
      hype download --metadata datacomp_small/metadata --out datacomp_small/shards
      hype download --metadata world/pool/metadata --out pool_dl --allow-private-network   # a local server
      hype download --metadata meta --out shards --distributor ray --ray-address auto --threads 64

    A rerun on the same --out skips shards that have a _stats.json and retries the rest. Urls that point
    at (or redirect to, or resolve to) loopback, private or link-local addresses are refused and counted
    unless --allow-private-network. Output: OUT/00000000.tar (+ .parquet, _stats.json) per shard and
    OUT/_hype/summary.json (img2dataset's own log: OUT/_hype/img2dataset.log). KEY=VALUE overrides any
    config field (img2dataset.encode_quality=90, allowed_networks=10.2.0.0/16, ...).
    """
    from hype.cli import lock_output
    from hype.config import ConfigError
    from hype.download import DownloadError, format_summary, load_download_config, run_download

    options = (
        ("metadata", metadata),
        ("out", out),
        ("distributor", distributor),
        ("ray_address", ray_address),
        ("allow_private_network", allow_private_network),
        ("img2dataset.processes_count", processes),
        ("img2dataset.thread_count", threads),
        ("img2dataset.timeout", timeout),
        ("img2dataset.retries", retries),
        ("img2dataset.image_size", image_size),
        ("img2dataset.resize_mode", resize_mode),
        ("img2dataset.number_sample_per_shard", samples_per_shard),
        ("progress", progress),
    )
    # JSON scalars are YAML scalars: paths stay strings
    extra = [f"{key}={json.dumps(value)}" for key, value in options if value is not None]
    try:
        cfg = load_download_config(config, [*overrides, *extra])
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if cfg.metadata is None or cfg.out is None:
        raise click.UsageError("missing --metadata or --out (or set them in the config)")
    lock_output(str(cfg.out), "download")
    try:
        summary = run_download(cfg)
    except DownloadError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))
    if summary["status"] != "complete":
        click.echo(
            f"hype download: error: {len(summary['shards']['failed'])} shard(s) failed; "
            "rerun the same command to retry them",
            err=True,
        )
        sys.exit(EXIT_FAILED_SHARDS)

"""`hype reshard`: training shards for a subset, in DataComp's resharder layout."""

from __future__ import annotations

import json
from dataclasses import dataclass

import click

from hype.cli import executor_choice
from hype.executor import ExecutorConfig


@click.command("reshard")
@click.option(
    "--pool", required=True, help="Pool shards: a folder of .tar, a brace pattern, a glob or one .tar."
)
@click.option(
    "--subset",
    required=True,
    type=click.Path(dir_okay=False),
    help="DataComp subset file (.npy or raw memmap).",
)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for the output shards.")
@click.option("--shard-size", default=10000, show_default=True, type=int, help="Samples per output shard.")
@click.option(
    "--workers",
    type=int,
    help="Processes (1: in this process) [default: 4]; with --executor ray: Ray actors [default: as many "
    "as the cluster fits].",
)
@click.option(
    "--executor",
    type=executor_choice(),
    default="local",
    show_default=True,
    help="Where both passes run: local (--workers processes here) or ray (actors on a Ray cluster that sees "
    "--pool and --out at the same paths).",
)
@click.option(
    "--ray-address",
    metavar="ADDR",
    help="Join a Ray cluster (host:port or auto); default starts a local Ray.",
)
@click.option("--overwrite", is_flag=True, help="Replace the shards of another reshard in --out.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print meta.json instead of a text summary.")
def reshard(
    pool: str,
    subset: str,
    out: str,
    shard_size: int,
    workers: int | None,
    executor: str,
    ray_address: str | None,
    overwrite: bool,
    progress: bool,
    as_json: bool,
) -> None:
    """Copy the pool samples of a subset into new shards, like DataComp's resharder.py.

    Each sample is written once per occurrence of its uid in the subset, keyed <uid>-<j>; every output
    shard gets a _stats.json after it has been read back and checked; meta.json (counts, uids missing from
    the pool, skipped samples) is written last. An interrupted run resumes where it stopped. With
    --executor ray, both passes (index the pool's tars, write the output shards) run on Ray actors and
    write the same bytes as a local run.
    """
    from hype.cli import lock_output
    from hype.reshard import reshard as run
    from hype.select.errors import SelectError

    lock_output(out, "reshard")
    ctx = click.get_current_context()
    runner = ctx.with_resource(_executor(executor, ray_address, workers))
    try:
        meta = run(
            pool,
            subset,
            out,
            shard_size=shard_size,
            workers=4 if workers is None else workers,
            overwrite=overwrite,
            progress=progress,
            executor=runner,
        )
    except SelectError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(meta, indent=2))
        return
    skipped = sum(meta["skipped"].get("counts", {}).values())
    lines = [
        f"resharded {meta['output_samples']:,} samples ({meta['matched_samples']:,} pool samples x their "
        "subset "
        f"multiplicity) into {meta['output_shards']} shard(s) in {out}"
        + (" (already complete)" if meta.get("resumed") else ""),
        f"  pool: {meta['input_samples']:,} samples in {meta['input_shards']} shard(s); skipped {skipped}",
        f"  subset: {meta['subset_rows']:,} rows, {meta['subset_unique']:,} unique uids, "
        f"{meta['missing_uids']:,} not in the pool",
        f"  written {meta['shards_written']} shard(s), {meta['shards_resumed']} done before; "
        "verified by reading back",
        f"  {out}/meta.json",
    ]
    click.echo("\n".join(lines))


@dataclass(frozen=True)
class _ExecutorSettings:
    """What an executor plug-in's `from_config` reads: the `executor` section and the device."""

    executor: ExecutorConfig
    device: str = "cpu"  # resharding copies bytes: no GPU


def _executor(kind: str, ray_address: str | None, workers: int | None):
    """The executor of both passes, as a context manager: None (reshard's own pool of --workers local
    processes) for an in-process executor (`local`), else the plug-in built from the same `executor`
    settings `hype score` reads."""
    from contextlib import nullcontext

    from hype.config import ConfigError
    from hype.executor import make_executor

    options = {} if ray_address is None else {"ray_address": ray_address}
    if workers is not None and workers < 1:
        raise click.UsageError(f"--workers must be >= 1, got {workers}")
    try:
        settings = ExecutorConfig(kind=kind, workers=workers or 0, options=options)
        if settings.foreign():
            raise click.UsageError(
                f"--ray-address is not a setting of --executor {kind}; it is for --executor ray"
            )
        if settings.plugin().in_process:
            return nullcontext()
        return make_executor(_ExecutorSettings(settings))
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    except (RuntimeError, ConnectionError, ValueError) as e:
        raise click.ClickException(f"--executor {kind}: {e}") from None

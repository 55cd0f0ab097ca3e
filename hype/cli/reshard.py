"""`hype reshard`: training shards for a subset, in DataComp's resharder layout."""

from __future__ import annotations

import json

import click


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
@click.option("--workers", default=4, show_default=True, type=int, help="Processes (1: in this process).")
@click.option("--overwrite", is_flag=True, help="Replace the shards of another reshard in --out.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print meta.json instead of a text summary.")
def reshard(
    pool: str,
    subset: str,
    out: str,
    shard_size: int,
    workers: int,
    overwrite: bool,
    progress: bool,
    as_json: bool,
) -> None:
    """Copy the pool samples of a subset into new shards, like DataComp's resharder.py.

    Each sample is written once per occurrence of its uid in the subset, keyed <uid>-<j>; every output
    shard gets a _stats.json after it has been read back and checked; meta.json (counts, uids missing from
    the pool, skipped samples) is written last. An interrupted run resumes where it stopped.
    """
    from hype.cli import lock_output
    from hype.reshard import reshard as run
    from hype.select.errors import SelectError

    lock_output(out, "reshard")
    try:
        meta = run(
            pool, subset, out, shard_size=shard_size, workers=workers, overwrite=overwrite, progress=progress
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

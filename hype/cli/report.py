"""`hype report`: an HTML report of a scored pool and a subset."""

from __future__ import annotations

import json

import click


@click.command("report")
@click.option(
    "--scores", required=True, type=click.Path(), help="Run directory of `hype score` (or its scores/)."
)
@click.option(
    "--subset",
    default=None,
    type=click.Path(dir_okay=False),
    help="Subset file (.npy) to compare with the pool.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False),
    help="HTML file to write, e.g. report.html or s3://bucket/report.html.",
)
@click.option(
    "--pool", default=None, help="Folder of the pool shards, if they moved since scoring (thumbnails)."
)
@click.option(
    "--per-bucket", default=6, show_default=True, type=int, help="Thumbnails per 20% percentile bucket."
)
@click.option(
    "--gallery",
    default=6,
    show_default=True,
    type=int,
    help="Dropped samples shown per main deficit (the term below its pool median at the lowest pool "
    "percentile; the selection subset.json records, redone on the scores); 0: no gallery.",
)
@click.option("--bins", default=40, show_default=True, type=int, help="Histogram bins per metric.")
@click.option("--workers", default=2, show_default=True, type=int, help="Threads reading Parquet.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of text.")
def report(
    scores: str,
    subset: str | None,
    out: str,
    pool: str | None,
    per_bucket: int,
    gallery: int,
    bins: int,
    workers: int,
    progress: bool,
    as_json: bool,
) -> None:
    """Write one self-contained HTML page: metric histograms of pool vs subset, their correlations,
    thumbnails per 20% percentile bucket of eps_i and eps_t, and the run's and the selection's summaries;
    with --subset, each term's cut-off, dropped samples by main deficit and the audits of the cut.
    No script, no external resource: open it anywhere, attach it to a review."""
    from hype.cli import lock_output
    from hype.report import write_report
    from hype.select.errors import SelectError

    if per_bucket < 0 or gallery < 0 or bins < 2 or workers < 1:
        raise click.UsageError("--per-bucket and --gallery must be >= 0, --bins >= 2 and --workers >= 1")
    lock_output(out, "report")
    try:
        info = write_report(
            scores,
            out,
            subset=subset,
            pool=pool,
            per_bucket=per_bucket,
            gallery=gallery,
            bins=bins,
            workers=workers,
            progress=progress,
        )
    except SelectError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    t = info["thumbnails"]
    missing = sum(v for k, v in t.items() if k != "shown")
    lines = [
        f"wrote {info['out']} ({info['bytes'] / 1e6:.2f} MB): {info['pool_rows']:,} scored samples"
        + (
            f", subset of {info['subset_rows']:,} ({info['subset_in_scores']:,} in the scores)"
            if subset
            else ""
        ),
        f"  {len(info['metrics'])} metric histograms, correlations, {t['shown']} thumbnails"
        + (f" ({missing} unavailable: pass --pool if the shards moved)" if missing else ""),
        "  run summary: " + ("included" if info["run_summary"] else "none found (summary.json)"),
    ]
    if subset:
        cut = sum(v is not None for v in info["cutoffs"].values())
        lines.append(
            f"  selection: {cut} cut-off lines, {info['gallery']} dropped samples by main deficit, audits "
            + ("included" if info["audit"] else "none (select with --audit)")
        )
    click.echo("\n".join(lines))

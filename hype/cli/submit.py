"""`hype submit`: assemble and validate a DataComp submission folder."""

from __future__ import annotations

import json

import click


@click.command("submit")
@click.option(
    "--scale",
    required=True,
    type=click.Choice(["debug", "small", "medium", "large", "xlarge"]),
    help="DataComp scale.",
)
@click.option(
    "--subset",
    required=True,
    type=click.Path(dir_okay=False),
    help="Subset file the model was trained on (.npy, or DataComp's raw memmap layout).",
)
@click.option(
    "--eval-results",
    required=True,
    type=click.Path(dir_okay=False),
    help="eval_results.jsonl of the trained model on DataComp's benchmark (hype eval --tasks all).",
)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Submission folder to write.")
@click.option("--method-name", default=None, help="Name shown on the leaderboard [default: hype (<preset>)].")
@click.option(
    "--scores",
    default=None,
    type=click.Path(),
    help="Run directory of `hype score`: check every uid is in the pool.",
)
@click.option("--overwrite", is_flag=True, help="Replace a submission already in --out.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print submission.json instead of a text summary.")
def submit(
    scale: str,
    subset: str,
    eval_results: str,
    out: str,
    method_name: str | None,
    scores: str | None,
    overwrite: bool,
    progress: bool,
    as_json: bool,
) -> None:
    """Write OUT/<scale>_scale/{samples/<subset file>, results.jsonl, submission.json} (the paths DataComp's
    evaluate.py --submit uploads) after checking the subset (dtype u8,u8, sorted, within the scale's pool,
    and with --scores: every uid in the pool) and the results as DataComp reads them (each of its 38 scored
    tasks once, under its key, display name and main metric; no synthetic-world results)."""
    from hype.cli import lock_output
    from hype.select.errors import SelectError
    from hype.submit import make_submission

    lock_output(out, "submit")
    try:
        meta = make_submission(
            scale,
            subset,
            eval_results,
            out,
            method_name=method_name,
            scores=scores,
            overwrite=overwrite,
            progress=progress,
        )
    except SelectError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(meta, indent=2))
        return
    r, s = meta["results"], meta["subset"]
    avg = "n/a" if r["average"] is None else f"{r['average']:.4f}"
    lines = [
        f"submission '{meta['method_name']}' ({scale} scale) written to {meta['folder']}",
        f"  subset: {s['rows']:,} uids ({s['unique']:,} unique), sorted u8,u8"
        + (", all in the pool's scores" if meta["pool_check"] else " (pool not checked: pass --scores)"),
        f"  results: {r['tasks']} tasks ({r['scored_tasks']} scored), average main metric {avg}",
    ]
    click.echo("\n".join(lines))

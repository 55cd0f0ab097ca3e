"""`hype fit`: fit weights over score columns to a small labelled sample (hype.select.fit)."""

from __future__ import annotations

import json

import click


@click.command("fit", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--scores",
    "scores",
    required=True,
    multiple=True,
    metavar="RUN_DIR",
    help="The scored pool (a `hype score` run or its scores folder); repeat to read several runs as one.",
)
@click.option(
    "--labels",
    required=True,
    metavar="LABELS.parquet",
    help="A curator's labels: a Parquet with columns uid and keep (1 keep, 0 drop; true/false or keep/drop "
    "work too), a few hundred samples of the pool. Never evaluation results.",
)
@click.option("--label-column", default="keep", show_default=True, help="The labels' keep/drop column.")
@click.option(
    "--columns",
    default=None,
    metavar="C1,C2,...",
    help="Score columns to weight [default: the HYPE terms the table holds].",
)
@click.option("--folds", default=5, show_default=True, help="Cross-validation folds (stratified).")
@click.option("--l2", default=1.0, show_default=True, help="L2 penalty on the weights (not the intercept).")
@click.option("--seed", default=0, show_default=True, help="Seed of the folds.")
@click.option("--out", required=True, metavar="WEIGHTS.json", help="Where to write the weights file.")
@click.option("--json", "as_json", is_flag=True, help="Print the weights file instead of the text summary.")
def fit(
    scores: tuple[str, ...],
    labels: str,
    label_column: str,
    columns: str | None,
    folds: int,
    l2: float,
    seed: int,
    out: str,
    as_json: bool,
) -> None:
    """Fit weights over score columns to a small labelled sample: a logistic regression on the columns
    z-scored over the whole pool, k-fold cross-validated. Writes WEIGHTS.json (the weights, the
    normalization, the held-out accuracy and AUROC, and what the fit saw: the labels' digest, rows and
    columns) for `hype select --rank combine --weights WEIGHTS.json`.

    \b
    Example:
      hype fit --scores runs/score --labels labels.parquet --out weights.json
      hype select --scores runs/score --rank combine --weights weights.json --frac 0.2 --out s.npy
    """
    from hype.cli import lock_output
    from hype.io import write_json
    from hype.select.errors import SelectError
    from hype.select.fit import describe, fit_weights

    lock_output(out, "fit")
    cols = [c.strip() for c in columns.split(",") if c.strip()] if columns else None
    try:
        record = fit_weights(
            list(scores), labels, columns=cols, label_column=label_column, folds=folds, l2=l2, seed=seed
        )
    except SelectError as e:
        raise click.ClickException(str(e)) from None
    write_json(out, record)
    click.echo(json.dumps(record, indent=2) if as_json else f"{describe(record)}\nwrote {out}")

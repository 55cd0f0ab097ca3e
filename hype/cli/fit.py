"""`hype fit`: weights over score columns fitted to a small labelled sample (hype.select.fit) or chosen on a
proxy task set (hype.fit_proxy)."""

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
    default=None,
    metavar="LABELS.parquet",
    help="A curator's labels: a Parquet with columns uid and keep (1 keep, 0 drop; true/false or keep/drop "
    "work too), a few hundred samples of the pool. Never evaluation results.",
)
@click.option(
    "--proxy",
    default=None,
    metavar="PROXY_DIR",
    help="Instead of --labels: choose weights by training on each candidate's subset and scoring the model "
    "on this proxy task set (WORLD/proxy from `hype synth --proxy-size N`), never the evaluation tasks.",
)
@click.option("--data", default=None, metavar="POOL_SHARDS", help="--proxy: the pool's shards to train on.")
@click.option(
    "--work",
    default=None,
    metavar="DIR",
    help="--proxy: candidates' subsets and models [default: OUT.proxy].",
)
@click.option("--candidates", default=4, show_default=True, help="--proxy: weightings tried (Eq. 1 first).")
@click.option("--train-config", default="tiny-clip", show_default=True, help="--proxy: train preset.")
@click.option(
    "--samples-seen", default=None, type=int, help="--proxy: training budget [default: the preset's]."
)
@click.option("--train-seeds", default="0", show_default=True, help="--proxy: training seeds, e.g. 0,1.")
@click.option("--frac", default=0.2, show_default=True, help="--proxy: subset fraction of the pool.")
@click.option("--proxy-tasks", default="synthetic", show_default=True, help="--proxy: tasks (hype eval's).")
@click.option(
    "--eval-dir",
    "eval_dirs",
    multiple=True,
    metavar="DIR",
    help="--proxy: an evaluation tasks' folder the proxy must stay out of (besides the run's "
    "decontam.eval_dir and a world's eval/); repeatable.",
)
@click.option(
    "--train-set", "train_set", multiple=True, metavar="KEY=VALUE", help="--proxy: a training override."
)
@click.option(
    "--device", default=None, help="--proxy: train and evaluate on cpu or cuda [default: cuda if available]."
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
@click.option("--seed", default=0, show_default=True, help="Seed of the folds (--proxy: of the candidates).")
@click.option("--out", required=True, metavar="WEIGHTS.json", help="Where to write the weights file.")
@click.option("--json", "as_json", is_flag=True, help="Print the weights file instead of the text summary.")
def fit(
    scores: tuple[str, ...],
    labels: str | None,
    proxy: str | None,
    data: str | None,
    work: str | None,
    candidates: int,
    train_config: str,
    samples_seen: int | None,
    train_seeds: str,
    frac: float,
    proxy_tasks: str,
    eval_dirs: tuple[str, ...],
    train_set: tuple[str, ...],
    device: str | None,
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

    With --proxy instead of --labels: Eq. 1's weights and CANDIDATES-1 seeded points on the simplex, each
    selected (--frac, zscore), trained (--train-config at --samples-seen, each of --train-seeds) and
    evaluated on the proxy tasks only; the best proxy average wins. WEIGHTS.json records every candidate's
    proxy scores, the proxy folder's digest, the budget and the seeds. A proxy that is, holds or lies in
    an evaluation tasks' folder is refused.

    \b
    Examples:
      hype fit --scores runs/score --labels labels.parquet --out weights.json
      hype synth --out world --size 4000 --proxy-size 200
      hype fit --scores runs/score --proxy world/proxy --data world/pool/shards --out weights.json
      hype select --scores runs/score --rank combine --weights weights.json --frac 0.2 --out s.npy
    """
    from hype.cli import lock_output
    from hype.io import write_json
    from hype.select.errors import SelectError
    from hype.select.fit import describe, fit_weights

    if (labels is None) == (proxy is None):
        raise click.UsageError("give exactly one of --labels LABELS.parquet or --proxy PROXY_DIR")
    lock_output(out, "fit")
    cols = [c.strip() for c in columns.split(",") if c.strip()] if columns else None
    if proxy is not None:
        from hype.fit_proxy import ProxySearch, run_search
        from hype.fit_proxy import describe as describe_search

        if data is None:
            raise click.UsageError(
                "--proxy needs --data POOL_SHARDS: the pool's shards each candidate trains on"
            )
        try:
            seeds = [int(x) for x in train_seeds.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(
                f"{train_seeds!r}: integers separated by commas", param_hint="--train-seeds"
            ) from None
        search = ProxySearch(
            list(scores), data, proxy, work or f"{out}.proxy", columns=cols, candidates=candidates, seed=seed,
            train_seeds=seeds, preset=train_config, samples_seen=samples_seen, frac=frac, tasks=proxy_tasks,
            eval_dirs=list(eval_dirs), train_overrides=list(train_set), device=device,
        )  # fmt: skip
        try:
            record = run_search(search, echo=lambda line: click.echo(line, err=True))
        except SelectError as e:
            raise click.ClickException(str(e)) from None
        write_json(out, record)
        click.echo(json.dumps(record, indent=2) if as_json else f"{describe_search(record)}\nwrote {out}")
        return
    try:
        record = fit_weights(
            list(scores), labels, columns=cols, label_column=label_column, folds=folds, l2=l2, seed=seed
        )
    except SelectError as e:
        raise click.ClickException(str(e)) from None
    write_json(out, record)
    click.echo(json.dumps(record, indent=2) if as_json else f"{describe(record)}\nwrote {out}")

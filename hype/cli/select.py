"""`hype select`: keep the top fraction of a scored pool (HYPE, its ablations, DataComp baselines)."""

from __future__ import annotations

import json

import click


def _options(*options):
    """Apply click options in the order listed (`hype select` and `hype explain` share them)."""

    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f

    return apply


class RulesOption(click.Option):
    """An option whose help ends with the registered rules of one kind (`hype.select.rules.RULES`), read
    when the help is shown: a plug-in's rules are listed as soon as it is installed."""

    def __init__(self, *args, rule_kind: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.rule_kind, self.base_help = rule_kind, self.help or ""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        from hype.select.rules import rule_names

        self.help = f"{self.base_help} Registered: {', '.join(rule_names(self.rule_kind))}."
        return super().get_help_record(ctx)


# How much to keep, and the rule that ranks and filters: one definition for every command that redoes a
# selection.
TARGET_OPTIONS = _options(
    click.option(
        "--frac", type=str, default=None, help="Keep this fraction, in (0, 1], e.g. 0.2 (round half up)."
    ),
    click.option("--top-k", type=int, default=None, help="Keep exactly this many samples."),
    click.option("--threshold", type=float, default=None, help="Keep every eligible sample with score >= T."),
    click.option(
        "--keep-all", is_flag=True, help="Keep every sample that passes the filters (mask-only baselines)."
    ),
    click.option(
        "--frac-of",
        type=click.Choice(["pool", "eligible", "nominal"]),
        default="pool",
        show_default=True,
        help="--frac counts scored rows (pool), rows passing the filters (eligible) or the pool's "
        "metadata uids, downloaded or not (nominal: DataComp's baselines; needs --metadata or a run "
        "scored with --metadata).",
    ),
)
RULE_OPTIONS = _options(
    click.option(
        "--preset",
        default=None,
        help="Preset: configs/select/NAME.yaml or a YAML path [default: hype]. Presets: hype, no-c-in, "
        "no-cos, cos-only, specificity-only, eps-i-only, eps-t-only, random.",
    ),
    click.option(
        "--rank",
        default=None,
        cls=RulesOption,
        rule_kind="score",
        metavar="RULE[:K=V,...]",
        help="Ranking rule, e.g. random:seed=1.",
    ),
    click.option(
        "--weights",
        default=None,
        metavar="M=W,...",
        help="Weights of the hype rule, e.g. eps_i=1,eps_t=1,neg_d_l=1,cos_theta=1,c_in=1; unnamed metrics "
        "get 0.",
    ),
    click.option(
        "--normalize",
        type=click.Choice(["none", "zscore", "rank"]),
        default=None,
        help="Per-metric pool normalization before weighting [default: none].",
    ),
    click.option(
        "--filter",
        "filters",
        multiple=True,
        metavar="RULE[:K=V,...]",
        cls=RulesOption,
        rule_kind="mask",
        help="Mask applied before ranking (repeatable), e.g. basic, intersect:path=F.npy.",
    ),
    click.option(
        "--intersect",
        multiple=True,
        type=click.Path(dir_okay=False),
        help="Only uids in this subset file are eligible (repeatable).",
    ),
    click.option("--seed", type=int, default=None, help="Seed of --rank random."),
)
METADATA_OPTION = click.option(
    "--metadata",
    type=click.Path(),
    default=None,
    help="The pool's DataComp metadata folder (<hash>.parquet): its uid count is the nominal pool (--frac-of "
    "nominal) and its URLs give the per-domain audit [default: the one the run was scored with].",
)


@click.command("select")
@click.option(
    "--scores",
    required=True,
    multiple=True,
    type=click.Path(),
    help="Run directory of `hype score` (or its scores/). Repeat to select over several runs as one table "
    "(a uid in several is kept once: from the first run that has it).",
)
@click.option(
    "--out", required=True, type=click.Path(dir_okay=False), help="Subset file to write, e.g. subset.npy."
)
@TARGET_OPTIONS
@RULE_OPTIONS
@click.option(
    "--union",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Add every uid of this subset file after ranking (repeatable).",
)
@METADATA_OPTION
@click.option(
    "--audit",
    is_flag=True,
    help="Audit the cut (kept fraction per concept, language, size, domain) into subset.json and print it.",
)
@click.option("--workers", type=int, default=2, show_default=True, help="Threads reading Parquet.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of text.")
def select(
    scores: tuple[str, ...],
    out: str,
    frac: str | None,
    top_k: int | None,
    threshold: float | None,
    keep_all: bool,
    frac_of: str,
    preset: str | None,
    rank: str | None,
    weights: str | None,
    normalize: str | None,
    filters: tuple[str, ...],
    intersect: tuple[str, ...],
    union: tuple[str, ...],
    seed: int | None,
    metadata: str | None,
    audit: bool,
    workers: int,
    progress: bool,
    as_json: bool,
) -> None:
    """Select a subset of a scored pool and write it as a DataComp subset file.

    The default ranks by the paper's HYPE score (Eq. 1: eps_i + eps_t + neg_d_l + cos_theta + c_in, equal
    weights) and keeps exactly floor(F x scored rows + 1/2) samples for --frac F (round half up); ties
    are broken by uid. Next to OUT (e.g. subset.npy) it writes subset.parquet (the kept rows with their
    scores) and subset.json (the summary).

    \b
    Examples:
      hype select --scores run --frac 0.2 --out hype20.npy
      hype select --scores run --frac 0.2 --preset no-c-in --out no_cin20.npy
      hype select --scores run --frac 0.3 --preset cos-only --out clip30.npy
      hype select --scores run --frac 0.2 --intersect dfn.npy --out hype_dfn.npy
      hype select --scores run --keep-all --filter basic --out basic.npy
      hype select --scores run_a --scores run_b --frac 0.2 --out hype20.npy
    """
    from hype.cli import lock_output
    from hype.select import SelectError
    from hype.select.run import SelectRequest, format_summary, select_subset

    if workers < 1:
        raise click.BadParameter(f"must be >= 1, got {workers}", param_hint="--workers")
    lock_output(out, "select")
    req = SelectRequest(
        scores=scores[0] if len(scores) == 1 else list(scores),
        out=out,
        frac=frac,
        top_k=top_k,
        threshold=threshold,
        keep_all=keep_all,
        frac_of=frac_of,
        preset=preset,
        rank=rank,
        weights=weights,
        normalize=normalize,
        filters=list(filters),
        intersect=list(intersect),
        union=list(union),
        seed=seed,
        workers=workers,
        progress=progress,
        audit=audit,
        metadata=metadata,
    )
    try:
        summary = select_subset(req)
    except SelectError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(format_summary(summary))
    if audit:
        from hype.select.audit import format_audit

        click.echo(format_audit(summary["audit"]))

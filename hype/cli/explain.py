"""`hype explain`: why a sample was kept or dropped by a selection."""

from __future__ import annotations

import json
from pathlib import Path

import click

from hype.cli.select import RULE_OPTIONS, TARGET_OPTIONS


@click.command("explain")
@click.option(
    "--scores",
    type=click.Path(),
    default=None,
    help="Run directory of `hype score` (or its scores/) [default: the one --subset records].",
)
@click.option(
    "--subset",
    "subset_json",
    type=click.Path(dir_okay=False),
    default=None,
    help="The subset.json of a `hype select` (or its subset.npy): redo that selection (its k, rule and "
    "filters) instead of giving --frac/--top-k and the rule options.",
)
@TARGET_OPTIONS
@RULE_OPTIONS
@click.option("--uid", "uid_list", multiple=True, metavar="UID", help="A uid to explain (repeatable).")
@click.option(
    "--uids",
    "uids_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="A file of uids to explain: one per line, or a DataComp subset .npy.",
)
@click.option("--sample", type=int, default=0, help="Explain N rows drawn from the dropped (or --kept) ones.")
@click.option(
    "--dropped/--kept", "dropped", default=True, show_default=True, help="What --sample draws from."
)
@click.option("--sample-seed", type=int, default=0, show_default=True, help="Seed of --sample.")
@click.option("--workers", type=int, default=2, show_default=True, help="Threads reading Parquet.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def explain(
    scores: str | None,
    subset_json: str | None,
    uid_list: tuple[str, ...],
    uids_file: str | None,
    sample: int,
    dropped: bool,
    sample_seed: int,
    workers: int,
    progress: bool,
    as_json: bool,
    **selection,
) -> None:
    """Explain a selection's decision for some samples: each term's value, its pool percentile, its
    weighted contribution under the rule (after normalization), the total score, its rank against the
    cut-off, kept or not, and three answers to "why":

    \b
    - decisive: the term whose change to its pool median alone would flip the decision ("none alone"
      when no single term would: the usual answer for a dropped sample at a tight cut such as 20%);
    - main term: the term whose pool median would move the score the most (in score units, so the rule's
      weights and scales decide: under raw Eq. 1 a c_IN of 0 against a median of 10 wins it);
    - main deficit: of the terms below their pool median, the one in the lowest pool percentile (of its
      contribution): the signal most unusual for this sample, terms of any scale on one footing.

    It redoes the selection in select's streaming passes (nothing is written) plus one pass for the rows
    asked about and one for their ranks, so it works on any table `hype select` can read.

    \b
    Examples:
      hype explain --subset hype20.json --uid 0a1b...
      hype explain --scores run --frac 0.2 --sample 10 --dropped
      hype explain --scores run --frac 0.2 --preset no-c-in --uids questions.txt --json
    """
    from hype.select import SelectError
    from hype.select.explain import Wanted, explain_selection, format_rows
    from hype.select.run import SelectRequest

    if workers < 1:
        raise click.BadParameter(f"must be >= 1, got {workers}", param_hint="--workers")
    asked = bool(uid_list) + bool(uids_file) + bool(sample)
    if asked != 1:
        raise click.UsageError(
            "say which samples to explain: --uid U (repeatable), --uids FILE or --sample N"
        )
    if sample < 0:
        raise click.BadParameter(f"must be >= 1, got {sample}", param_hint="--sample")
    try:
        fields = _selection(scores, subset_json, selection)
        req = SelectRequest(out="unused.npy", workers=workers, progress=progress, **fields)
        wanted = Wanted(uids=_uids(uid_list, uids_file), sample=sample, dropped=dropped, seed=sample_seed)
        out = explain_selection(req, wanted)
    except SelectError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(format_rows(out["rows"], out["cut"], out["k"], out["eligible_rows"]))
    for u in out["missing"]:
        click.echo(
            f"\n{u}: not in the scores table (not scored: failed to download, skipped or not in the pool)"
        )
    for w in out["warnings"]:
        click.echo(f"warning: {w}")


def _selection(scores: str | None, subset_json: str | None, given: dict) -> dict:
    """The selection to redo: from --subset's subset.json, or from the options as `hype select` takes them."""
    from hype.select import SelectError
    from hype.select.explain import request_from_summary

    given = {k: (list(v) if isinstance(v, tuple) else v) for k, v in given.items()}
    if subset_json is None:
        if scores is None:
            raise SelectError("give --scores RUN (and --frac/--top-k), or --subset subset.json")
        return {"scores": scores, **given}
    path = Path(subset_json)
    if path.suffix == ".npy":
        path = path.with_suffix(".json")
    chosen = [k for k, v in given.items() if v not in (None, False, [], "pool")]
    if chosen:
        flags = ", ".join("--" + k.replace("_", "-") for k in chosen)
        raise SelectError(f"--subset redoes the selection {path} records; drop {flags} (or drop --subset)")
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SelectError(
            f"--subset {path}: cannot read the selection summary ({e}); pass the subset.json "
            "`hype select` wrote next to its subset.npy"
        ) from None
    recorded = summary.get("scores") if isinstance(summary, dict) else None
    names = [recorded] if isinstance(recorded, str) else recorded
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or "target" not in summary:
        raise SelectError(f"--subset {path}: not a subset.json written by `hype select`")
    return request_from_summary(summary, scores, str(path))


def _uids(uid_list: tuple[str, ...], uids_file: str | None):
    """The uids asked about as a sorted "u8,u8" array, or None."""
    import numpy as np

    from hype.data.uids import load_uid_file, normalize_uid, uids_to_array
    from hype.select import SelectError

    if not uid_list and not uids_file:
        return None
    if uids_file and uids_file.endswith(".npy"):
        return np.unique(load_uid_file(uids_file, "--uids"))
    lines = list(uid_list)
    if uids_file:
        try:
            lines = [ln.strip() for ln in Path(uids_file).read_text().splitlines() if ln.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise SelectError(f"--uids {uids_file}: cannot read it as text, one uid per line ({e})") from None
    uids = [normalize_uid(u) for u in lines]
    bad = [u for u, n in zip(lines, uids, strict=True) if n is None]
    if bad:
        where = f"--uids {uids_file}" if uids_file else "--uid"
        raise SelectError(f"{where}: {bad[0]!r} is not a uid (32 hexadecimal characters)")
    return uids_to_array(sorted(set(uids)))  # type: ignore[arg-type]

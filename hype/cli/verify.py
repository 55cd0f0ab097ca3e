"""`hype verify`: recompute a score card's sampled rows from the pool and compare."""

from __future__ import annotations

import json

import click


@click.command("verify")
@click.argument("card", type=click.Path(dir_okay=False))
@click.option("--pool", required=True, help="The pool's shards (folder, tar, brace pattern or URL).")
@click.option("--meru", default=None, help="The MERU checkpoint [default: the path the card records].")
@click.option("--clip", default=None, help="The CLIP checkpoint [default: the path the card records].")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option(
    "--precision",
    type=click.Choice(["auto", "fp32", "bf16", "fp16"]),
    default=None,
    help="Towers' precision [default: the run's].",
)
@click.option("--tolerance", type=float, default=None, help="Largest |difference| accepted per column.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(card, pool, meru, clip, device, precision, tolerance, as_json) -> None:
    """Check a published selection's scores: recompute the sampled rows of CARD (RUN_DIR/card.json,
    written by `hype score`) from the pool with the models it names, through the same stages, and compare
    each column with the card. The models must have the card's digests; `reference.safetensors` and
    `clusters/` must lie beside the card, as in the run directory. Exit status 1 when a column differs
    by more than the tolerance (default: 2e-3 in fp32, 0.05 when either side ran bf16 towers).

    \b
    Examples:
      hype verify runs/small/card.json --pool /data/pool
      hype verify published/card.json --pool /data/pool --meru meru.safetensors --clip clip.safetensors \\
          --device cuda --precision bf16
    """
    from hype.scoring.card import CardError, verify_card

    try:
        report = verify_card(
            card, pool, meru=meru, clip=clip, device=device, precision=precision, tolerance=tolerance
        )
    except CardError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in report["max_abs_diff"].items())
        verdict = "agrees" if report["ok"] else "DOES NOT AGREE"
        click.echo(
            f"hype verify: {report['card']} {verdict} ({report['rows']} sampled rows, "
            f"{report['found_in_pool']} found in the pool; {report['precision']} on {report['device']})\n"
            f"  max |difference|: {diffs}; c_IN flips: {report['c_in_flips']} "
            f"(tolerance {report['tolerance']})"
        )
        if report["missing"]:
            click.echo(f"  not in the pool: {', '.join(report['missing'])}")
    if not report["ok"]:
        raise SystemExit(1)

"""`hype verify`: recompute a score card's sampled rows from the pool and compare."""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.error
from pathlib import Path

import click

BUCKETS = ("s3", "gs", "gcs", "az", "abfs", "abfss")  # object stores, reached through their own endpoints


def _fetcher(folder: str, allow_private: bool):
    """`fetch(role, url)` for `verify_card`: a model URL the card names (data from whoever wrote the card)
    fetched through the download's network guard into `folder`: loopback, private and link-local
    addresses refused unless --allow-private-network, and only http(s) URLs."""
    from hype.download.network import NetworkPolicy, guarded_opener
    from hype.scoring.card import CardError

    def fetch(role: str, url: str) -> str:
        scheme = url.split("://", 1)[0].lower()
        if scheme in BUCKETS:
            return url  # a bucket: read with the user's own storage options, as for --pool
        if scheme not in ("http", "https"):  # ftp://, sftp://, ...: unguarded connections to any host
            raise CardError(
                f"the card's {role} model {url}: refused url scheme {scheme}:; pass --{role} FILE"
            )
        out = Path(folder) / f"{role}.model"
        try:
            with (
                guarded_opener(NetworkPolicy(allow_private)).open(url, timeout=60) as r,
                open(out, "wb") as f,
            ):
                shutil.copyfileobj(r, f, 1 << 20)
        except (OSError, urllib.error.URLError) as e:
            reason = getattr(e, "reason", None) or e
            raise CardError(f"the card's {role} model {url}: {reason}; or pass --{role} FILE") from None
        return str(out)

    return fetch


def _check_subset(card: str, subset: str) -> dict:
    """The selection SUBSET's record (SUBSET.json) describes, redone from the card's verified scores: the
    same bytes, or a CardError. Binds the published subset to the scores the card certifies."""
    from hype.io import read_json, sha256_file
    from hype.scoring.card import CardError
    from hype.select.errors import SelectError
    from hype.select.explain import request_from_summary
    from hype.select.run import SelectRequest, select_subset

    record = str(Path(subset).with_suffix(".json"))
    summary = read_json(record)
    if summary is None or "scores" not in summary:
        raise CardError(f"--subset {subset}: {record} (what `hype select` wrote beside it) is needed")
    with tempfile.TemporaryDirectory(prefix="hype-verify-subset-") as tmp:
        try:
            fields = request_from_summary(summary, str(Path(card).parent), record)
            redone = select_subset(SelectRequest(**fields, out=Path(tmp) / "subset.npy", progress=False))
            same = sha256_file(Path(tmp) / "subset.npy") == sha256_file(subset)
        except (SelectError, OSError, TypeError, KeyError, ValueError) as e:
            raise CardError(
                f"--subset {subset}: the selection {record} records cannot be redone ({e})"
            ) from None
    if not same:
        raise CardError(
            f"--subset {subset}: not the subset its record's selection gives from the card's scores: "
            "the subset or its record was altered"
        )
    return {"file": subset, "reproduced": True, "rows": redone.get("subset_rows")}


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
@click.option(
    "--subset",
    type=click.Path(dir_okay=False),
    default=None,
    help="A published subset.npy (with its subset.json): redo its selection from the card's scores, compare.",
)
@click.option(
    "--allow-private-network",
    is_flag=True,
    help="Also fetch the card's model URLs from loopback, private and link-local addresses.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(
    card, pool, meru, clip, device, precision, tolerance, subset, allow_private_network, as_json
) -> None:
    """Check a published selection's scores: recompute the sampled rows of CARD (RUN_DIR/card.json,
    written by `hype score`) from the pool with the models it names, through the same stages, and compare
    each column with the card. The models must have the card's digests; `reference.safetensors` and
    `clusters/` must lie beside the card, as in the run directory. Exit status 1 when a column differs
    by more than the tolerance (default: 2e-3 in fp32, 0.05 when either side ran bf16 towers).
    The scores parts and stage markers beside the card must have the digests it names; --subset also
    redoes the subset's selection from them. A card is not a signature: see README "Score cards".

    \b
    Examples:
      hype verify runs/small/card.json --pool /data/pool
      hype verify published/card.json --pool /data/pool --meru meru.safetensors --clip clip.safetensors \\
          --device cuda --precision bf16
      hype verify runs/small/card.json --pool /data/pool --subset sub/subset.npy
    """
    from hype.scoring.card import CardError, verify_card

    try:
        with tempfile.TemporaryDirectory(prefix="hype-verify-models-") as models:
            report = verify_card(
                card,
                pool,
                meru=meru,
                clip=clip,
                device=device,
                precision=precision,
                tolerance=tolerance,
                fetch=_fetcher(models, allow_private_network),
            )
        if subset is not None:
            if not report["scores_checked"]:
                raise CardError(
                    f"--subset {subset}: the scores table must lie beside {card} (RUN_DIR/scores)"
                )
            report["subset"] = _check_subset(card, subset)
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
        checked = [
            w
            for w, k in (("scores parts", "scores_checked"), ("stage digests", "stages_checked"))
            if report[k]
        ]
        click.echo(
            f"  checked against the card: {', '.join(checked) or 'the sample only'}"
            + (f"; subset {subset} reproduced" if subset else "")
        )
        if report["missing"]:
            click.echo(f"  not in the pool: {', '.join(report['missing'])}")
    if not report["ok"]:
        raise SystemExit(1)

"""Does `hype explain` blame the right term? The truth table's noise kind against the decisive term
(strict: the term whose change to its pool median alone would flip the decision), the main term (the term
holding the sample down the most in score units) and the main deficit (the term furthest below the pool
in percentile), for every dropped noisy sample of a synthetic world's scored pool.

    python bench/explain_confusion.py --world OUT/world --scores OUT/score [--frac 0.2]

OUT: a `hype run demo --until score out=OUT` folder (real scores of tiny trained scorers), or any world
with a scores table of its pool. Prints, per ranking rule, the confusion tables (markdown; rows: noise
kind, columns: term) and two shares of dropped noisy samples whose term fits the noise kind:

- the kind's own terms (misaligned -> -d_L or cos θ, underspecified text -> ε_t, underspecified image ->
  ε_i);
- those, and a term the sample is low on by construction, where the truth table says so: c_IN for an
  underspecified text whose caption fails DataComp's caption filter (`datacomp_caption_ok` on the truth
  table's caption: c_IN is 0 for it whatever the image); for an underspecified image that is blank or
  pixel noise (truth `image_kind`), which by construction shows no object while its caption names
  objects of another scene (`hype.synth.pool.plan_pool`), -d_L, cos θ and c_IN (no class object).
  A clutter image shows many objects, so the caption may match some: only ε_i counts for it.

Near duplicates have no per-sample term and are listed apart.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

import hype.filters  # noqa: F401  (registers the bundled rules)
from hype.data.uids import uids_to_array
from hype.select.explain import Wanted, explain_selection
from hype.select.run import SelectRequest
from hype.text.language import datacomp_caption_ok

OWN = {
    "misaligned": {"neg_d_l", "cos_theta"},
    "underspecified_text": {"eps_t"},
    "underspecified_image": {"eps_i"},
}
NO_OBJECT = ("blank", "noise")  # underspecified image kinds that show nothing their caption names
RULES = {
    "hype (Eq. 1, raw)": {},
    "hype, --normalize zscore": {"normalize": "zscore"},
    "hype, --normalize rank": {"normalize": "rank"},
    "no-c-in preset": {"preset": "no-c-in"},
}
COLUMNS = (
    ("decisive", "decisive term (strict)"),
    ("main", "main term (score units)"),
    ("deficit", "main deficit (pool percentile)"),
)


def by_construction(truth: pd.DataFrame) -> pd.Series:
    """Per uid, the terms that fit its noise kind: its own, and those the truth table makes it low on."""

    def fits(row) -> frozenset:
        terms = set(OWN.get(row.noise, ()))
        if row.noise == "underspecified_text" and not row.caption_ok:
            terms.add("c_in")
        if row.noise == "underspecified_image" and row.image_kind in NO_OBJECT:
            terms |= {"neg_d_l", "cos_theta", "c_in"}
        return frozenset(terms)

    t = truth.assign(caption_ok=datacomp_caption_ok(list(truth["caption"].fillna(""))))
    return t.apply(fits, axis=1)


def confusion(rows: pd.DataFrame, column: str) -> str:
    table = pd.crosstab(rows["noise"], rows[column].fillna("none"))
    head = "| noise | " + " | ".join(table.columns) + " |"
    lines = [head, "|---" * (len(table.columns) + 1) + "|"]
    lines += [f"| {kind} | " + " | ".join(str(v) for v in r) + " |" for kind, r in table.iterrows()]
    return "\n".join(lines)


def agreement(rows: pd.DataFrame, column: str, fits: pd.Series | None = None) -> tuple[int, int]:
    """(samples whose term fits, samples judged): the kind's own terms, or `fits` per uid."""
    judged = rows[rows["noise"].isin(list(OWN))]
    allowed = fits.loc[judged.index] if fits is not None else judged["noise"].map(OWN)
    hits = sum(term in ok for term, ok in zip(judged[column], allowed, strict=True))
    return hits, len(judged)


def kind_shares(dropped: pd.DataFrame, image_kind: pd.Series) -> str:
    """The main deficit's share naming the kind's own term, by kind, with the underspecified images split
    into those showing nothing (blank, noise) and clutter (#36's table)."""
    d = dropped.assign(image_kind=image_kind.reindex(dropped.index))
    groups = {
        "misaligned": d["noise"] == "misaligned",
        "underspecified text": d["noise"] == "underspecified_text",
        "underspecified image (blank, noise)": (d["noise"] == "underspecified_image")
        & d["image_kind"].isin(NO_OBJECT),
        "cluttered image": (d["noise"] == "underspecified_image") & (d["image_kind"] == "clutter"),
    }
    parts = []
    for name, mask in groups.items():
        g = d[mask]
        hits = sum(term in OWN[kind] for term, kind in zip(g["deficit"], g["noise"], strict=True))
        parts.append(f"{name} {hits}/{len(g)} ({100 * hits / max(len(g), 1):.0f}%)")
    return "main deficit = the kind's own term, by kind: " + "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", required=True)
    ap.add_argument("--scores", required=True)
    ap.add_argument("--frac", default="0.2")
    args = ap.parse_args()
    truth = pd.read_parquet(f"{args.world}/truth.parquet").set_index("uid")
    fits = by_construction(truth)
    uids = uids_to_array(sorted(truth.index))
    for name, extra in RULES.items():
        started = time.perf_counter()
        req = SelectRequest(scores=args.scores, out="unused.npy", frac=args.frac, progress=False, **extra)
        out = explain_selection(req, Wanted(uids=uids))
        rows = pd.DataFrame(out["rows"]).set_index("uid").join(truth["noise"])
        dropped = rows[~rows["kept"] & (rows["noise"] != "clean")].copy()
        dropped["main"] = dropped["main"].fillna("none")
        dropped["deficit"] = [d["term"] if isinstance(d, dict) else "none" for d in dropped["deficit"]]
        print(f"\n### {name}: {len(dropped)} dropped noisy samples of {len(rows)} scored")
        for column, what in COLUMNS:
            hits, n = agreement(dropped, column)
            more, _ = agreement(dropped, column, fits)
            print(
                f"\n{what}: the noise kind's own term for {hits} of {n} ({100 * hits / max(n, 1):.0f}%); "
                f"counting the terms the truth table makes it low on too, {more} "
                f"({100 * more / max(n, 1):.0f}%)\n"
            )
            print(confusion(dropped, column))
        print("\n" + kind_shares(dropped, truth["image_kind"]))
        kept = rows[rows["kept"]]
        share = (kept["noise"] == "clean").mean() if len(kept) else np.nan
        print(f"\n(kept: {len(kept)}, clean share {share:.2f}; {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()

"""Does `hype explain` blame the right term? The truth table's noise kind against the decisive term
(strict: the term whose change to its pool median alone would flip the decision) and the main term (the
term holding the sample down the most: the largest weighted shortfall below its pool median), for every
dropped noisy sample of a synthetic world's scored pool.

    python bench/explain_confusion.py --world OUT/world --scores OUT/score [--frac 0.2]

OUT: a `hype run demo --until score out=OUT` folder (real scores of tiny trained scorers), or any world
with a scores table of its pool. Prints, per ranking rule, the confusion tables (markdown) and the share
of dropped noisy samples whose term is the noise kind's (misaligned -> -d_L or cos θ, underspecified
text -> ε_t, underspecified image -> ε_i; near duplicates have no per-sample term and are listed apart).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

import filters  # noqa: F401  (registers the bundled rules)
from hype.data.uids import uids_to_array
from hype.select.explain import Wanted, explain_selection
from hype.select.run import SelectRequest

EXPECTED = {
    "misaligned": {"neg_d_l", "cos_theta"},
    "underspecified_text": {"eps_t"},
    "underspecified_image": {"eps_i"},
}
# c_IN holds DataComp's caption filter (English, > 1 token, > 5 characters) and its image clusters: a 0
# there is also a fair verdict on an underspecified caption or image.
WITH_C_IN = {
    "misaligned": {"neg_d_l", "cos_theta"},
    "underspecified_text": {"eps_t", "c_in"},
    "underspecified_image": {"eps_i", "c_in"},
}
RULES = {
    "hype (Eq. 1, raw)": {},
    "hype, --normalize zscore": {"normalize": "zscore"},
    "hype, --normalize rank": {"normalize": "rank"},
    "no-c-in preset": {"preset": "no-c-in"},
}


def confusion(rows: pd.DataFrame, column: str) -> str:
    table = pd.crosstab(rows["noise"], rows[column].fillna("none"))
    head = "| noise | " + " | ".join(table.columns) + " |"
    lines = [head, "|---" * (len(table.columns) + 1) + "|"]
    lines += [f"| {kind} | " + " | ".join(str(v) for v in r) + " |" for kind, r in table.iterrows()]
    return "\n".join(lines)


def agreement(rows: pd.DataFrame, column: str, expected: dict = EXPECTED) -> tuple[int, int]:
    judged = rows[rows["noise"].isin(list(expected))]
    hits = sum(term in expected[kind] for kind, term in zip(judged["noise"], judged[column], strict=True))
    return hits, len(judged)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", required=True)
    ap.add_argument("--scores", required=True)
    ap.add_argument("--frac", default="0.2")
    args = ap.parse_args()
    truth = pd.read_parquet(f"{args.world}/truth.parquet").set_index("uid")["noise"]
    uids = uids_to_array(sorted(truth.index))
    for name, extra in RULES.items():
        started = time.perf_counter()
        req = SelectRequest(scores=args.scores, out="unused.npy", frac=args.frac, progress=False, **extra)
        out = explain_selection(req, Wanted(uids=uids))
        rows = pd.DataFrame(out["rows"]).set_index("uid").join(truth)
        dropped = rows[~rows["kept"] & (rows["noise"] != "clean")].copy()
        dropped["main"] = dropped["main"].fillna("none")
        print(f"\n### {name}: {len(dropped)} dropped noisy samples of {len(rows)} scored")
        for column, what in (("decisive", "decisive term (strict)"), ("main", "main term")):
            hits, n = agreement(dropped, column)
            more, _ = agreement(dropped, column, WITH_C_IN)
            print(
                f"\n{what}: the noise kind's term for {hits} of {n} ({100 * hits / max(n, 1):.0f}%; "
                f"{more} = {100 * more / max(n, 1):.0f}% counting c_IN for underspecified text and images)\n"
            )
            print(confusion(dropped, column))
        kept = rows[rows["kept"]]
        share = (kept["noise"] == "clean").mean() if len(kept) else np.nan
        print(f"\n(kept: {len(kept)}, clean share {share:.2f}; {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()

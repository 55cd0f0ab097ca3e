"""`hype fit` on a scored synthetic world: weights fitted to the truth table's labels on a sample of the pool.

For each (rows, seed): `hype.synth.labels.curator_labels` labels `rows` pool samples (clean: keep, any
noise: drop), `hype fit` fits weights and reports its own cross-validation; then, on the pool samples the
fit never saw, the AUROC of clean against noise for the fitted weights, Eq. 1 and Eq. 1 with zscore, and
the clean fraction of each rule's top 20%. Only pool truth is used: never an evaluation task.

    hype run demo out=runs/demo --until score        # a scored world
    python bench/fit_labels.py --run runs/demo [--rows 100,300] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from hype.synth.labels import curator_labels
from hype.table.combine import PAPER_WEIGHTS, Combiner
from hype.table.schema import METRICS
from hype.table.stats import auroc


def rule_scores(columns: dict[str, np.ndarray], weights: dict[str, float], normalize: str) -> np.ndarray:
    combiner = Combiner(weights, normalize)
    combiner.observe(columns)
    combiner.finish_observe()
    return combiner.score(columns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a demo run: RUN/world and RUN/score")
    ap.add_argument("--rows", default="100,300")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--frac", type=float, default=0.2)
    args = ap.parse_args()
    df = pd.read_parquet(args.run / "score" / "scores").merge(
        pd.read_parquet(args.run / "world" / "truth.parquet", columns=["uid", "noise"]), on="uid"
    )
    clean = (df["noise"] == "clean").to_numpy()
    columns = {m: df[m].to_numpy() for m in METRICS}
    top = int(args.frac * len(df))
    fixed = {
        "eq1": rule_scores(columns, PAPER_WEIGHTS, "none"),
        "eq1_zscore": rule_scores(columns, PAPER_WEIGHTS, "zscore"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for rows in map(int, args.rows.split(",")):
            for seed in map(int, args.seeds.split(",")):
                labels = curator_labels(
                    args.run / "world", Path(tmp) / "labels.parquet", rows=rows, seed=seed
                )
                out = Path(tmp) / "weights.json"
                cmd = [sys.executable, "-m", "hype.cli", "fit", "--scores", str(args.run / "score")]
                subprocess.run(
                    [*cmd, "--labels", str(labels), "--out", str(out)], check=True, capture_output=True
                )
                record = json.loads(out.read_text())
                scores = {"fitted": rule_scores(columns, record["weights"], "zscore"), **fixed}
                unseen = ~df["uid"].isin(pd.read_parquet(labels)["uid"]).to_numpy()
                row = {
                    "rows": rows,
                    "seed": seed,
                    "cv_accuracy": round(record["fit"]["cv"]["accuracy"], 3),
                    "cv_auroc": round(record["fit"]["cv"]["auroc"], 3),
                    **{f"auroc_{k}": round(auroc(s[unseen], clean[unseen]), 3) for k, s in scores.items()},
                    **{
                        f"top_clean_{k}": round(float(clean[np.argsort(-s, kind="stable")[:top]].mean()), 3)
                        for k, s in scores.items()
                    },
                    "weights": {m: round(w, 3) for m, w in record["weights"].items()},
                }
                print(json.dumps(row))


if __name__ == "__main__":
    main()

"""`hype fit`: weights over score columns fitted to a curator's labels, never to evaluation results.

The labels are a small Parquet of `uid` -> keep (1) / drop (0) for samples of the scored pool (a few
hundred rows). Each column is z-scored with the whole pool's mean and population std (as `hype select
--normalize zscore` does), and an L2-regularised logistic regression is fitted by Newton's method in
float64: P(keep) = sigmoid(b + sum_c w_c z_c). Ranking the pool by sum_c w_c z_c is ranking it by the
fitted probability. k-fold cross-validation (stratified, folds drawn from the seed) reports the fit's
own held-out accuracy and AUROC; the final weights are fitted on every labelled row.

The weights file (JSON, `FORMAT`) holds the weights, the normalization and its pool statistics, the
cross-validation and what the fit saw: the labels file and its digest, rows per class, the columns and
the scores table. `hype select --rank combine --weights FILE` reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hype.data.uids import UidError, UidMultiset, arrow_to_pairs, pair_to_uid, sort_order
from hype.io import read_bytes, sha256_bytes, storage
from hype.select.errors import SelectError
from hype.table.reader import ScoresTable
from hype.table.stats import RunningStats, auroc

FORMAT = "hype-fit-weights/1"
KEEP_TEXT = {"keep": 1, "drop": 0}
# A labelled sample, not a pool: read whole, within these bounds.
MAX_LABEL_ROWS = 1_000_000
MAX_LABEL_BYTES = 256 << 20


def read_labels(path: str | PathLike, column: str = "keep") -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """(hi, lo, y, sha256 of the file) of a labels Parquet, sorted by uid: its `uid` column and `column`
    as 0/1 (bools and the words keep / drop too). Read once, size and rows checked before the table is
    decoded; every problem is one `SelectError` line naming the file and the fix."""
    try:
        if storage.size(path) > MAX_LABEL_BYTES:
            raise SelectError(
                f"--labels {path}: over {MAX_LABEL_BYTES >> 20} MiB; a labelled sample is small"
            )
        data = read_bytes(path)
        parquet = pq.ParquetFile(pa.BufferReader(data))
    except SelectError:
        raise
    except Exception as e:  # missing, unreadable, not Parquet: one line
        raise SelectError(f"--labels {path}: cannot be read as Parquet ({type(e).__name__}: {e})") from None
    names = parquet.schema_arrow.names
    missing = [c for c in ("uid", column) if c not in names]
    if missing:
        raise SelectError(
            f"--labels {path}: no column {' or '.join(map(repr, missing))} (it has {', '.join(names)}); a "
            f"labels file holds uid and {column} (1 keep, 0 drop), or pass --label-column"
        )
    if parquet.metadata.num_rows > MAX_LABEL_ROWS:
        raise SelectError(
            f"--labels {path}: {parquet.metadata.num_rows} rows; label a sample of at most {MAX_LABEL_ROWS}"
        )
    table = parquet.read(["uid", column])
    try:
        hi, lo = arrow_to_pairs(table.column("uid"), f"--labels {path}")
    except UidError as e:
        raise SelectError(str(e)) from None
    y = _zero_one(table.column(column), path, column)
    order = sort_order(hi, lo)
    hi, lo, y = hi[order], lo[order], y[order]
    dup = np.flatnonzero((hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1]))
    if len(dup):
        raise SelectError(f"--labels {path}: {len(dup)} uid(s) labelled twice; keep one label per uid")
    return hi, lo, y, sha256_bytes(data)


def _zero_one(values: pa.ChunkedArray, path: object, column: str) -> np.ndarray:
    out = []
    for v in values.to_pylist():
        label = KEEP_TEXT.get(v.strip().lower()) if isinstance(v, str) else v
        if not isinstance(label, (bool, int, float)) or label not in (0, 1):
            raise SelectError(
                f"--labels {path}: column {column!r} holds {v!r}; labels must be 1/0, true/false or keep/drop"
            )
        out.append(float(label))
    return np.array(out)


def gather(
    table: ScoresTable, hi: np.ndarray, lo: np.ndarray, columns: Sequence[str]
) -> tuple[np.ndarray, dict[str, dict[str, float]]]:
    """The labelled rows' values of `columns` (n x d, in the labels' order) and each column's pool mean
    and population std, in one pass over the table."""
    table.require(["uid", *columns], "hype fit")
    labelled = UidMultiset.from_unique(hi, lo, np.ones(len(hi), np.int64))
    x = np.full((len(hi), len(columns)), np.nan)
    stats = {c: RunningStats(hist_bits=1) for c in columns}
    for batch in table.iter_batches(["uid", *columns]):
        idx = labelled.find(*batch.uid_pairs())
        rows = idx >= 0
        for j, c in enumerate(columns):
            v = batch.numeric(c)
            stats[c].add(v)
            x[idx[rows], j] = v[rows]
    absent = np.flatnonzero(np.isnan(x).any(axis=1))
    if len(absent):
        example = pair_to_uid(int(hi[absent[0]]), int(lo[absent[0]]))
        raise SelectError(
            f"{len(absent)} of the {len(hi)} labelled uids are not in the scores table {table.source} (e.g. "
            f"{example}); label samples of the pool that was scored, or pass its run with --scores"
        )
    return x, {c: {"mean": s.mean, "std": s.std} for c, s in stats.items()}


def zscore(x: np.ndarray, norm: dict[str, dict[str, float]], columns: Sequence[str]) -> np.ndarray:
    """`x` with each column z-scored by the pool's statistics (a constant column maps to 0, as in select)."""
    z = np.zeros_like(x)
    for j, c in enumerate(columns):
        if norm[c]["std"] > 0:
            z[:, j] = (x[:, j] - norm[c]["mean"]) / norm[c]["std"]
    return z


def fit_logistic(z: np.ndarray, y: np.ndarray, l2: float = 1.0, iters: int = 100) -> tuple[np.ndarray, float]:
    """(w, b) minimising sum of log-losses + l2/2 |w|^2 (the intercept unpenalised), by Newton's method."""
    n, d = z.shape
    a = np.hstack([z, np.ones((n, 1))])
    theta = np.zeros(d + 1)
    penalty = np.full(d + 1, l2)
    penalty[-1] = 0.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(a @ theta)))
        grad = a.T @ (p - y) + penalty * theta
        hess = (a * (p * (1 - p))[:, None]).T @ a + np.diag(penalty) + 1e-12 * np.eye(d + 1)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.abs(step).max() < 1e-10:
            break
    return theta[:-1], float(theta[-1])


def folds_of(y: np.ndarray, k: int, seed: int) -> np.ndarray:
    """A fold number per row: each class shuffled by the seed and dealt round-robin (stratified)."""
    rng = np.random.default_rng(seed)
    fold = np.empty(len(y), np.int64)
    for cls in (0.0, 1.0):
        rows = rng.permutation(np.flatnonzero(y == cls))
        fold[rows] = np.arange(len(rows)) % k
    return fold


def cross_validate(z: np.ndarray, y: np.ndarray, k: int, seed: int, l2: float) -> dict:
    """Held-out accuracy (threshold 1/2) and AUROC of each fold's fit on the other folds."""
    per_class = min(int(y.sum()), int(len(y) - y.sum()))
    if per_class < k:
        raise SelectError(
            f"--folds {k}: the labels hold {per_class} sample(s) of the rarer class; label at least {k} kept "
            f"and {k} dropped samples, or lower --folds"
        )
    fold = folds_of(y, k, seed)
    acc, auc = [], []
    for f in range(k):
        test = fold == f
        w, b = fit_logistic(z[~test], y[~test], l2)
        logit = z[test] @ w + b
        acc.append(float(np.mean((logit > 0) == (y[test] == 1))))
        auc.append(auroc(logit, y[test] == 1))
    return {
        "folds": k,
        "accuracy": float(np.mean(acc)),
        "accuracy_std": float(np.std(acc)),
        "auroc": float(np.mean(auc)),
        "auroc_std": float(np.std(auc)),
        "per_fold": [{"accuracy": a, "auroc": u} for a, u in zip(acc, auc, strict=True)],
    }


def fit_weights(
    scores: str | PathLike | Sequence[str | PathLike],
    labels: str | PathLike,
    *,
    columns: Sequence[str] | None = None,
    label_column: str = "keep",
    folds: int = 5,
    l2: float = 1.0,
    seed: int = 0,
) -> dict:
    """The weights record (`FORMAT`) of a logistic fit of `labels` on `columns` of the scores table."""
    table = ScoresTable(scores)
    table.require_finished()
    columns = list(columns or table.present_metrics())
    if not columns:
        raise SelectError(f"{table.source}: no metric columns to fit; pass --columns")
    if folds < 2:
        raise SelectError(f"--folds {folds}: cross-validation needs at least 2 folds")
    hi, lo, y, digest = read_labels(labels, label_column)
    x, norm = gather(table, hi, lo, columns)
    z = zscore(x, norm, columns)
    cv = cross_validate(z, y, folds, seed, l2)
    w, b = fit_logistic(z, y, l2)
    return {
        "format": FORMAT,
        "weights": {c: float(v) for c, v in zip(columns, w, strict=True)},
        "normalize": "zscore",
        "normalization": norm,
        "intercept": b,
        "fit": {"method": "logistic", "l2": l2, "seed": seed, "cv": cv},
        "data": {
            "labels": str(labels),
            "labels_sha256": digest,
            "label_column": label_column,
            "rows": len(y),
            "keep": int(y.sum()),
            "drop": int(len(y) - y.sum()),
            "columns": columns,
            "scores": table.source,
            "scores_rows": table.num_rows,
        },
    }


def describe(record: dict) -> str:
    """A few lines for the terminal: held-out quality, then the weights."""
    cv, data = record["fit"]["cv"], record["data"]
    lines = [
        f"fitted on {data['rows']} labels ({data['keep']} keep, {data['drop']} drop) of {data['labels']}",
        f"{cv['folds']}-fold held-out accuracy {cv['accuracy']:.3f} ± {cv['accuracy_std']:.3f}, "
        f"AUROC {cv['auroc']:.3f} ± {cv['auroc_std']:.3f}",
        "weights (zscore over the pool): " + ", ".join(f"{c}={w:.4g}" for c, w in record["weights"].items()),
    ]
    return "\n".join(lines)

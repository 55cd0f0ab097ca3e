"""Soft-cap sampling (FLYT, Shechter & Carmon, NeurIPS 2025): which samples a run sees, drawn from scores.

When samples seen exceed a subset's size, DataComp repeats the subset evenly. FLYT instead draws a
multiset of `samples_seen` uids before training, in rounds: each round draws `round` distinct samples with
probability softmax(logits), then lowers the logit of each drawn sample by `penalty`, so a sample's
chance falls with every repeat (a soft cap); `cap` adds a hard one. Here logits = score / temperature.

The multiset is a DataComp subset file with repeats, trained on exactly as `--subset` is (the stream
yields a sample as often as its uid appears), so shards, ranks and workers need nothing new. It is a pure
function of (uid -> score, the settings, the seed): candidates are taken in uid order, so neither the
order of the table's parts nor a resume changes it.
"""

from __future__ import annotations

import numpy as np

from hype.data.subset_index import SubsetError, SubsetIndex
from hype.data.uids import UidMultiset, sort_order, to_structured
from hype.executor import available_memory
from hype.table.combine import hype_score
from hype.table.reader import ScoresTable
from hype.table.schema import METRICS
from hype.train.config import SamplerConfig

# Bytes per candidate while drawing (uid halves, score, logits, Gumbel keys, counts, sort order) and per
# draw (the multiset and its sorted copy).
_BYTES_PER_CANDIDATE = 64
_BYTES_PER_DRAW = 32


def softcap_counts(
    scores: np.ndarray,
    total: int,
    *,
    temperature: float = 1.0,
    penalty: float = 0.15,
    cap: int | None = None,
    round_size: int = 100_000,
    seed: int = 0,
) -> np.ndarray:
    """How often each sample is drawn (int64, summing to `total`) by soft-cap sampling over `scores`."""
    n = len(scores)
    if cap is not None and n * cap < total:
        raise SubsetError(
            f"sampler: {n} candidates x cap {cap} < {total} samples seen; raise sampler.cap or drop it"
        )
    logits = np.asarray(scores, np.float64) / temperature
    counts = np.zeros(n, np.int64)
    rng = np.random.default_rng([seed, 0x50F7CA9])  # its own stream: the data stream also uses `seed`
    drawn = 0
    while drawn < total:
        open_ = None if cap is None else counts < cap
        k = min(round_size, total - drawn, n if open_ is None else int(open_.sum()))
        # Gumbel-top-k: the k largest of logits + Gumbel noise are k draws without replacement with
        # probabilities softmax(logits), as drawing one at a time and renormalising (Vieira 2014).
        keys = logits + rng.gumbel(size=n)
        if open_ is not None:
            keys[~open_] = -np.inf
        chosen = np.argpartition(-keys, k - 1)[:k]
        counts[chosen] += 1
        logits[chosen] -= penalty
        drawn += k
    return counts


def draw_subset(
    cfg: SamplerConfig, total: int, seed: int, subset: SubsetIndex | None
) -> tuple[np.ndarray, dict]:
    """The sorted `"u8,u8"` multiset of `total` uids drawn from `cfg.scores` (candidates: the scored
    samples, or those of `subset` when given), and the record of the draw for the run summary."""
    table = ScoresTable(cfg.scores)
    table.require_finished()
    metric_cols = list(METRICS) if cfg.column == "hype" else [cfg.column]
    _check_memory(table.num_rows, total)
    his, los, scores = [], [], []
    within = None if subset is None else UidMultiset(subset.uids)
    for batch in table.iter_batches(["uid", *metric_cols]):
        hi, lo = batch.uid_pairs()
        keep = np.ones(len(hi), bool) if within is None else within.find(hi, lo) >= 0
        cols = {c: batch.numeric(c)[keep] for c in metric_cols}
        his.append(hi[keep])
        los.append(lo[keep])
        scores.append(hype_score(cols) if cfg.column == "hype" else np.asarray(cols[cfg.column], np.float64))
    hi, lo, score = np.concatenate(his), np.concatenate(los), np.concatenate(scores)
    if len(hi) == 0:  # only with a subset: a table has rows
        raise SubsetError(
            f"sampler: none of the uids of --subset {subset.source} are in the scores table {table.source}; "
            "pass the scores of the pool the subset was made from (sampler.scores)"
        )
    order = sort_order(hi, lo)
    hi, lo, score = hi[order], lo[order], score[order]
    counts = softcap_counts(
        score,
        total,
        temperature=cfg.temperature,
        penalty=cfg.penalty,
        cap=cfg.cap,
        round_size=cfg.round,
        seed=seed,
    )
    multiset = np.repeat(to_structured(hi, lo), counts)  # uid order kept: already sorted
    record = {
        "kind": cfg.kind,
        "scores": table.source,
        "within": None if subset is None else subset.source,
        "column": cfg.column,
        "candidates": len(hi),
        "drawn": int(counts.sum()),
        "unique": int(np.count_nonzero(counts)),
        "max_repeats": int(counts.max()),
    }
    return multiset, record


def _check_memory(candidates: int, total: int) -> None:
    need = candidates * _BYTES_PER_CANDIDATE + total * _BYTES_PER_DRAW
    free = available_memory()
    if free is not None and need > free:
        raise SubsetError(
            f"sampler: drawing {total} samples from up to {candidates} scored samples needs "
            f"~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free; lower samples_seen, sample from a "
            "smaller --subset, or use a machine with more memory"
        )


__all__ = ["draw_subset", "softcap_counts"]

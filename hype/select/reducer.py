"""Exact top-k selection over a partitioned Parquet table in bounded memory.

The ranking is total and deterministic: score descending, then uid ascending (as unsigned 128-bit).

Top-k takes two streaming passes and never holds the pool's scores:

1. *rank pass*: read the columns the rules need (not the uids), compute each eligible row's float64 score,
   map it to an order-preserving uint64 key and count keys per bin of their top 20 bits (an exact 8 MB
   histogram). Walking the bins from the top gives the bin that holds the k-th best row: rows in higher
   bins are in, rows in lower bins are out, and `m` more rows must come from that one bin.
2. *select pass*: read again with the uids; rows above the cut bin go straight to the output; rows in it
   are candidates, pruned to the best `m` by (key desc, uid asc) whenever their buffer grows past
   max(2m, 1M) rows. The survivors are the exact answer.

Memory: the histogram, a few row groups in flight, the candidate buffer (<= max(2m, 1M) rows) and the
output itself (16 bytes per kept uid for the subset file). Threshold selection (`score >= T`) is one pass.
Normalized scores (zscore/rank) add a statistics pass before these. Masks computed in the rank pass are
kept as bits (N/8 bytes) so that expensive filters (language ID) run once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import pyarrow as pa

from hype.select.errors import SelectError
from hype.select.rules import Rule
from hype.table.keys import bins64, key64, unkey64
from hype.table.reader import Batch, ScoresTable
from hype.table.stats import RunningStats

HIST_BITS = 20
_HIST_SHIFT = np.uint64(64 - HIST_BITS)
MIN_PRUNE_ROWS = 1 << 20


@dataclass(frozen=True)
class Target:
    """What to keep: the top `k` eligible rows, the top fraction `frac` of the pool's (or the eligible)
    rows, or every eligible row with score >= `threshold`."""

    k: int | None = None
    frac: Fraction | None = None
    frac_of: str = "pool"  # "pool" (all scored rows), "eligible" (rows that pass the filters) or "nominal"
    threshold: float | None = None
    nominal_rows: int | None = None  # the pool's metadata uids, downloaded or not (frac_of "nominal")

    def __post_init__(self):
        if sum(x is not None for x in (self.k, self.frac, self.threshold)) != 1:
            raise SelectError("give exactly one of --frac, --top-k, --threshold, --keep-all")
        if self.k is not None and self.k < 1:
            raise SelectError(f"--top-k {self.k}: the selection would be empty; ask for at least 1 sample")
        if self.frac is not None and not (0 < self.frac <= 1):
            raise SelectError(
                f"--frac {float(self.frac)} is outside (0, 1]; it is the fraction of samples to keep, "
                "e.g. --frac 0.2 for 20%"
            )
        if self.frac_of not in ("pool", "eligible", "nominal"):
            raise SelectError(f"--frac-of {self.frac_of!r}: expected 'pool', 'eligible' or 'nominal'")
        if self.frac_of == "nominal" and self.frac is not None and not self.nominal_rows:
            raise SelectError(
                "--frac-of nominal counts the pool's metadata uids: pass --metadata DIR (the DataComp "
                "metadata folder of the pool), or select from a run scored with --metadata"
            )
        if self.threshold is not None and math.isnan(self.threshold):
            raise SelectError("--threshold is NaN; give a number (or use --keep-all)")

    @property
    def ranked(self) -> bool:
        return self.threshold is None

    def count(self, rows: int) -> int:
        """k for a fraction of `rows`: round half up, computed exactly from the decimal fraction."""
        if self.k is not None:
            return self.k
        assert self.frac is not None
        k = math.floor(self.frac * rows + Fraction(1, 2))
        if k < 1:
            raise SelectError(
                f"--frac {float(self.frac)} of {rows} rows rounds to 0 samples: the selection would be "
                "empty; raise --frac or use --top-k"
            )
        return k


def parse_frac(value: float | str | Fraction) -> Fraction:
    """The fraction as the user wrote it (`0.2` is exactly 1/5, not the nearest double)."""
    try:
        return value if isinstance(value, Fraction) else Fraction(str(value))
    except (ValueError, ZeroDivisionError):
        raise SelectError(f"--frac {value!r} is not a number; e.g. --frac 0.2") from None


# sink(hi, lo, score, columns, uids): receives the kept rows; called with the rows above the cut in table
# order during the select pass (`uids`: their uid strings as read), then once with the rows chosen at the
# cut, best first (`uids` None: only the decoded pairs are kept for them).
Sink = Callable[[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray], "pa.Array | None"], None]


@dataclass
class ReduceResult:
    pool_rows: int
    eligible_rows: int
    kept_rows: int
    removed_by: dict[str, int]  # rule spec -> rows it removed (counted independently of other masks)
    cut_score: float | None  # score of the last kept row
    rows_at_cut_score: int  # eligible rows whose score equals cut_score
    kept_at_cut_score: int  # ... of which kept (uid order decides when this is smaller)
    k: int | None  # the number of rows asked for (ranked selections)
    passes: list[str] = field(default_factory=list)


def reduce(
    table: ScoresTable,
    ranker: Rule,
    masks: Sequence[Rule],
    target: Target,
    sink: Sink,
    *,
    carry: Iterable[str] = (),
    pool_stats: dict[str, RunningStats] | None = None,
    score_stats: RunningStats | None = None,
    workers: int = 2,
    progress: bool = True,
    eligible_bits: list[np.ndarray] | None = None,
    keep_spool: bool = False,
) -> ReduceResult:
    """Run the passes; `carry` columns are handed to the sink for kept rows; `pool_stats` (column -> stats)
    and `score_stats` (the ranking score) are updated with every row of the table. `eligible_bits`, when
    given (and masks are), receives each batch's eligibility as `np.packbits` (N/8 bytes: what the rank
    pass holds anyway), for a later pass that must not rerun expensive masks (`hype.select.explain`);
    `keep_spool` leaves what the passes downloaded from a bucket (and the open parts) for that pass: the
    caller then calls `table.release_spool()`."""
    run = _Reduction(
        table, ranker, masks, target, sink, carry, pool_stats or {}, score_stats, workers, progress
    )
    run.eligible_out = eligible_bits if masks else None
    try:
        run.statistics_pass()
        run.plan()
        if target.ranked:
            run.rank_pass()
        run.select_pass()
    except BaseException:
        table.release_spool()
        raise
    if not keep_spool:
        table.release_spool()
    # Parquet decoding leaves freed buffers cached in Arrow's allocator; the caller is about to sort the
    # kept uids, the peak of a selection: give that memory back first.
    pa.default_memory_pool().release_unused()
    run.take_cut()
    return run.result()


class _Reduction:
    """One `reduce` call: its inputs, the passes in the order they run, and what each pass leaves for the
    next (the cut found by the rank pass, the counts of the select pass)."""

    def __init__(
        self,
        table: ScoresTable,
        ranker: Rule,
        masks: Sequence[Rule],
        target: Target,
        sink: Sink,
        carry: Iterable[str],
        pool_stats: dict[str, RunningStats],
        score_stats: RunningStats | None,
        workers: int,
        progress: bool,
    ):
        self.table, self.ranker, self.masks, self.target, self.sink = table, ranker, masks, target, sink
        self.carry = list(dict.fromkeys(carry))
        self.pool_stats, self.score_stats = pool_stats, score_stats
        self.workers, self.progress = workers, progress
        self.passes: list[str] = []
        # What to keep: every row with score >= threshold, or (ranked) the rows with score >= upper and
        # the best m_needed rows in [lower, upper), the cut bin.
        self.threshold = target.threshold
        self.m_needed = 0
        self.lower = self.upper = math.inf
        self.cached_masks: list[np.ndarray] | None = None  # the rank pass's masks, as bits, per batch
        self.eligible_out: list[np.ndarray] | None = None  # `reduce(eligible_bits=...)`
        self.eligible_rows = table.num_rows
        # Counts of the select pass.
        self.candidates = _Candidates(0, self.carry)
        self.kept = 0
        self.cut_score = math.inf
        self.at_cut = 0
        self.rows_at_cut = 0

    def _batches(
        self, name: str, columns: list[str], check: list[str], last: bool = False
    ) -> Iterable[Batch]:
        """One pass over the table; every pass but the last keeps what it downloads from a bucket for the
        passes after it (`ScoresTable.iter_batches`' spool)."""
        self.passes.append(name)
        label = f"{name} pass" if self.progress else None
        return self.table.iter_batches(
            columns, workers=self.workers, progress=label, check=check, spool=not last
        )

    def statistics_pass(self) -> None:
        """Rules that normalize over the pool (zscore, rank) see every row first."""
        observers = [r for r in (self.ranker, *self.masks) if r.needs_pool_pass]
        if not observers:
            return
        cols = _cols(r.columns() for r in observers)
        for batch in self._batches("statistics", cols, check=cols):
            for r in observers:
                r.observe(batch)
        for r in observers:
            r.finish_observe()

    def plan(self) -> None:
        """The columns the rules read, their removal counts, and k when it is a fraction of the pool."""
        self.rule_cols = _cols([self.ranker.columns(), *(m.columns() for m in self.masks)])
        self.removed = {m.spec(): 0 for m in self.masks}
        target = self.target
        of = {"pool": self.table.num_rows, "nominal": target.nominal_rows}.get(target.frac_of)
        self.k = target.count(of) if target.ranked and of is not None else None

    def rank_pass(self) -> None:
        """Histogram the eligible rows' score keys, then find the cut bin in it."""
        hist = np.zeros(1 << HIST_BITS, dtype=np.int64)
        self.cached_masks = [] if self.masks else None
        self.eligible_rows = 0
        cols = _cols([self.rule_cols, list(self.pool_stats)])
        for batch in self._batches("rank", cols, check=self.rule_cols):
            _update_stats(self.pool_stats, batch)
            keep = _eligible(batch, self.masks, self.removed)
            if self.cached_masks is not None:
                self.cached_masks.append(np.packbits(keep))
            score = _score(self.ranker, batch)
            if self.score_stats is not None:
                self.score_stats.add(score)
            bins = bins64(score if keep is None else score[keep], HIST_BITS)
            self.eligible_rows += len(bins)
            hist += np.bincount(bins, minlength=len(hist))
        self._find_cut(hist)

    def _find_cut(self, hist: np.ndarray) -> None:
        k = self.k = self.target.count(self.eligible_rows) if self.k is None else self.k
        if k > self.eligible_rows:
            raise _too_few(k, self.eligible_rows, self.table.num_rows, self.masks)
        if k == self.eligible_rows:
            self.threshold = -math.inf  # every eligible row is in
            return
        above = np.cumsum(hist[::-1])  # above[i] = rows in the top i+1 bins
        j = int(np.searchsorted(above, k))  # first prefix reaching k
        cut_bin = len(hist) - 1 - j
        self.m_needed = k - (int(above[j - 1]) if j > 0 else 0)
        self.lower, self.upper = _bin_bounds(cut_bin)

    def select_pass(self) -> None:
        """Read again with the uids: rows above the cut go to the sink, rows in the cut bin are candidates."""
        ranked = self.target.ranked
        masks_cols = [] if self.cached_masks is not None else self.rule_cols
        cols = _cols([["uid"], self.ranker.columns(), masks_cols, self.carry])
        if not ranked:
            cols = _cols([cols, list(self.pool_stats), self.rule_cols])
        self.candidates = _Candidates(self.m_needed, self.carry)
        eligible_count = 0
        for i, batch in enumerate(self._batches("select", cols, check=self.rule_cols, last=True)):
            keep = self._keep(i, batch)
            score = _score(self.ranker, batch)
            if self.score_stats is not None and not ranked:
                self.score_stats.add(score)
            eligible_count += len(batch) if keep is None else int(keep.sum())
            self._take(batch, score, keep)
        if not ranked:
            self.eligible_rows = eligible_count

    def _keep(self, i: int, batch: Batch) -> np.ndarray | None:
        """Batch `i`'s eligible rows: computed now (threshold selections), or the rank pass's bits."""
        if not self.target.ranked:
            _update_stats(self.pool_stats, batch)
            keep = _eligible(batch, self.masks, self.removed)
            if self.eligible_out is not None and keep is not None:
                self.eligible_out.append(np.packbits(keep))
            return keep
        if self.cached_masks is None:
            return None
        bits = self.cached_masks[i]
        keep = np.unpackbits(bits, count=len(batch)).astype(bool)
        self.cached_masks[i] = None  # type: ignore[call-overload]  # free as we go
        if self.eligible_out is not None:
            self.eligible_out.append(bits)
        return keep

    def _take(self, batch: Batch, score: np.ndarray, keep: np.ndarray | None) -> None:
        if self.threshold is not None:
            definite = score >= self.threshold
            cand = None
        else:
            # Same as comparing key bins with the cut bin, on floats: cheaper than keys for every row.
            definite = score >= self.upper
            cand = score >= self.lower
            cand &= ~definite
        if keep is not None:
            definite &= keep
            if cand is not None:
                cand &= keep
        if definite.any():
            self._emit_definite(batch, definite, score[definite])
        if cand is not None and cand.any():
            sub = batch.filter(cand, ["uid", *self.carry])
            hi, lo = sub.uid_pairs()
            self.candidates.add(key64(score[cand]), hi, lo, score[cand], {c: sub.raw(c) for c in self.carry})

    def _emit_definite(self, batch: Batch, rows: np.ndarray, s: np.ndarray) -> None:
        if self.threshold is not None:  # the cut of a top-k selection is decided among the candidates
            lowest = float(s.min())
            if lowest < self.cut_score:
                self.cut_score, self.at_cut = lowest, 0
            self.at_cut += int((s == self.cut_score).sum())
        _emit(self.sink, batch, rows, s, self.carry)
        self.kept += len(s)

    def take_cut(self) -> None:
        """The best `m_needed` candidates go to the sink, best first; the cut score is the last one's."""
        self.rows_at_cut = self.at_cut
        if not self.m_needed:
            return
        best = self.candidates.best()
        self.kept += len(best["hi"])
        s = best["score"]
        self.cut_score = float(s[-1])
        kept_ties = int((s == self.cut_score).sum())
        dropped_ties = self.candidates.dropped_at(key64(np.array([self.cut_score]))[0])
        self.at_cut, self.rows_at_cut = kept_ties, kept_ties + dropped_ties
        self.sink(best["hi"], best["lo"], s, best["columns"], None)

    def result(self) -> ReduceResult:
        if self.kept == 0:
            raise SelectError(
                f"empty selection: no eligible row has score >= {self.target.threshold} "
                f"({self.eligible_rows} of {self.table.num_rows} rows passed the filters); lower --threshold"
            )
        if self.k is not None and self.kept != self.k:  # the algorithm's invariant; never expected
            raise AssertionError(f"selected {self.kept} rows, expected {self.k}")
        return ReduceResult(
            pool_rows=self.table.num_rows,
            eligible_rows=self.eligible_rows,
            kept_rows=self.kept,
            removed_by=self.removed,
            cut_score=None if math.isinf(self.cut_score) else self.cut_score,
            rows_at_cut_score=self.rows_at_cut,
            kept_at_cut_score=self.at_cut,
            k=self.k,
            passes=self.passes,
        )


def _bin_bounds(b: int) -> tuple[float, float]:
    """The float range [lower, upper) of scores whose key falls in bin `b`."""
    return _edge(b), _edge(b + 1)


def _edge(b: int) -> float:
    """Smallest float whose key is in bin `b`; bit patterns past the infinities (NaNs) become the infinity
    on their side, and the end of the key space +inf."""
    if b >= 1 << HIST_BITS:
        return math.inf
    key = np.uint64(b) << _HIST_SHIFT
    value = float(unkey64(key))
    if math.isnan(value):
        return math.inf if key >= np.uint64(1 << 63) else -math.inf
    return value


def _cols(groups: Iterable[Iterable[str]]) -> list[str]:
    return list(dict.fromkeys(c for g in groups for c in g))


def _update_stats(stats: dict[str, RunningStats], batch: Batch) -> None:
    for name, st in stats.items():
        st.add(batch.raw(name))


def _score(rule: Rule, batch: Batch) -> np.ndarray:
    score = np.asarray(rule.score(batch), dtype=np.float64)
    if score.shape != (len(batch),):
        raise AssertionError(f"rule {rule.name} returned {score.shape} scores for {len(batch)} rows")
    if not np.isfinite(score.sum()) and not np.isfinite(score).all():  # one cheap pass in the usual case
        i = int(np.flatnonzero(~np.isfinite(score))[0])
        raise SelectError(
            f"{batch.source}: rule {rule.name!r} gave a non-finite score ({score[i]}) at table row "
            f"{batch.first_row + i}; check the weights and the table's values"
        )
    return score


def _eligible(batch: Batch, masks: Sequence[Rule], removed: dict[str, int]) -> np.ndarray | None:
    if not masks:
        return None
    keep = np.ones(len(batch), dtype=bool)
    for rule in masks:
        m = np.asarray(rule.mask(batch), dtype=bool)
        removed[rule.spec()] += int((~m).sum())
        keep &= m
    return keep


def _emit(sink: Sink, batch: Batch, rows: np.ndarray, score: np.ndarray, carry: list[str]) -> None:
    sub = batch.filter(rows, ["uid", *carry])
    hi, lo = sub.uid_pairs()
    sink(hi, lo, score, {c: sub.raw(c) for c in carry}, sub.arrow("uid"))


def _too_few(k: int, eligible: int, pool: int, masks: Sequence[Rule]) -> SelectError:
    filters = " ".join(f"--filter {m.spec()}" for m in masks)
    return SelectError(
        f"only {eligible} of the {pool} scored rows pass the filters ({filters}), fewer than the {k} "
        "requested; lower --frac / --top-k, or pass --frac-of eligible to take the fraction of the "
        "eligible rows"
    )


class _Candidates:
    """The rows in the cut bin, pruned to the best `m` by (key desc, uid asc) as they stream in."""

    def __init__(self, m: int, carry: list[str]):
        self.m = m
        self.carry = carry
        self.parts: list[dict] = []
        self.size = 0
        self.limit = max(2 * m, MIN_PRUNE_ROWS)
        self._dropped: dict[int, int] = {}  # m-th best key at a prune -> dropped rows with that key

    def add(self, key, hi, lo, score, columns) -> None:
        self.parts.append({"key": key, "hi": hi, "lo": lo, "score": score, "columns": columns})
        self.size += len(key)
        if self.size > self.limit:
            self._prune()

    def _prune(self) -> None:
        merged = {k: np.concatenate([p[k] for p in self.parts]) for k in ("key", "hi", "lo", "score")}
        cols = {c: np.concatenate([p["columns"][c] for p in self.parts]) for c in self.carry}
        order = np.lexsort((merged["lo"], merged["hi"], ~merged["key"]))
        top, rest = order[: self.m], order[self.m :]
        if len(rest) and len(top):
            kth = int(merged["key"][top[-1]])
            dropped = int((merged["key"][rest] == kth).sum())
            if dropped:
                self._dropped[kth] = self._dropped.get(kth, 0) + dropped
        self.parts = [
            {
                "key": merged["key"][top],
                "hi": merged["hi"][top],
                "lo": merged["lo"][top],
                "score": merged["score"][top],
                "columns": {c: v[top] for c, v in cols.items()},
            }
        ]
        self.size = len(top)

    def best(self) -> dict:
        """The best `m` rows, best first."""
        self._prune()
        part = self.parts[0]
        if len(part["key"]) != self.m:
            raise AssertionError(f"{len(part['key'])} candidates at the cut, expected {self.m}")
        return part

    def dropped_at(self, key: np.uint64) -> int:
        """Rows pruned away whose key equals `key` (only possible while `key` was the m-th best)."""
        return self._dropped.get(int(key), 0)


def describe_cut(result: ReduceResult) -> dict:
    return {
        "score": result.cut_score,
        "rows_at_cut_score": result.rows_at_cut_score,
        "kept_at_cut_score": result.kept_at_cut_score,
    }

"""Why a row was kept or dropped: the per-term attribution of a selection (`hype explain`, and the
`decisions` that `hype select` writes into `subset.json`).

A score rule that is a sum of per-metric terms (`Rule.terms` / `Rule.contribution`: `hype`, `clip_score`,
`specificity`) gives every row one contribution per term (weight x normalized value) that add up to its
score bit for bit. Against the cut (ranked selections: the last kept row, by score descending then uid
ascending; threshold selections: `score >= T`):

- the *decisive term* of a row is the one whose change to its pool median alone would flip the decision:
  for a dropped row, the term whose median lifts it past the last kept row (the largest lift when several
  do); for a kept row, the one whose median sinks it below the best dropped row (the largest fall);
  `none alone` when no single term does;
- the *main term* is the term that moves the row furthest toward the other side at its median, flip or
  not (for a dropped row, the term holding it down the most, in score units: the rule's weights and
  scales decide, so a term with a wide raw range, such as c_IN's 0 or 10 under raw Eq. 1, wins it often);
- the *main deficit* is the term on which the row sits furthest below the pool: of the terms whose pool
  median would raise its score, the one with the lowest pool percentile of its contribution (the value's
  percentile; 100 minus it for a term with a negative weight). Percentiles put terms of different scales
  on one footing, so it names the signal that is most unusual for this sample whatever the rule's units;
  it does not weigh the terms beyond their sign (a term with weight 0 is never named). At a tight cut
  (keeping 20%) one term moved to its median rarely lifts a dropped row into the kept part, so the
  decisive term is mostly `none alone`: the main deficit and the main term then say what to look at.

Rows removed by a filter are decided by that filter (`filter:<spec>`). The pool median of a term is the
`p50` that `subset.json` reports for it (3 significant digits), percentiles come from the same streaming
histograms (within ~0.2%), so nothing here holds more than select's own memory. `subset.json`'s
`decisions` count, per term, the dropped rows it is the decisive term, the main term and the main deficit
of (one pass after the selection); select histograms the rule's terms even when it reads the pool's
statistics from its cache, which keeps only their quantiles.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hype.data.uids import UidMultiset, pair_to_uid, splitmix64
from hype.io import storage
from hype.select.reducer import Sink
from hype.select.request import build_rules, make_target
from hype.select.rules import RULES, Rule
from hype.table.reader import Batch, ScoresTable
from hype.table.stats import RunningStats

NONE_ALONE = "none alone"
MEDIAN_KEY = "p50"


class CutWatcher:
    """A reducer sink that hands rows on (to `sink`, if any) and remembers the last kept row: the lowest
    score, and of those the largest uid."""

    def __init__(self, sink: Sink | None = None):
        self.sink = sink
        self.score = math.inf
        self.uid: tuple[int, int] | None = None

    def __call__(self, hi, lo, score, columns, uids=None) -> None:
        if self.sink is not None:
            self.sink(hi, lo, score, columns, uids)
        if len(score) == 0:
            return
        s = float(score.min())
        at = np.flatnonzero(score == s)
        j = at[np.lexsort((lo[at], hi[at]))[-1]]
        uid = (int(hi[j]), int(lo[j]))
        if s < self.score or (s == self.score and self.uid is not None and uid > self.uid):
            self.score, self.uid = s, uid


@dataclass(frozen=True)
class Cut:
    """The decision boundary: a ranked cut (the last kept row's `score` and `uid`) or a threshold
    (`uid` None; -inf keeps every eligible row)."""

    score: float
    uid: tuple[int, int] | None = None

    def keeps(self, score: np.ndarray, hi: np.ndarray | None, lo: np.ndarray | None) -> np.ndarray:
        """Would rows with these scores and uids be kept (ranked at or above the last kept row)?"""
        if self.uid is None or hi is None or lo is None:
            return score >= self.score
        return (score > self.score) | ((score == self.score) & _uid_le(hi, lo, self.uid))

    def describe(self) -> dict:
        out: dict = {"score": None if math.isinf(self.score) else self.score}
        if self.uid is not None:
            out["uid"] = pair_to_uid(*self.uid)
        return out


def _uid_le(hi: np.ndarray, lo: np.ndarray, uid: tuple[int, int]) -> np.ndarray:
    h, low = np.uint64(uid[0]), np.uint64(uid[1])
    return (hi < h) | ((hi == h) & (lo <= low))


class Decider:
    """The contributions of a rule's terms, their values at the pool medians, and the decisive term."""

    def __init__(self, rule: Rule, medians: dict[str, float]):
        self.rule = rule
        self.terms = rule.terms()
        self.medians = {m: float(medians[m]) for m in self.terms}
        self.at_median = {
            m: float(rule.contribution(m, np.array([self.medians[m]], dtype=np.float32))[0])
            for m in self.terms
        }

    def contributions(self, batch: Batch) -> np.ndarray:
        """(terms, rows) float64; summed over axis 0 in order, each row's score."""
        return np.stack([self.rule.contribution(m, batch.raw(m)) for m in self.terms])

    def swapped(self, contrib: np.ndarray) -> np.ndarray:
        """(terms, rows): the score with term t at its pool median, summed in the rule's order."""
        out = np.empty_like(contrib)
        for t, name in enumerate(self.terms):
            total = np.zeros(contrib.shape[1])
            for j in range(len(self.terms)):
                total += self.at_median[name] if j == t else contrib[j]
            out[t] = total
        return out

    def decide_dropped(self, swapped, score, hi, lo, cut: Cut) -> tuple[np.ndarray, np.ndarray]:
        """(decisive, main) term index per dropped row (-1: none alone / no term lifts it)."""
        flips = np.stack([cut.keeps(s, hi, lo) for s in swapped])
        lifted = np.where(flips, swapped, -np.inf)
        decisive = np.where(flips.any(axis=0), lifted.argmax(axis=0), -1)
        return decisive, np.where(swapped.max(axis=0) > score, swapped.argmax(axis=0), -1)

    def decide_kept(
        self, swapped, score, hi, lo, first_dropped: tuple[float, int, int] | None, cut: Cut
    ) -> tuple[np.ndarray, np.ndarray]:
        """(decisive, main) per kept row: a term flips it when its median puts the row at or below the
        best dropped row (a threshold: below T)."""
        if cut.uid is None:
            flips = swapped < cut.score
        elif first_dropped is None:
            flips = np.zeros_like(swapped, dtype=bool)  # nothing was dropped: nothing to fall below
        else:
            d, dh, dl = first_dropped
            above = (swapped > d) | ((swapped == d) & ~_uid_le(hi, lo, (dh, dl)))
            flips = ~above
        sunk = np.where(flips, swapped, np.inf)
        decisive = np.where(flips.any(axis=0), sunk.argmin(axis=0), -1)
        return decisive, np.where(swapped.min(axis=0) < score, swapped.argmin(axis=0), -1)

    def name(self, i: int) -> str:
        return self.terms[i] if i >= 0 else NONE_ALONE


@dataclass
class Wanted:
    """Which rows to explain: the uids of `uids` (a sorted "u8,u8" array), or a sample of `sample` dropped
    (or kept) rows: the ones with the smallest hash of (uid, seed), so the same rows whatever the table's
    order or partitioning."""

    uids: np.ndarray | None = None
    sample: int = 0
    dropped: bool = True
    seed: int = 0
    extra: tuple[str, ...] = ()  # more columns to carry for each explained row (e.g. the report's captions)

    def __post_init__(self):
        self._set = UidMultiset(self.uids) if self.uids is not None else None

    def pick(self, batch: Batch, eligible: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows of this batch that are candidates, their sampling keys)."""
        hi, lo = batch.uid_pairs()
        if self._set is not None:
            rows = np.flatnonzero(self._set.find(hi, lo) >= 0)
            return rows, np.zeros(len(rows), dtype=np.uint64)
        rows = np.flatnonzero(~kept if self.dropped else kept)
        seed = np.full(len(rows), np.uint64(self.seed % 2**64))
        return rows, splitmix64(hi[rows] ^ splitmix64(lo[rows] ^ splitmix64(seed)))


class Tally:
    """Per term, how many dropped rows it is the decisive term, the main term and (with the pool's
    histograms of the terms) the main deficit of; the last slot counts the rows none is."""

    def __init__(self, decider: Decider, pool_stats: Mapping[str, RunningStats] | None):
        self.decider = decider
        have = pool_stats is not None and all(m in pool_stats for m in decider.terms)
        self.pcts = Percentiles(decider, pool_stats) if have else None  # type: ignore[arg-type]
        self.n = len(decider.terms)
        self.decisive, self.main, self.deficit = (np.zeros(self.n + 1, dtype=np.int64) for _ in range(3))

    def add(self, batch: Batch, dropped: np.ndarray, score: np.ndarray, hi, lo, cut: Cut) -> None:
        contrib = self.decider.contributions(batch)[:, dropped]
        pairs = (hi[dropped], lo[dropped]) if hi is not None else (None, None)
        dec, main = self.decider.decide_dropped(self.decider.swapped(contrib), score[dropped], *pairs, cut)
        self._count(self.decisive, dec)
        self._count(self.main, main)
        if self.pcts is not None:
            values = np.stack([batch.raw(m)[dropped] for m in self.decider.terms])
            cpct = self.pcts.of_contributions(self.pcts.of_values(values))
            self._count(self.deficit, self.pcts.deficits(contrib, cpct))

    def _count(self, counts: np.ndarray, index: np.ndarray) -> None:
        counts += np.bincount(np.where(index < 0, self.n, index), minlength=self.n + 1)

    def counts(self) -> dict:
        terms = self.decider.terms
        out: dict = {
            "medians": self.decider.medians,
            "decisive": dict(zip([*terms, NONE_ALONE], map(int, self.decisive), strict=True)),
            "main": dict(zip([*terms, "none"], map(int, self.main), strict=True)),
        }
        if self.pcts is not None:
            out["deficit"] = dict(zip([*terms, "none"], map(int, self.deficit), strict=True))
            out["deficit_definition"] = (
                "of the terms below their pool median, the one whose contribution has the lowest pool "
                "percentile (the main deficit)"
            )
        return out


@dataclass
class PassResult:
    rows: list[dict] = field(default_factory=list)
    decisions: dict = field(default_factory=dict)
    first_dropped: tuple[float, int, int] | None = None


def cut_pass(
    table: ScoresTable,
    ranker: Rule,
    masks: Sequence[Rule],
    cut: Cut,
    medians: dict[str, float],
    bits: list[np.ndarray],
    *,
    wanted: Wanted | None = None,
    audits: Sequence = (),
    pool_stats: Mapping[str, RunningStats] | None = None,
    workers: int = 2,
    progress: bool = True,
) -> PassResult:
    """One streaming pass over the table after a selection: count the decisive, main term and (given the
    terms' `pool_stats`, histograms included) main deficit of every dropped row, feed the audits, and
    collect the rows `wanted` (with the columns of every term and mask)."""
    decider = Decider(ranker, medians) if ranker.terms() else None
    terms = decider.terms if decider else []
    tally = Tally(decider, pool_stats) if decider is not None else None
    need_uid = wanted is not None or cut.uid is not None
    cols = [
        *(["uid"] if need_uid else []),
        *ranker.columns(),
        *terms,
        *(c for a in audits for c in a.columns()),
    ]
    if wanted is not None:
        cols += [c for m in masks for c in m.columns()]
        cols += list(wanted.extra)
    cols = list(dict.fromkeys(cols))
    dropped_eligible = removed = kept_rows = 0
    best: tuple[float, int, int] | None = None  # the first dropped row: max score, then min uid
    cands: list[tuple[int, dict]] = []
    label = "explain pass" if progress else None
    for i, batch in enumerate(table.iter_batches(cols, workers=workers, progress=label, check=terms)):
        n = len(batch)
        eligible = np.unpackbits(bits[i], count=n).astype(bool) if masks else np.ones(n, dtype=bool)
        score = np.asarray(ranker.score(batch), dtype=np.float64)
        hi, lo = batch.uid_pairs() if "uid" in cols else (None, None)
        kept = eligible & cut.keeps(score, hi, lo)
        dropped = eligible & ~kept
        kept_rows += int(kept.sum())
        dropped_eligible += int(dropped.sum())
        removed += int((~eligible).sum())
        if dropped.any() and hi is not None:
            s = score[dropped]
            top = float(s.max())
            at = np.flatnonzero(dropped)[s == top]
            j = at[np.lexsort((lo[at], hi[at]))[0]]
            cand = (top, int(hi[j]), int(lo[j]))
            if best is None or cand[0] > best[0] or (cand[0] == best[0] and cand[1:] < best[1:]):
                best = cand
        if tally is not None and dropped.any():
            tally.add(batch, dropped, score, hi, lo, cut)
        for a in audits:
            a.add(batch, kept)
        if wanted is not None:
            rows, keys = wanted.pick(batch, eligible, kept)
            if len(rows):
                cands += _collect(batch, rows, keys, eligible, kept, score, masks, decider, wanted)
                if wanted.sample and len(cands) > 2 * wanted.sample:
                    cands = sorted(cands, key=lambda c: c[0])[: wanted.sample]
    if wanted is not None and wanted.sample:
        cands = sorted(cands, key=lambda c: c[0])[: wanted.sample]
    decisions: dict = {
        "definition": "the term whose change to its pool median (p50) alone would flip the decision",
        "kept_rows": kept_rows,
        "dropped_rows": dropped_eligible,
        "removed_by_filters": removed,
    }
    if tally is None:
        decisions["note"] = f"rule {ranker.name!r} is not a sum of per-metric terms: no per-term attribution"
    else:
        decisions.update(tally.counts())
    return PassResult(rows=[c[1] for c in cands], decisions=decisions, first_dropped=best)


def _collect(batch, rows, keys, eligible, kept, score, masks, decider, wanted) -> list[tuple[int, dict]]:
    """The explained rows' raw material: uid, values, score, status, and which filters removed them."""
    hi, lo = batch.uid_pairs()
    sub = batch.filter(np.isin(np.arange(len(batch)), rows))
    removed_by = [np.asarray(m.mask(sub), dtype=bool) for m in masks]
    out = []
    for k, r in enumerate(rows):
        row = {
            "uid": pair_to_uid(hi[r], lo[r]),
            "_pair": (int(hi[r]), int(lo[r])),
            "score": float(score[r]),
            "eligible": bool(eligible[r]),
            "removed_by": [m.spec() for m, ok in zip(masks, removed_by, strict=True) if not ok[k]],
            "kept": bool(kept[r]),
            "values": {m: float(batch.raw(m)[r]) for m in (decider.terms if decider else [])},
        }
        if wanted.extra:
            row["extra"] = {c: batch.arrow(c)[r].as_py() for c in wanted.extra}
        out.append((int(keys[k]), row))
    return out


def rank_pass(
    table: ScoresTable,
    ranker: Rule,
    masks: Sequence[Rule],
    bits: list[np.ndarray],
    rows: list[dict],
    *,
    workers: int = 2,
    progress: bool = True,
) -> None:
    """Each eligible explained row's rank among the eligible rows (1 = best; score desc, then uid asc)."""
    mine = [r for r in rows if r["eligible"]]
    if not mine:
        return
    s = np.array([r["score"] for r in mine])
    order = np.argsort(s)
    ss = s[order]
    better = np.zeros(len(mine), dtype=np.int64)
    cols = list(dict.fromkeys(["uid", *ranker.columns()]))
    label = "rank pass" if progress else None
    for i, batch in enumerate(table.iter_batches(cols, workers=workers, progress=label, check=[])):
        score = np.asarray(ranker.score(batch), dtype=np.float64)
        idx = np.flatnonzero(np.unpackbits(bits[i], count=len(batch))) if masks else np.arange(len(batch))
        score = score[idx]
        srt = np.sort(score)
        better[order] += len(srt) - np.searchsorted(srt, ss, side="right")  # strictly higher scores
        tied = np.flatnonzero(np.isin(score, s))
        if len(tied):  # equal scores rank by uid
            hi, lo = batch.uid_pairs()
            for j in tied:
                u = (int(hi[idx[j]]), int(lo[idx[j]]))
                for k, r in enumerate(mine):
                    if r["score"] == score[j] and u < r["_pair"]:
                        better[k] += 1
    for k, r in enumerate(mine):
        r["rank"] = int(better[k]) + 1


def explain_rows(
    rows: list[dict],
    decider: Decider | None,
    cut: Cut,
    first_dropped: tuple[float, int, int] | None,
    pool_stats: dict[str, RunningStats],
) -> list[dict]:
    """Per row: each term's value, pool percentile, contribution, its median's; the decisive term."""
    out = []
    pcts = Percentiles(decider, pool_stats) if decider is not None and rows else None
    for r in rows:
        row = {k: v for k, v in r.items() if k not in ("_pair", "values")}
        terms: dict = {}
        decisive = main = deficit = None
        if decider is not None and pcts is not None:
            terms, (decisive, main, deficit) = _explain_terms(r, decider, pcts, cut, first_dropped)
        if not r["eligible"]:
            decisive = "filter:" + (r["removed_by"][0] if r["removed_by"] else "?")
        row.update({"terms": terms, "decisive": decisive, "main": main, "deficit": deficit})
        out.append(row)
    return out


def _explain_terms(r: dict, decider: Decider, pcts: Percentiles, cut: Cut, first_dropped) -> tuple:
    """One explained row's per-term table and its (decisive, main, deficit) when it is eligible."""
    hi = np.array([r["_pair"][0]], dtype=np.uint64)
    lo = np.array([r["_pair"][1]], dtype=np.uint64)
    values = np.array([[r["values"][m]] for m in decider.terms], dtype=np.float32)
    contrib = np.array([decider.rule.contribution(m, v) for m, v in zip(decider.terms, values, strict=True)])
    swapped = decider.swapped(contrib)
    pct = pcts.of_values(values)
    cpct = pcts.of_contributions(pct)
    terms = {
        m: {
            "value": r["values"][m],
            "percentile": float(pct[t, 0]),
            "contribution_percentile": float(cpct[t, 0]),
            "contribution": float(contrib[t, 0]),
            "median": decider.medians[m],
            "median_contribution": decider.at_median[m],
            "score_at_median": float(swapped[t, 0]),
        }
        for t, m in enumerate(decider.terms)
    }
    if not r["eligible"]:
        return terms, (None, None, None)
    score = np.array([r["score"]])
    if r["kept"]:
        d, mm = decider.decide_kept(swapped, score, hi, lo, first_dropped, cut)
    else:
        d, mm = decider.decide_dropped(swapped, score, hi, lo, cut)
    main = decider.terms[int(mm[0])] if mm[0] >= 0 else None
    low = int(pcts.deficits(contrib, cpct)[0])
    deficit = {"term": decider.terms[low], "percentile": float(cpct[low, 0])} if low >= 0 else None
    return terms, (decider.name(int(d[0])), main, deficit)


class Percentiles:
    """Pool percentiles of the terms' values and contributions, from the pool's streaming histograms
    (`RunningStats.hist`, within a bin's relative 2^-9), rounded to 0.01 as `hype explain` prints them;
    and the main deficit they give."""

    def __init__(self, decider: Decider, pool_stats: Mapping[str, RunningStats]):
        self.decider = decider
        self.hists = [pool_stats[m].hist for m in decider.terms]
        # The pool's midranks per term, once: each costs a pass over its histogram's bins.
        self.midranks = [h.midranks() for h in self.hists]
        self.directions = np.array([_direction(decider, m, pool_stats[m]) for m in decider.terms])
        # ties of percentile and lift go to the first term by name, whatever the rule's order
        self.name_rank = np.argsort(np.argsort(decider.terms))
        self.at_median = np.array([decider.at_median[m] for m in decider.terms])

    def of_values(self, values: np.ndarray) -> np.ndarray:
        """(terms, rows) raw values -> their pool percentiles (mid-ranks, 0-100)."""
        mid = [r[h.bins(v)] for r, h, v in zip(self.midranks, self.hists, values, strict=True)]
        return np.round(np.array(mid, dtype=np.float64).reshape(values.shape) * 100, 2)

    def of_contributions(self, pct: np.ndarray) -> np.ndarray:
        """Value percentiles -> contribution percentiles: 100 minus them for a term with a negative weight,
        50 for a constant term."""
        d = self.directions[:, None]
        return np.round(np.where(d > 0, pct, np.where(d < 0, 100 - pct, 50.0)), 2)

    def deficits(self, contrib: np.ndarray, cpct: np.ndarray) -> np.ndarray:
        """The main deficit per row (term index, -1: no term below its median): of the terms whose pool
        median would raise the score, the lowest contribution percentile (ties: the larger lift)."""
        lift = self.at_median[:, None] - contrib
        key = np.where(lift > 0, cpct, np.inf)
        first = key.argmin(axis=0)
        low = key[first, np.arange(key.shape[1])]
        # Equal lowest percentiles (rounded to 0.01) are rare: sorting only those rows keeps this pass at
        # its speed (a lexsort of every dropped row cost as much as the rest of the pass).
        tied = np.flatnonzero(np.isfinite(low) & ((key == low).sum(axis=0) > 1))
        if len(tied):
            names = np.broadcast_to(self.name_rank[:, None], (len(key), len(tied)))
            first[tied] = np.lexsort((names, -lift[:, tied], key[:, tied]), axis=0)[0]
        return np.where(np.isfinite(low), first, -1)


def _direction(decider: Decider, m: str, stats: RunningStats) -> int:
    """+1 when term `m`'s contribution grows with its value over the pool's range, -1 when it falls, 0
    when it is constant (weight 0)."""
    lo, hi = float(stats.min), float(stats.max)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return 0
    c = decider.rule.contribution(m, np.array([lo, hi], dtype=np.float32))
    return int(np.sign(c[1] - c[0]))


def format_rows(rows: list[dict], cut: dict, k: int | None, eligible: int) -> str:
    """The text table of `hype explain`."""
    lines = []
    where = f"score {cut['score']:.6g}" if cut.get("score") is not None else "every eligible row"
    lines.append(f"cut: {where}" + (f", rank {k:,} of {eligible:,} eligible rows" if k else ""))
    for r in rows:
        status = "KEPT" if r["kept"] else "DROPPED"
        rank = f"rank {r['rank']:,}" if r.get("rank") else "not ranked (removed by a filter)"
        lines.append("")
        lines.append(f"{r['uid']}  {status}  score {r['score']:.6g}  {rank}")
        if r["terms"]:
            lines.append(
                f"  {'term':<10} {'value':>10} {'pctile':>7} {'contrib':>10} {'median':>10} {'score@med':>10}"
            )
            for m, t in r["terms"].items():
                lines.append(
                    f"  {m:<10} {t['value']:>10.4g} {t['percentile']:>6.1f}% {t['contribution']:>10.4g} "
                    f"{t['median']:>10.4g} {t['score_at_median']:>10.4g}"
                )
        if r["removed_by"]:
            lines.append(f"  removed by: {', '.join(r['removed_by'])}")
        why = [f"main term: {r['main']}"] if r["main"] else []
        if r.get("deficit"):
            d = r["deficit"]
            why.append(f"main deficit: {d['term']} at pool percentile {d['percentile']:.1f}")
        lines.append(f"  decisive: {r['decisive']}" + (f"  ({'; '.join(why)})" if why else ""))
    return "\n".join(lines)


def pool_medians(pool: dict) -> dict[str, float]:
    """The pool median of each metric as `subset.json` reports it (`metrics.<m>.pool.quantiles.p50`)."""
    return {m: st["quantiles"][MEDIAN_KEY] for m, st in pool.items() if st.get("count")}


def explain_selection(sel, wanted: Wanted) -> dict:
    """`hype explain`: run the selection `sel` (a `SelectRequest`; nothing is written) and explain the
    `wanted` rows. Passes: select's own (statistics, rank, select), then the explain pass and, for the
    explained rows' ranks, a rank pass."""
    from hype.select.nominal import nominal_rows
    from hype.select.reducer import reduce

    _, ranker, masks = build_rules(sel)
    table = ScoresTable(sel.scores)
    target = make_target(sel, nominal_rows(table, sel.metadata))
    table.require_finished()
    warnings: list[str] = []
    table.require(["uid"], "hype explain")
    table.require(ranker.columns(), f"ranking rule {ranker.spec()!r}")
    for m in masks:
        table.require(m.columns(), f"filter {m.spec()!r}")
        m.attach(table)
    ranker.attach(table)
    stats = {m: RunningStats() for m in table.present_metrics()}
    watch = CutWatcher()
    bits: list[np.ndarray] = []
    result = reduce(
        table,
        ranker,
        masks,
        target,
        watch,
        pool_stats=stats,
        workers=sel.workers,
        progress=sel.progress,
        eligible_bits=bits,
    )
    cut = _cut(target, watch)
    medians = pool_medians({m: st.to_dict() for m, st in stats.items()})
    done = cut_pass(
        table,
        ranker,
        masks,
        cut,
        medians,
        bits,
        wanted=wanted,
        pool_stats=stats,
        workers=sel.workers,
        progress=sel.progress,
    )
    rank_pass(table, ranker, masks, bits, done.rows, workers=sel.workers, progress=sel.progress)
    decider = Decider(ranker, medians) if ranker.terms() else None
    rows = explain_rows(done.rows, decider, cut, done.first_dropped, stats)
    cutoffs = term_cutoffs(decider, cut.score, stats) if decider is not None else {}
    if wanted.uids is not None:
        found = {r["uid"] for r in rows}
        missing = [u for u in _uids(wanted.uids) if u not in found]
    else:
        missing = []
    return {
        "scores": str(table.folder),
        "rank": ranker.describe(),
        "filters": [m.spec() for m in masks],
        "pool_rows": result.pool_rows,
        "eligible_rows": result.eligible_rows,
        "kept_rows": result.kept_rows,
        "k": result.k,
        "cut": cut.describe(),
        "rows": rows,
        "missing": missing,
        "decisions": done.decisions,
        "term_cutoffs": cutoffs,
        "warnings": warnings,
    }


def term_cutoffs(decider: Decider, cut_score: float, stats: dict[str, RunningStats]) -> dict:
    """Per term, the value at which a sample whose other terms sit at their pool medians reaches the cut
    score (bisection on the rule's own contribution over the pool's range): the line the report draws on
    the term's histogram. None when no value in the pool's range does it or every value does (the term
    alone cannot move a median sample across the cut), or the term decreases the score."""
    out: dict[str, float | None] = {}
    if not math.isfinite(cut_score):
        return {m: None for m in decider.terms}
    for m in decider.terms:
        rest = sum(v for k, v in decider.at_median.items() if k != m)
        lo, hi = float(stats[m].min), float(stats[m].max)

        def score(x: float, m: str = m, rest: float = rest) -> float:
            return float(decider.rule.contribution(m, np.array([x], dtype=np.float32))[0]) + rest

        if not (math.isfinite(lo) and math.isfinite(hi)) or score(hi) <= score(lo):
            out[m] = None
            continue
        if score(lo) >= cut_score or score(hi) < cut_score:
            out[m] = None
            continue
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if score(mid) < cut_score else (lo, mid)
        out[m] = hi
    return out


def _cut(target, watch: CutWatcher) -> Cut:
    if target.ranked:
        return Cut(watch.score, watch.uid)
    return Cut(float(target.threshold))


def _uids(arr: np.ndarray) -> list[str]:
    return [pair_to_uid(h, low) for h, low in zip(arr["f0"], arr["f1"], strict=True)]


def request_from_summary(summary: dict, scores: str | None = None, record: str | None = None) -> dict:
    """`SelectRequest` fields that redo the selection a `subset.json` (at `record`) records: its scores
    table, its k (or threshold), its ranking rule and every filter it applied. A relative scores location
    (written by an older hype) is taken relative to the record's folder, never the current one."""
    from hype.select.presets import load_preset

    t = summary.get("target") or {}
    out: dict = {"scores": scores or _beside(summary["scores"], record)}
    if t.get("mode") in ("frac", "top_k"):
        out["top_k"] = int(t["k"])
    elif t.get("mode") == "threshold":
        out["threshold"] = float(t["threshold"])
    else:
        out["keep_all"] = True
    rank = dict(summary.get("rank") or {})
    out["preset"] = summary.get("preset")
    out["rank"] = rank.get("rule")  # None: the preset's
    # The recorded value of each select option the rule takes (`Rule.OPTIONS`), "none" included: left out,
    # the preset's normalization would stand in for an explicit --normalize none.
    cls = RULES.get(out["rank"]) if out["rank"] else None
    for option in cls.OPTIONS if cls is not None else ():
        if rank.get(option) is not None:
            out[option] = rank[option]
    n_preset = len(load_preset(out["preset"]).filters) if out["preset"] else 0
    out["filters"] = [_spec(f) for f in (summary.get("filters") or [])[n_preset:]]
    return out


def _beside(recorded: str | list[str], record: str | None) -> str | list[str]:
    if isinstance(recorded, list):
        return [_beside(r, record) for r in recorded]  # type: ignore[misc]
    if record is None or storage.is_url(recorded) or os.path.isabs(recorded):
        return recorded
    return storage.absolute(os.path.join(os.path.dirname(storage.absolute(record)), recorded))


def _spec(described: dict) -> str:
    from hype.select.rules import RULES

    cls = RULES.get(described["rule"])
    declared = cls.PARAMS if cls is not None else {}
    params = {k: v for k, v in described.items() if k in declared}
    return described["rule"] + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")


def review_cut(
    table: ScoresTable,
    ranker: Rule,
    masks: Sequence[Rule],
    target,
    watch: CutWatcher,
    bits,
    pool: dict,
    req,
    subset: np.ndarray,
    result,
    pool_stats: Mapping[str, RunningStats] | None = None,
) -> dict:
    """What `hype select` adds to subset.json after a selection, in one more pass: the decisive term, main
    term and main deficit (from `pool_stats`' histograms of the ranking rule's terms) of every dropped row
    (`decisions`) and the audits of the cut (`audit`; the per-domain one reads the
    metadata's uid and url columns when the run or `req.metadata` names a metadata folder)."""
    from hype.select.audit import domain_audit, table_audits
    from hype.select.nominal import metadata_dir

    # The audits cost a language ID per caption (fastText, ~45k/s, on up to 1M rows) and the caption, size
    # and metadata columns: only when asked for (`--audit`), so a plain selection stays at its speed.
    audits, notes = table_audits(table) if req.audit else ([], {})
    cut = _cut(target, watch)
    if result.rows_at_cut_score == result.kept_at_cut_score:
        cut = Cut(cut.score)  # every row at the cut score is kept: no uid decides, none is read
    try:
        done = cut_pass(
            table,
            ranker,
            masks,
            cut,
            pool_medians(pool),
            bits,
            audits=audits,
            pool_stats=pool_stats,
            workers=req.workers,
            progress=req.progress,
        )
    finally:
        table.release_spool()
    if not req.audit:
        return {"decisions": done.decisions, "audit": {"note": "not run: hype select --audit audits the cut"}}
    kept, rows = done.decisions["kept_rows"], table.num_rows
    report = {a.name: a.report(kept / rows) for a in audits}
    report.update({name: {"note": note} for name, note in notes.items()})
    meta = metadata_dir(table, req.metadata)
    if meta is None:
        report["domain"] = {"note": "skipped: no metadata folder with URLs (pass --metadata DIR)"}
    else:
        report["domain"], _ = domain_audit(meta, subset)
    return {"decisions": done.decisions, "audit": report}

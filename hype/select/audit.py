"""Audits of a cut: what a selection keeps of each concept, caption language, image size and URL domain.

Each audit counts, per group, the rows of the scored pool and the kept ones, in the streaming pass that
follows a selection (`hype.select.explain.cut_pass`; the domain audit reads the pool's metadata instead).
A group kept at less than a quarter of the overall kept fraction is flagged ("keeps 2.0% of captions in
'ja' against 20.0% overall"), when it has at least `MIN_ROWS` rows; the smaller groups are too small to
judge one by one, so the audit names them and says what they lost together (`too_small`: rows, kept, the
share dropped).

- concept: the k-means cluster of c_IN (`hype.select.concepts`: joined by uid from the run's clusters
  outputs, or the table's own `cluster` column); class: the reference class of that cluster (the most
  frequent label of the `--class-images` in it; `(no class)`: a cluster no class image is nearest to);
- language: fastText lid.176 (`hype.text.language`, what the basic filter uses) on a uniform hashed
  sample of at most `LANGUAGE_ROWS` rows (lid runs at ~45k captions/s on one core: a 128M pool would take
  47 min), so the per-language counts are of the sample;
- size: the shorter image side in buckets (DataComp's basic filter keeps >= 200 px);
- domain: the host of each metadata row's URL (`www.` dropped), counted over the metadata's uids, scored or
  not (a domain whose downloads failed shows up too); at most `MAX_DOMAINS` distinct domains are counted,
  later new ones as `(other)`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hype.data.uids import UidMultiset, arrow_to_pairs, splitmix64
from hype.select.concepts import NO_CLASS, UNKNOWN, RunClusters, cluster_classes
from hype.table.reader import Batch, ScoresTable

FLAG_RATIO = 0.25
MIN_ROWS = 20
LANGUAGE_ROWS = 1_000_000
MAX_DOMAINS = 1_000_000
LISTED = 50  # groups listed per audit in subset.json (largest first); flags cover every group
SIZE_EDGES = (64, 128, 200, 400, 800)
_HOST = r"^[A-Za-z][A-Za-z0-9+.\-]*://(?:[^@/?#]*@)?(?P<host>[^/:?#]+)"


class GroupAudit:
    """Rows and kept rows per group; subclasses say which columns they read and each row's group."""

    name = ""
    what = ""  # "{group}" -> the phrase of a flag, e.g. "captions in {group}"

    def __init__(self) -> None:
        self.rows: dict = {}
        self.kept: dict = {}

    def columns(self) -> list[str]:
        return []

    def groups(self, batch: Batch) -> tuple[np.ndarray, np.ndarray | None]:
        """(group label per counted row, which rows of the batch they are; None: every row)."""
        raise NotImplementedError

    def add(self, batch: Batch, kept: np.ndarray) -> None:
        labels, rows = self.groups(batch)
        k = kept if rows is None else kept[rows]
        self.count(labels, k)

    def count(self, labels: np.ndarray, kept: np.ndarray) -> None:
        for d, lab in ((self.rows, labels), (self.kept, labels[kept])):
            names, counts = np.unique(lab, return_counts=True)
            for g, c in zip(names.tolist(), counts.tolist(), strict=True):
                d[g] = d.get(g, 0) + c

    def report(self, overall: float) -> dict:
        groups = sorted(self.rows, key=lambda g: (-self.rows[g], str(g)))
        out = {
            str(g): {
                "rows": self.rows[g],
                "kept": self.kept.get(g, 0),
                "kept_frac": round(self.kept.get(g, 0) / self.rows[g], 6),
            }
            for g in groups
        }
        flags = [
            f"keeps {100 * v['kept_frac']:.1f}% of {self.what.format(group=g)} against {100 * overall:.1f}% "
            f"overall ({v['kept']:,} of {v['rows']:,})"
            for g, v in out.items()
            if v["rows"] >= MIN_ROWS and v["kept_frac"] < FLAG_RATIO * overall
        ]
        listed = dict(list(out.items())[:LISTED])
        report = {"groups": listed, "more_groups": len(out) - len(listed), "flags": flags, "overall": overall}
        small = [g for g, v in out.items() if v["rows"] < MIN_ROWS]
        if small:
            rows, kept = sum(out[g]["rows"] for g in small), sum(out[g]["kept"] for g in small)
            report["too_small"] = {
                "min_rows": MIN_ROWS,
                "count": len(small),
                "groups": small[:LISTED],
                "rows": rows,
                "kept": kept,
                "dropped_frac": round(1 - kept / rows, 6),
            }
        return report


class SizeAudit(GroupAudit):
    name = "size"
    what = "images with shorter side {group}"

    def columns(self) -> list[str]:
        return ["width", "height"]

    def groups(self, batch: Batch) -> tuple[np.ndarray, None]:
        short = np.fmin(batch.numeric("width"), batch.numeric("height"))
        labels = np.array(_size_labels(), dtype=object)
        known = np.isfinite(short) & (short > 0)
        idx = np.where(known, np.searchsorted(np.array(SIZE_EDGES), np.nan_to_num(short), side="right"), -1)
        return labels[idx], None  # -1: the last label, "unknown"


def _size_labels() -> list[str]:
    edges = SIZE_EDGES
    labels = [f"< {edges[0]} px"]
    labels += [f"{a}-{b - 1} px" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return [*labels, f">= {edges[-1]} px", "unknown"]


class ClusterAudit(GroupAudit):
    """Per k-means cluster of c_IN: the table's `cluster` column, else joined from the run's stage outputs
    (`hype.select.concepts.RunClusters`)."""

    name = "concept"
    what = "concept cluster {group}"

    def __init__(self, join=None):
        super().__init__()
        self.join = join  # None: the table has a `cluster` column
        self._last: tuple[Batch, np.ndarray] | None = None  # the class audit asks for the same batch

    def columns(self) -> list[str]:
        return ["cluster"] if self.join is None else ["uid"]

    def cluster_ids(self, batch: Batch) -> np.ndarray:
        if self._last is not None and self._last[0] is batch:
            return self._last[1]
        if self.join is None:
            ids = batch.arrow("cluster").to_numpy(zero_copy_only=False)
        else:
            ids = self.join.clusters(batch)
        self._last = (batch, ids)
        return ids

    def groups(self, batch: Batch) -> tuple[np.ndarray, None]:
        ids = self.cluster_ids(batch)
        return np.where(ids == UNKNOWN, "unknown", ids.astype(str)).astype(object), None

    def report(self, overall: float) -> dict:
        out = super().report(overall)
        if self.join is not None:
            out["note"] = "k-means clusters of c_IN, joined from the run's clusters/ outputs"
        return out


class ClassAudit(GroupAudit):
    """Per reference class: the class of each row's cluster (`hype.select.concepts.cluster_classes`)."""

    name = "class"
    what = "samples of reference class {group}"

    def __init__(self, clusters: ClusterAudit, classes: dict[int, str]):
        super().__init__()
        self.clusters = clusters
        ids = np.array(sorted(classes), dtype=np.int64)
        self._ids = ids
        self._names = np.array([classes[int(c)] for c in ids] + [NO_CLASS], dtype=object)

    def columns(self) -> list[str]:
        return self.clusters.columns()

    def groups(self, batch: Batch) -> tuple[np.ndarray, None]:
        ids = np.asarray(self.clusters.cluster_ids(batch), dtype=np.int64)
        at = np.searchsorted(self._ids, ids)
        hit = (at < len(self._ids)) & (self._ids[np.minimum(at, len(self._ids) - 1)] == ids)
        return self._names[np.where(hit, at, len(self._ids))], None

    def report(self, overall: float) -> dict:
        out = super().report(overall)
        out["note"] = "the majority class of the class images in each sample's k-means cluster"
        return out


class LanguageAudit(GroupAudit):
    name = "language"
    what = "captions in '{group}'"

    def __init__(self, pool_rows: int):
        super().__init__()
        self.rate = min(1.0, LANGUAGE_ROWS / max(pool_rows, 1))
        self.limit = np.uint64(min(int(self.rate * 2.0**64), 2**64 - 1))
        self.sampled = 0

    def columns(self) -> list[str]:
        return ["text"]

    def groups(self, batch: Batch) -> tuple[np.ndarray, np.ndarray | None]:
        from hype.text.language import detect_languages

        rows = None
        if self.rate < 1.0:  # a hash of the row's place in the table: no uid column to read
            place = np.arange(batch.first_row, batch.first_row + len(batch), dtype=np.uint64)
            rows = np.flatnonzero(splitmix64(place ^ np.uint64(0x1A46)) <= self.limit)
        texts = batch.texts("text")
        picked = texts if rows is None else [texts[i] for i in rows]
        self.sampled += len(picked)
        unique, inverse = np.unique(np.array(picked, dtype=object), return_inverse=True)
        langs = np.array([lang or "(empty)" for lang in detect_languages(list(unique))], dtype=object)
        return langs[inverse] if len(picked) else np.array([], dtype=object), rows

    def report(self, overall: float) -> dict:
        out = super().report(overall)
        out["sampled_rows"] = self.sampled
        if self.rate < 1.0:
            out["note"] = f"fastText lid on a uniform hashed sample of {self.sampled:,} rows"
        return out


class DomainAudit(GroupAudit):
    """Per URL domain over the metadata's rows: kept when the uid is in the subset."""

    name = "domain"
    what = "samples from {group}"

    def add_metadata(self, table: pa.Table, subset: UidMultiset, where: str) -> None:
        hi, lo = arrow_to_pairs(table.column("uid"), f"{where}: column 'uid'")
        host = pc.struct_field(pc.extract_regex(table.column("url").cast(pa.string()), _HOST), [0])
        host = pc.utf8_lower(pc.fill_null(host, "(no host)"))
        host = pc.replace_substring_regex(host, r"^www\.", "")
        labels = np.asarray(host.to_numpy(zero_copy_only=False), dtype=object)
        if len(self.rows) >= MAX_DOMAINS:
            labels = np.where(np.isin(labels, list(self.rows)), labels, "(other)")
        self.count(labels, subset.find(hi, lo) >= 0)


def table_audits(table: ScoresTable) -> tuple[list[GroupAudit], dict]:
    """The audits the scores table allows, and a note for each one it does not."""
    audits: list[GroupAudit] = []
    notes = {}
    if table.has_column("cluster"):
        audits.append(ClusterAudit())
        notes["class"] = "skipped: the table's own 'cluster' column comes with no class images"
    else:
        join, why = RunClusters.open(table)
        if join is None:
            notes["concept"] = notes["class"] = f"skipped: {why}"
        else:
            concept = ClusterAudit(join)
            audits.append(concept)
            classes, why = cluster_classes(table)
            if classes is None:
                notes["class"] = f"skipped: {why}"
            else:
                audits.append(ClassAudit(concept, classes))
    if table.has_column("text"):
        audits.append(LanguageAudit(table.num_rows))
    else:
        notes["language"] = "skipped: the scores table has no 'text' column"
    if table.has_column("width") and table.has_column("height"):
        audits.append(SizeAudit())
    else:
        notes["size"] = "skipped: the scores table has no width/height columns"
    return audits, notes


def domain_audit(metadata: str | None, subset: np.ndarray, batch_rows: int = 1 << 16) -> tuple[dict, int]:
    """(the per-domain audit, the metadata's row count) over the metadata folder's parquet files."""
    import pyarrow.parquet as pq

    from hype.io import open_input
    from hype.select.nominal import metadata_files

    audit = DomainAudit()
    found = UidMultiset(subset)
    rows = 0
    for path in metadata_files(metadata):
        with open_input(path) as f:
            part = pq.ParquetFile(f)
            if "url" not in part.schema_arrow.names or "uid" not in part.schema_arrow.names:
                return {"note": f"skipped: {path} has no uid/url columns"}, -1
            for rb in part.iter_batches(batch_size=batch_rows, columns=["uid", "url"]):
                t = pa.Table.from_batches([rb])
                audit.add_metadata(t, found, str(path))
                rows += t.num_rows
    return audit.report(len(subset) / rows if rows else 0.0), rows


def too_small_line(t: dict) -> str:
    """What the groups too small to judge one by one lost together (an audit's `too_small`)."""
    names = ", ".join(map(str, t["groups"][:8]))
    more = f", ... {t['count']:,} in all" if t["count"] > 8 else ""
    return (
        f"too small to judge (< {t['min_rows']} rows each): {t['count']:,} group(s) ({names}{more}): "
        f"{t['kept']:,} of {t['rows']:,} rows kept, {100 * t['dropped_frac']:.1f}% dropped"
    )


def format_audit(audit: dict) -> str:
    """The text `hype select --audit` prints."""
    lines = ["audits of the cut (kept fraction per group; flagged when < 1/4 of the overall fraction):"]
    for name, a in audit.items():
        if "note" in a and "groups" not in a:
            lines.append(f"  {name}: {a['note']}")
            continue
        head = f"  {name}" + (f" ({a['note']})" if a.get("note") else "")
        lines.append(head + ":")
        for g, v in list(a["groups"].items())[:12]:
            lines.append(f"    {g:<24} {v['kept']:>10,} / {v['rows']:<10,} {100 * v['kept_frac']:6.1f}%")
        hidden = max(0, len(a["groups"]) - 12) + a.get("more_groups", 0)
        if hidden:
            lines.append(f"    ... {hidden:,} more groups")
        for f in a["flags"][:20]:
            lines.append(f"    FLAG {f}")
        if a.get("too_small"):
            lines.append(f"    {too_small_line(a['too_small'])}")
    return "\n".join(lines)

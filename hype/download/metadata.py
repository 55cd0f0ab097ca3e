"""Reading the pool metadata before a download: which files, how many shards, what looks wrong.

img2dataset numbers shards across the input files in sorted order, `ceil(rows / per_shard)` per file,
so the plan here gives every shard's id and size without downloading anything: the progress total, the
shards already done, and the ones a run failed to finish. Problems that img2dataset would only report
deep inside a worker (no parquet, a missing column) become errors naming the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hype.data.uids import UidRepeats, normalize_arrow_uids
from hype.download.network import NetworkPolicy
from hype.io import AnyPath, read_parquet, read_parquet_schema, storage

REQUIRED_COLUMNS = ("uid", "url", "text")
# scheme and host of a url; the host keeps IPv6 brackets ("[::1]")
_URL_RE = r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):(?://(?:[^@/?#]*@)?(?P<host>\[[^\]/]*\]|[^:/?#]*))?"
EXAMPLES = 5


class DownloadError(ValueError):
    """Bad input or arguments for a download; the message names the file and the fix."""


@dataclass
class MetadataPlan:
    files: list[AnyPath]
    rows: list[int]  # per file
    shards: list[tuple[int, int]]  # (shard id, samples), img2dataset's numbering
    duplicate_uids: int = 0  # rows whose uid appeared before (in any file; uids read by normalize_uid)
    duplicate_examples: list[str] = field(default_factory=list)
    malformed_uids: int = 0  # rows with no uid `hype.data.uids.normalize_uid` reads: scoring skips them
    malformed_examples: list[str] = field(default_factory=list)
    has_bbox: bool = False  # every file has the bbox column
    refused: dict[str, int] = field(default_factory=dict)  # urls refused by their host alone, per kind
    refused_examples: list[str] = field(default_factory=list)

    @property
    def total_rows(self) -> int:
        return sum(self.rows)


def metadata_files(path: str | Path) -> list[AnyPath]:
    """The parquet files of a metadata folder (not recursive, as img2dataset reads it) or one file; a
    URL (s3://bucket/metadata, hf://datasets/mlfoundations/datacomp_small/metadata) is listed once."""
    p = storage.location(path)
    if storage.is_dir(p):
        files = storage.files_with_suffix(p, ".parquet")
        if not files:
            raise DownloadError(
                f"{p}: no .parquet files in this folder; --metadata takes a folder of DataComp metadata "
                "parquet files (uid, url, text) or one such file"
            )
        return files
    if not storage.exists(p):
        hint = "; check the URL (`hype --storage-options` for another endpoint or credentials)"
        raise DownloadError(f"{p}: no such file or folder (--metadata){hint if storage.is_url(p) else ''}")
    if not p.name.endswith(".parquet"):
        raise DownloadError(f"{p}: not a .parquet file; --metadata takes parquet metadata (uid, url, text)")
    return [p]


def plan_metadata(
    path: str | Path, samples_per_shard: int, bbox_col: str | None, policy: NetworkPolicy
) -> MetadataPlan:
    files = metadata_files(path)
    rows: list[int] = []
    shards: list[tuple[int, int]] = []
    # The uid index over all files: 16 bytes per row, in bounded memory (UidRepeats: 256 MiB held, the rest
    # spilled to the temporary folder), not the uid strings of the whole pool in the driver.
    repeats = UidRepeats()
    malformed = 0
    malformed_examples: list[str] = []
    host_counts: dict[tuple[str, str], int] = {}
    examples: dict[tuple[str, str], str] = {}
    has_bbox = bbox_col is not None
    for file in files:
        try:
            schema = read_parquet_schema(file)
        except (OSError, pa.ArrowException) as e:
            if isinstance(e, storage.StorageError):
                raise  # refused credentials, a missing bucket: the message is the fix
            raise DownloadError(f"{file}: not a readable parquet file ({e})") from None
        missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
        if missing:
            raise DownloadError(
                f"{file}: missing column(s) {', '.join(missing)}; DataComp metadata has "
                f"{', '.join(REQUIRED_COLUMNS)} (found: {', '.join(schema.names) or 'none'})"
            )
        has_bbox = has_bbox and bbox_col in schema.names
        table = read_parquet(file, columns=["uid", "url"])
        n = table.num_rows
        first = shards[-1][0] + 1 if shards else 0
        for i in range(math.ceil(n / samples_per_shard)):
            shards.append((first + i, min(samples_per_shard, n - i * samples_per_shard)))
        rows.append(n)
        malformed += _index_uids(table.column("uid"), repeats, malformed_examples)
        _count_hosts(table.column("url"), host_counts, examples)
    plan = MetadataPlan(files=files, rows=rows, shards=shards, has_bbox=has_bbox)
    plan.duplicate_uids, plan.duplicate_examples = repeats.count(EXAMPLES)
    plan.malformed_uids, plan.malformed_examples = malformed, malformed_examples
    for (scheme, host), n in sorted(host_counts.items(), key=lambda kv: -kv[1]):
        kind = policy.scheme_refusal(scheme) or policy.host_refusal(host)
        if kind is not None:
            plan.refused[kind] = plan.refused.get(kind, 0) + n
            if len(plan.refused_examples) < EXAMPLES:
                plan.refused_examples.append(examples[(scheme, host)])
    return plan


def _count_hosts(urls: pa.ChunkedArray, counts: dict, examples: dict) -> None:
    urls = urls.cast(pa.string())
    parts = pc.extract_regex(urls.fill_null(""), _URL_RE)
    keys = pa.table(
        {
            "scheme": pc.utf8_lower(pc.struct_field(parts, "scheme")).fill_null(""),
            "host": pc.struct_field(parts, "host").fill_null(""),
            "url": urls.fill_null(""),
        }
    )
    grouped = keys.group_by(["scheme", "host"]).aggregate([("url", "count"), ("url", "min")])
    for scheme, host, n, example in zip(
        *(grouped.column(c).to_pylist() for c in ("scheme", "host", "url_count", "url_min")), strict=True
    ):
        counts[(scheme, host)] = counts.get((scheme, host), 0) + n
        examples.setdefault((scheme, host), example)


def _index_uids(column: pa.ChunkedArray, repeats: UidRepeats, examples: list[str]) -> int:
    """Add a file's canonical uids to the index; returns the number of rows without one (the first few go
    to `examples`)."""
    hi, lo, valid = normalize_arrow_uids(column)
    repeats.add(hi[valid], lo[valid])
    bad = np.flatnonzero(~valid)
    examples += [repr(column[int(i)].as_py()) for i in bad[: EXAMPLES - len(examples)]]
    return len(bad)

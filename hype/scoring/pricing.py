"""`hype plan`'s bucket requests: the price of each storage operation, and the requests of a per-shard stage
and of the run itself. Each stage's own requests are counted in its file (its `plan` hook), from these.

Bucket requests follow the run contract (`hype.scoring.runner`, `rundir`, `stage_*`), counted per object
operation at the price a real S3 server answers for it (measured with SeaweedFS's request counters:
tests/test_storage.py checks each price, tests/test_storage_pipeline.py a whole run, bench/plan_requests.py
larger pools, groups of clusters, decontamination). HEAD is billed as a GET on S3 and counted with them;
`pool_get`/`pool_list` are the requests outside the run folder (the pool's tars, the class images and
evaluation sets, models in a bucket). The prices:

    Parquet read (`parquet_get`)   HEAD at open; pyarrow's footer read, its last 64 KiB (a smaller file
                                   is read whole by it and the read-ahead cache keeps it: 2 in all); then
                                   one GET per pre-buffered range: column chunks coalesced up to 32 MiB
    marker read                    HEAD + GET; a marker not written yet (every `completed` check of a fresh
                                   run) is HEAD (404) + a LIST of `key/` (s3fs rules out a folder)
    streamed object                HEAD (size) + one GET per 8 MiB chunk (`RemoteStream`: tars, digests);
                                   a tar has 3 HEADs more: the driver's and the worker's `file_identity`
                                   before, the worker's after the read
    write                          one PUT (`atomic_write`); over 100 MiB s3fs uploads in parts: 1 + parts + 1
    listing                        one LIST per 1,000 names; an empty or missing folder is 2 (s3fs then
                                   lists the parent): a fresh run's stage folders are empty when listed
    model in a bucket              LIST (a folder?) + one GET into the process's cache (`cached_copy`): the
                                   driver's copy, and each Ray worker's
    written set                    PUT, then its size (HEAD) and its digest (streamed) for the marker

What the model got wrong before it was measured (3 shards, near-duplicates on: plan 294 GET, 55 PUT,
10 LIST against the server's 380, 68, 52): every small Parquet read was priced 3 (2 is right: the footer
read holds the file) and a large one at one GET per 4 MiB (pyarrow asks for ranges of up to 32 MiB, each
one GET: a 40 MB file is 4, not 12); the card's reads (every stage folder looked for and listed, every
marker read: 20% of the GETs) were priced as 8 parts; the markers a fresh run looks for before writing
them, the empty-folder listings, the lock's DELETE, the run's own summary writes and the class images'
listing were left out; the near-duplicate stage was not counted, nor the decontamination search's
evaluation folders, parts and tars. The copy check reads a pool shard's tar only when the shard has
candidates: every shard is counted (an upper bound). Not measured: Ray workers (each actor's sets and
models are counted once per stage), multipart uploads (files over 100 MiB). Counts are of a fresh run:
a resumed one reads markers that exist instead of recomputing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FOOTER_READ = 64 << 10  # pyarrow's first read of a Parquet file: its last 64 KiB
PARQUET_RANGE = 32 << 20  # pyarrow's pre-buffer coalesces column chunks into ranges of up to 32 MiB
STREAM_CHUNK = 8 << 20  # RemoteStream's chunk
MULTIPART_OVER = 100 << 20  # s3fs put_file: single PUT below 2 x its 50 MiB chunk
MULTIPART_PART = 50 << 20
LIST_PAGE = 1000
REQUEST_KINDS = ("get", "put", "list", "delete", "pool_get", "pool_list")


def parquet_get(nbytes: float) -> float:
    """A Parquet read: HEAD at open, pyarrow's footer read (the whole file when it is at most
    FOOTER_READ bytes: the read-ahead cache then holds it), one GET per pre-buffered range."""
    return 2 if nbytes <= FOOTER_READ else 2 + math.ceil(nbytes / PARQUET_RANGE)


def put(nbytes: float) -> float:
    return 1 if nbytes <= MULTIPART_OVER else 2 + math.ceil(nbytes / MULTIPART_PART)


def stream_get(nbytes: float) -> float:
    """A whole object read front to back (`RemoteStream`, `blake2b128_file`): its size (HEAD), its chunks."""
    return 1 + max(1, math.ceil(nbytes / STREAM_CHUNK))


def written_digest(nbytes: float) -> float:
    """A set the driver wrote, then its size (HEAD) and its digest (streamed) for its marker."""
    return 1 + stream_get(nbytes)


JSON_GET = 2  # HEAD + GET of a marker
MISSING = {"get": 1, "list": 1}  # a marker not written yet: HEAD (404), then a LIST of `key/` (a folder?)


def lists(names: float) -> float:
    """A folder's listing: one LIST per 1,000 names; an empty one is 2 (s3fs lists the parent too)."""
    return 2 if names <= 0 else math.ceil(names / LIST_PAGE)


def add(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


@dataclass(frozen=True)
class ShardReads:
    """What a per-shard stage reads for each shard (declared in its stage's file)."""

    tar: bool = False  # a tar (the pool's, the class or evaluation images) instead of the embed output
    markers: int = 0  # upstream markers (read by the driver for the fingerprint, again by the worker)
    parquets: int = 0  # Parquet files
    sets: int = 0  # sets loaded once per worker (top N, reference, centroids and targets)
    folder_written: bool = False  # a driver step wrote into the stage's folder first (top N, k-means)


def stage_requests(reads: ShardReads, shards: int, out_bytes: float, in_bytes: float, workers: int) -> dict:
    """GET (HEAD included) / PUT / LIST of one per-shard stage of a fresh run over `shards` shards:
    `out_bytes` its output per shard, `in_bytes` what each shard reads of its main input (a tar, or the
    embed output). Run-folder requests, and `pool_get`: reads of the pool, class or evaluation images."""
    s = shards
    written = s * (put(out_bytes) + 1)  # output, then its marker
    # the stage's folder listed for finished shards: empty in a fresh run, except where a driver step wrote
    # into it first
    listed = 1 if reads.folder_written else lists(0)
    if reads.tar:
        # driver: the input's identity (HEAD) for the fingerprint; worker: identity before and after the
        # read, the size (HEAD) and the 8 MiB chunks of the stream
        return {"put": written, "list": listed, "pool_get": s * (3 + stream_get(in_bytes))}
    get = s * (2 * reads.markers * JSON_GET + reads.parquets * parquet_get(in_bytes))
    get += min(workers, s) * reads.sets * JSON_GET
    return {"get": get, "put": written, "list": listed}


def run_requests() -> dict:
    """Requests of the run itself: the bucket checked and the folder listed; plan.json (twice) and
    card.json looked for; the lock (created, released), config.yaml, plan.json, summary.json (started once
    the inputs are open, finished); the pool listed."""
    return add(MISSING, MISSING, MISSING, {"list": 4, "put": 5, "delete": 1, "pool_list": 2})

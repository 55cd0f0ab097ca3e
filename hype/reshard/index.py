"""Pass 1 of resharding: index one input tar, recording where each selected sample's members lie.

A tar is walked header by header with seeks (`hype.io.tar.index_samples`), so only the headers and the
small `.json` members are read, not the images. Samples are grouped (`hype.io.tar`'s rule, DataComp's
resharder's: consecutive members sharing a key form a sample, a repeated suffix starts a new one) and
validated the way DataComp's resharder does it: a sample without `.json`, with unreadable JSON or without a
`uid` is skipped (and counted), and the sample is kept as often as its uid occurs in the subset. Unlike
DataComp (`int(uid, 16)`), the uid is read by `hype.data.uids.normalize_uid`, as scoring and training read
it: a uid that is not 32 hex digits (leading zeros, `0x`, full-width digits) is a counted `bad_uid` skip,
and the output keys are built from the canonical uid only. A sample with a member over the tar reader's
size limit is skipped and counted (`member_too_large`) before any of its data is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from hype.data.samples import BAD_JSON, SampleSkip, SkipStats, uid_from_meta
from hype.data.uids import UidMultiset, uids_to_pairs
from hype.io import open_input, storage
from hype.io.tar import index_samples

# Version of the saved index: 2 stores canonical uids (an index saved by an older hype is made again).
INDEX_FORMAT = 2


@dataclass
class ShardIndex:
    tar: str
    size: int
    mtime_ns: int | str  # the tar's version: mtime in ns (local) or the object's ETag (a bucket)
    samples: int = 0  # samples seen in the tar
    # per selected sample: [canonical uid, copies, [[suffix, data offset, size], ...]]
    matched: list[list] = field(default_factory=list)
    found: list[int] = field(default_factory=list)  # index of each matched uid among the subset's unique uids
    skipped: dict = field(default_factory=dict)

    @property
    def copies(self) -> int:
        return sum(m[1] for m in self.matched)

    def to_json(self) -> dict:
        return {
            "format": INDEX_FORMAT,
            "tar": self.tar,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "samples": self.samples,
            "matched": self.matched,
            "found": self.found,
            "skipped": self.skipped,
        }


def index_tar(path: str, subset: UidMultiset) -> ShardIndex:
    st = storage.info(path)  # size and version: mtime (local) or ETag (a bucket)
    index = ShardIndex(tar=path, size=st["size"], mtime_ns=st["version"])
    stats = SkipStats()
    samples = list(index_samples(path, stats))  # headers only; damage is counted in stats
    index.samples = len(samples)
    uids: list[str] = []
    kept: list[dict] = []
    with open_input(path, stream=True) as f:  # forward seeks only: a URL is read ahead, not by ranges
        for key, members in samples:
            where = f"{path}:{key}"
            if "json" not in members:
                stats.add(BAD_JSON, f"{where}: no .json member (DataComp skips such samples)")
                continue
            off, size = members["json"]
            f.seek(off)
            try:
                meta = json.loads(f.read(size))
            except (ValueError, UnicodeDecodeError) as e:
                stats.add(BAD_JSON, f"{where}: {e}")
                continue
            if not isinstance(meta, dict):
                stats.add(BAD_JSON, f"{where}: its .json is not a JSON object")
                continue
            try:
                uids.append(uid_from_meta(meta, where))
            except SampleSkip as e:
                stats.add(e.reason, str(e))
                continue
            kept.append(members)
    if uids:
        hi, lo = uids_to_pairs(uids)
        idx = subset.find(hi, lo)
        for i in np.flatnonzero(idx >= 0):
            members = [[ext, off, size] for ext, (off, size) in sorted(kept[i].items())]
            index.matched.append([uids[i], int(subset.counts[idx[i]]), members])
            index.found.append(int(idx[i]))
    index.skipped = stats.to_dict()
    return index

"""Reading webdataset tars sample by sample, robustly: shared by training and scoring.

A tar written by img2dataset (or DataComp's resharder) stores each sample as consecutive members
`<key>.jpg|png|webp`, `<key>.txt` (caption) and `<key>.json` (metadata with the `uid`). `iter_tar_samples`
groups members by key (`hype.io.tar`'s rule) without extracting anything to disk; `decode_image` turns the
bytes into an RGB image (`hype.data.imageprep.open_image`, the one decoder); `uid_from_meta` reads the uid
(`hype.data.uids.normalize_uid`, the one uid reading). Nothing here raises on bad data: every problem
becomes a reason counted in `SkipStats` (DESIGN §4.5), so callers can report what was left out and why.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from PIL import Image

from hype.data.imageprep import CORRUPT_IMAGE, IMAGE_TOO_LARGE, ImageError, decode_rgb
from hype.data.uids import normalize_uid
from hype.io.tar import MEMBER_TOO_LARGE, MISSING_SHARD, UNREADABLE_SHARD, read_samples

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
CAPTION_EXT = "txt"
META_EXT = "json"

# Reasons a sample (or a whole shard) is skipped; the keys of SkipStats.counts.
NO_IMAGE = "no_image"
NO_CAPTION = "no_caption"
BAD_CAPTION = "bad_caption"  # not UTF-8
# CORRUPT_IMAGE, IMAGE_TOO_LARGE (hype.data.imageprep): undecodable, or more pixels than MAX_PIXELS
BAD_JSON = "bad_json"  # needed only when a uid is looked up (subset training)
NO_UID = "no_uid"
BAD_UID = "bad_uid"  # a uid that `normalize_uid` refuses (not 32 hex digits)
# MEMBER_TOO_LARGE (hype.io.tar): a member bigger than MAX_MEMBER_BYTES, not read
# UNREADABLE_SHARD (hype.io.tar): a tar that cannot be opened or is truncated mid-way
# MISSING_SHARD (hype.io.tar): a tar that was listed but no longer exists
EMPTY_SHARD = "empty_shard"
SKIP_REASONS = (
    NO_IMAGE,
    NO_CAPTION,
    BAD_CAPTION,
    CORRUPT_IMAGE,
    IMAGE_TOO_LARGE,
    BAD_JSON,
    NO_UID,
    BAD_UID,
    MEMBER_TOO_LARGE,
    UNREADABLE_SHARD,
    MISSING_SHARD,
    EMPTY_SHARD,
)

_MAX_EXAMPLES = 3


@dataclass
class SkipStats:
    """Counts of skipped samples by reason, with the first few messages of each as examples.

    Plain dicts inside, so a copy can cross a DataLoader worker boundary and be merged in the parent.
    """

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, message: str, n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n
        shown = self.examples.setdefault(reason, [])
        if len(shown) < _MAX_EXAMPLES:
            shown.append(message)

    def merge(self, other: SkipStats | dict) -> None:
        if isinstance(other, dict):
            other = SkipStats(
                dict(other.get("counts", {})), {k: list(v) for k, v in other.get("examples", {}).items()}
            )
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
        for reason, msgs in other.examples.items():
            shown = self.examples.setdefault(reason, [])
            shown.extend(msgs[: _MAX_EXAMPLES - len(shown)])

    def take(self) -> dict:
        """The stats as a plain dict, resetting this object (for per-batch deltas)."""
        out = {"counts": self.counts, "examples": self.examples}
        self.counts, self.examples = {}, {}
        return out

    def to_dict(self) -> dict:
        return {"counts": dict(self.counts), "examples": {k: list(v) for k, v in self.examples.items()}}

    @property
    def total(self) -> int:
        """Skipped samples (whole unreadable or empty shards are counted apart, in `counts`)."""
        return sum(
            n for r, n in self.counts.items() if r not in (UNREADABLE_SHARD, MISSING_SHARD, EMPTY_SHARD)
        )


@dataclass
class RawSample:
    """The undecoded members of one sample: extension (lower case) -> bytes."""

    key: str
    shard: str
    files: dict[str, bytes]

    def image_bytes(self) -> bytes | None:
        for ext in IMAGE_EXTS:
            if ext in self.files:
                return self.files[ext]
        return None

    def caption(self) -> str | None:
        """The caption text (stripped), or None when there is no `.txt` member; raises UnicodeDecodeError."""
        data = self.files.get(CAPTION_EXT)
        return None if data is None else data.decode("utf-8").strip()

    def meta(self) -> dict | None:
        """The parsed `.json` member, or None when absent; raises ValueError when it is not a JSON object."""
        data = self.files.get(META_EXT)
        if data is None:
            return None
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        return obj

    @property
    def where(self) -> str:
        return f"{self.shard}:{self.key}"


def iter_tar_samples(path: str, stats: SkipStats) -> Iterator[RawSample]:
    """Stream the samples of one tar in file order (`hype.io.tar`'s grouping rule); a broken tar is counted
    and ends early (samples read before the damage are still yielded)."""
    for key, files in read_samples(path, stats):
        yield RawSample(key=key, shard=path, files=files)


ImageDecodeError = ImageError  # the name the report catches


def decode_image(data: bytes) -> Image.Image:
    """Bytes -> fully decoded RGB PIL image (so truncated files fail here, not later in a transform);
    raises `ImageError` with the skip reason."""
    return decode_rgb(data)[0]


class SampleSkip(ValueError):
    """A sample that must be skipped; `reason` is counted in `SkipStats`, the message is an example."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def uid_from_meta(meta: dict | None, where: str) -> str:
    """The canonical uid of a sample's parsed `.json` (`normalize_uid`); raises `SampleSkip` (no_uid,
    bad_uid) naming the sample and the value."""
    value = None if meta is None else meta.get("uid")
    if not isinstance(value, str):
        raise SampleSkip(NO_UID, f"{where}: no uid in its .json")
    uid = normalize_uid(value)
    if uid is None:
        raise SampleSkip(BAD_UID, f"{where}: malformed uid {value!r} (need 32 hex digits)")
    return uid


def sample_uid(sample: RawSample, stats: SkipStats) -> str | None:
    """The sample's canonical `json["uid"]`, or None (counted) when it is missing, unreadable or malformed."""
    try:
        meta = sample.meta()
    except (ValueError, UnicodeDecodeError) as e:
        stats.add(BAD_JSON, f"{sample.where}: {e}")
        return None
    try:
        return uid_from_meta(meta, sample.where)
    except SampleSkip as e:
        stats.add(e.reason, str(e))
        return None


def decode_pair(sample: RawSample, stats: SkipStats) -> tuple[Image.Image, str] | None:
    """(RGB image, caption) of a sample, or None with the reason counted."""
    data = sample.image_bytes()
    if data is None:
        stats.add(NO_IMAGE, f"{sample.where}: no {'/'.join(IMAGE_EXTS)} member")
        return None
    try:
        caption = sample.caption()
    except UnicodeDecodeError as e:
        stats.add(BAD_CAPTION, f"{sample.where}: caption is not UTF-8 ({e})")
        return None
    if caption is None:
        stats.add(NO_CAPTION, f"{sample.where}: no .txt member")
        return None
    try:
        image = decode_image(data)
    except ImageError as e:
        stats.add(e.reason, f"{sample.where}: {e}")
        return None
    return image, caption

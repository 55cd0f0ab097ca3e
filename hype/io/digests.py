"""hype's digests, one name per algorithm, computed here and nowhere else.

Which record uses which algorithm is fixed: each value is written into markers, fingerprints, cards or
submissions, so changing a record's algorithm would make every existing run redo its work (or fail its
checks). The names say the algorithm, so a caller cannot pick one by accident.

- sha256 (`sha256_file`, `sha256_bytes`, `sha256_chunks`): what a user can check with `sha256sum`
  (checkpoints, model sources, subsets, submissions), the select cache's name, and the fingerprints of
  markers written before the run contract (`hype.io.runs.legacy_fingerprint`).
- blake2b-128 (`blake2b128_file`, `blake2b128_bytes`, `blake2b128_chunks`): the run contract
  (`hype.io.runs.RUN_DIGEST`): fingerprints and the digests of outputs and inputs they name.
- blake2b-32 (`blake2b32_bytes`): the 8 hex of a scoring shard id (`hype.scoring.rundir.shard_id`).
- sha1 (`sha1_bytes`): reshard's names for its input tars in its state folder.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from os import PathLike
from typing import Any

from hype.io.files import open_input

__all__ = [
    "blake2b128_bytes",
    "blake2b128_chunks",
    "blake2b128_file",
    "blake2b32_bytes",
    "sha1_bytes",
    "sha256_bytes",
    "sha256_chunks",
    "sha256_file",
]

Data = bytes | bytearray | memoryview


def _blake2b128() -> Any:
    return hashlib.blake2b(digest_size=16)


def _file(path: str | PathLike, new: Callable[[], Any]) -> str:
    # read in blocks: checkpoints and subsets can be gigabytes
    with open_input(path, stream=True) as f:
        return hashlib.file_digest(f, new).hexdigest()


def _chunks(chunks: Iterable[Data], h: Any) -> str:
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def sha256_file(path: str | PathLike) -> str:
    """sha256 of a file's bytes (local or URL), as `sha256sum` prints it."""
    return _file(path, hashlib.sha256)


def sha256_bytes(data: Data) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_chunks(chunks: Iterable[Data]) -> str:
    """sha256 of the chunks' concatenation."""
    return _chunks(chunks, hashlib.sha256())


def blake2b128_file(path: str | PathLike) -> str:
    """blake2b-128 (`RUN_DIGEST`) of a file's bytes (local or URL)."""
    return _file(path, _blake2b128)


def blake2b128_bytes(data: Data) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def blake2b128_chunks(chunks: Iterable[Data]) -> str:
    """blake2b-128 of the chunks' concatenation."""
    return _chunks(chunks, _blake2b128())


def blake2b32_bytes(data: Data) -> str:
    return hashlib.blake2b(data, digest_size=4).hexdigest()


def sha1_bytes(data: Data) -> str:
    return hashlib.sha1(data).hexdigest()

"""Small file helpers shared by the commands: content digests and tolerant JSON reads."""

from __future__ import annotations

import hashlib
import json
from os import PathLike


def sha256_file(path: str | PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in blocks (checkpoints and subsets can be gigabytes)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_json_dict(path: str | PathLike) -> dict | None:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object (a summary or
    marker from an interrupted run is treated as absent, never as an error)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

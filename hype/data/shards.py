"""Shard discovery: turn a DIR_OR_PATTERN into the list of webdataset tar files it names.

Accepted forms (combine several with `::`, DataComp's separator for multiple sources):
- a folder: every `*.tar` directly inside it, sorted (img2dataset and DataComp resharder output);
- a brace pattern: `pool/{00000000..00000127}.tar` (expanded with `braceexpand`, like webdataset);
- a glob: `pool/*.tar`;
- one `.tar` file.

Every mistake is a `ShardError` naming the pattern and saying what to fix. Zero-byte shards (an
interrupted download) are not fatal: they are returned separately so callers can count and report them.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

from braceexpand import braceexpand

_GLOB_CHARS = set("*?[")
_REMOTE_PREFIXES = ("s3://", "gs://", "http://", "https://", "pipe:", "hf://")


class ShardError(ValueError):
    """A shard specification that names no usable shard; the message names it and the fix."""


@dataclass(frozen=True)
class ShardList:
    """The tar files a specification names, in order (duplicates kept: they upweight a source)."""

    spec: str
    paths: list[str]
    empty: list[str] = field(default_factory=list)  # zero-byte tars, left out of `paths`

    def __len__(self) -> int:
        return len(self.paths)


def expand_shards(spec: str | PathLike | Sequence[str | PathLike]) -> ShardList:
    """Resolve `spec` into existing, non-empty tar files; raise `ShardError` when it names none."""
    parts = _split(spec)
    if not parts:
        raise ShardError("no training data given: pass --data DIR_OR_PATTERN (or set data.train)")
    spec_str = "::".join(parts)
    paths: list[str] = []
    for part in parts:
        paths.extend(_expand_one(part))
    usable, empty = [], []
    for p in paths:
        (empty if os.path.getsize(p) == 0 else usable).append(p)
    if not usable:
        raise ShardError(
            f"{spec_str}: all {len(empty)} shard(s) are empty (0 bytes), e.g. {empty[0]}; "
            "re-download or regenerate them"
        )
    return ShardList(spec=spec_str, paths=usable, empty=empty)


def _split(spec: str | PathLike | Sequence[str | PathLike]) -> list[str]:
    if isinstance(spec, (str, PathLike)):
        items = [os.fspath(spec)]
    else:
        items = [os.fspath(s) for s in spec]
    return [p.strip() for item in items for p in item.split("::") if p.strip()]


def _expand_one(part: str) -> list[str]:
    if part.startswith(_REMOTE_PREFIXES):
        raise ShardError(
            f"{part}: remote shards are not supported; copy them to a local or mounted filesystem first"
        )
    names = list(braceexpand(part))
    out: list[str] = []
    missing: list[str] = []
    for name in names:
        if _GLOB_CHARS & set(name):
            matched = sorted(glob.glob(name))
            tars = [m for m in matched if m.endswith(".tar") and os.path.isfile(m)]
            if not tars:
                raise ShardError(f"{part}: the pattern matches no .tar file; check the path and the pattern")
            out.extend(tars)
        elif os.path.isdir(name):
            out.extend(_tars_in(Path(name), part))
        elif os.path.isfile(name):
            if not name.endswith(".tar"):
                raise ShardError(f"{name}: not a .tar shard; pass a folder of shards, a .tar or a pattern")
            out.append(name)
        else:
            missing.append(name)
    if missing:
        if len(names) == 1:
            raise ShardError(f"{part}: no such file or folder")
        shown = ", ".join(missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
        raise ShardError(
            f"{part}: {len(missing)} of the {len(names)} shards it names do not exist: {shown}; "
            "fix the brace range or download the missing shards"
        )
    return out


def _tars_in(folder: Path, part: str) -> list[str]:
    tars = sorted(str(p) for p in folder.iterdir() if p.suffix == ".tar" and p.is_file())
    if tars:
        return tars
    hint = ""
    # Point at the shards when they sit a level or two deeper (e.g. a synthetic world's clean/shards).
    for pattern in ("*/*.tar", "*/*/*.tar"):
        deeper = next(folder.glob(pattern), None)
        if deeper is not None:
            hint = f"; shards were found in {deeper.parent}: pass that folder"
            break
    raise ShardError(f"{part}: the folder holds no .tar shards{hint}")

"""Shard discovery: turn a DIR_OR_PATTERN into the list of webdataset tar files it names.

Accepted forms (combine several with `::`, DataComp's separator for multiple sources):
- a folder: every `*.tar` directly inside it, sorted (img2dataset and DataComp resharder output);
- a brace pattern: `pool/{00000000..00000127}.tar` (expanded with `braceexpand`, like webdataset);
- a glob: `pool/*.tar`;
- one `.tar` file.

Each form works on local paths and on URLs (`s3://bucket/pool`, `gs://...`, `hf://datasets/...`), through
`hype.io.storage`: a bucket folder is one listing (sizes included), not a request per shard.

Every mistake is a `ShardError` naming the pattern and saying what to fix. Zero-byte shards (an
interrupted download) are not fatal: they are returned separately so callers can count and report them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike

from braceexpand import braceexpand

from hype.io import storage

_GLOB_CHARS = set("*?[")


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
    found: list[tuple[str, int | None]] = []
    for part in parts:
        found.extend(_expand_one(part))
    usable, empty = [], []
    for p, size in found:
        size = storage.size(p) if size is None else size
        (empty if size == 0 else usable).append(p)
    if not usable:
        raise ShardError(
            f"{spec_str}: all {len(empty)} shard(s) are empty (0 bytes), e.g. {empty[0]}; "
            "re-download or regenerate them"
        )
    return ShardList(spec=spec_str, paths=usable, empty=empty)


def absolute_spec(spec: str | PathLike | Sequence[str | PathLike]) -> str:
    """`spec` naming the same shards from any folder: each local part absolute (the folders before its
    first pattern component resolved, the pattern kept), URLs as given."""
    return "::".join(_absolute_part(p) for p in _split(spec))


def _absolute_part(part: str) -> str:
    if storage.is_url(part):
        return part
    parts = os.path.expanduser(part).split(os.sep)
    fixed = next((i for i, p in enumerate(parts) if (_GLOB_CHARS | set("{}")) & set(p)), len(parts))
    head = os.sep.join(parts[:fixed]) or (os.sep if part.startswith(os.sep) else ".")
    return os.path.join(storage.absolute(head), *parts[fixed:])


def _split(spec: str | PathLike | Sequence[str | PathLike]) -> list[str]:
    if isinstance(spec, (str, PathLike)):
        items = [os.fspath(spec)]
    else:
        items = [os.fspath(s) for s in spec]
    return [p.strip() for item in items for p in item.split("::") if p.strip()]


def _expand_one(part: str) -> list[tuple[str, int | None]]:
    """(path, size or None when not known yet) of every shard `part` names."""
    if part.startswith("pipe:"):
        raise ShardError(f"{part}: pipe: shards are not supported; pass the URL itself (s3://, gs://, hf://)")
    names = list(braceexpand(part))
    out: list[tuple[str, int | None]] = []
    missing: list[str] = []
    for name in names:
        if _GLOB_CHARS & set(name):
            tars = [(m, size) for m, size in storage.glob_files(name).items() if m.endswith(".tar")]
            if not tars:
                raise ShardError(f"{part}: the pattern matches no .tar file; check the path and the pattern")
            out.extend(tars)
        elif name.endswith(".tar") and storage.is_file(name):
            out.append((name, None))
        elif storage.is_dir(name):
            out.extend(_tars_in(name, part))
        elif storage.is_file(name):
            raise ShardError(f"{name}: not a .tar shard; pass a folder of shards, a .tar or a pattern")
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


def _tars_in(folder: str, part: str) -> list[tuple[str, int | None]]:
    sizes = storage.list_sizes(folder)  # one listing, sizes included
    tars = [
        (str(storage.join(folder, name)), size)
        for name, size in sorted(sizes.items())
        if name.endswith(".tar")
    ]
    if tars:
        return tars
    hint = ""
    # Point at the shards when they sit a level or two deeper (e.g. a synthetic world's clean/shards).
    for pattern in ("*/*.tar", "*/*/*.tar"):
        deeper = storage.glob(f"{folder.rstrip('/')}/{pattern}")
        if deeper:
            hint = f"; shards were found in {deeper[0].rsplit('/', 1)[0]}: pass that folder"
            break
    raise ShardError(f"{part}: the folder holds no .tar shards{hint}")

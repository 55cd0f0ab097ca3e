"""Webdataset tars: one member-grouping rule, a streaming reader, a header index, and a writer.

The rule (webdataset's, open_clip's and DataComp's resharder's): a member's key is its path up to the
first dot of its basename and its suffix the rest, lower-cased (`dir/0001.seg.JSON` -> `dir/0001`,
`seg.json`: webdataset's `base_plus_ext` split, written out here because webdataset imports torch);
consecutive members with the same key form one sample, and a key change or a suffix the sample already
has starts the next. Only regular files count; hidden names, names without a suffix and webdataset's
`__meta__` entries are not sample members.

Two readers apply it: `read_samples` streams members with their bytes (scoring, training, evaluation);
`index_samples` walks the headers with seeks and yields where each member's data lies, reading no data
(resharding, report thumbnails, eval progress totals). Neither raises on a damaged tar: the problem goes to
`problems` (anything with `add(reason, message)`, e.g. `hype.data.samples.SkipStats`) and the samples
before the damage are still yielded. The stream reports any damage as `unreadable_shard`; the index, which
knows member sizes, reports a cut as `truncated_member`. Both leave out, counted as `member_too_large`, a
sample with a member over `MAX_MEMBER_BYTES`, decided on its header before any of its data is read.
`tarfile` reads a member's extended headers (PAX `x`/`g` records, GNU long names) whole before the member
itself, so they are bounded first (`_BoundedTarInfo`): headers over `MAX_EXTENDED_HEADER_BYTES` are skipped
unread and their member's sample counted as `member_too_large` too; sparse members (never in a shard, and
their maps are read whole) and runs of more than `MAX_EXTENDED_HEADERS` headers make the shard unreadable.
A tar cut at a member boundary, which `tarfile` ends quietly, is caught by its missing end-of-archive
marker; that is why the member loop is ours and not webdataset's `tar_file_iterator` (the same `tarfile`
stream and filters, but it hides where reading ended).

`write_tar` writes ustar members with fixed metadata, so equal members give equal bytes: those `tarfile`
writes (and webdataset's `TarWriter` with mode 0644, mtime 0 and no user or group), faster.
"""

from __future__ import annotations

import os
import posixpath
import re
import tarfile
from collections.abc import Iterable, Iterator
from os import PathLike
from typing import Protocol, TypeVar

from hype.io.files import atomic_write, open_input
from hype.io.storage import StorageError, is_url

UNREADABLE_SHARD = "unreadable_shard"  # a tar that cannot be opened or read to its end
MISSING_SHARD = "missing_shard"  # a tar (object) that no longer exists: deleted after the run was planned
TRUNCATED = "truncated_member"  # (index) member data past the end of the file, or no end-of-archive marker
MEMBER_TOO_LARGE = "member_too_large"  # a sample with a member over MAX_MEMBER_BYTES: skipped, never read

# The largest member a reader loads into memory, checked on its header before any of its data is read. A
# sample with a bigger member is skipped whole (one count), so nothing reads 300 MiB to find a bad image.
# Web images are a few MB; a JPEG at the decoder's pixel cap (hype.data.imageprep.MAX_PIXELS) is ~20 MB.
MAX_MEMBER_BYTES = 32 * 2**20
# Extended headers before one member: real ones hold a long name or a few PAX records (hundreds of bytes).
MAX_EXTENDED_HEADER_BYTES = 2**20
MAX_EXTENDED_HEADERS = 8  # in a row: each is one more level of tarfile's recursion
_EXTENDED = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)

BLOCK = 512
RECORD = 20 * BLOCK
_WDS_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
V = TypeVar("V")


class Problems(Protocol):
    def add(self, reason: str, message: str) -> None: ...


def split_member_name(name: str) -> tuple[str, str] | None:
    """`dir/000000001.jpg` -> (`dir/000000001`, `jpg`), or None for a name that is not a sample member."""
    dirname, base = posixpath.split(name)
    if not base or base.startswith(".") or "." not in base or _WDS_META.match(name):
        return None
    stem, ext = base.split(".", 1)
    return posixpath.join(dirname, stem) if dirname else stem, ext.lower()


def group_members(members: Iterable[tuple[str, str, V]]) -> Iterator[tuple[str, dict[str, V]]]:
    """(key, suffix, value) members in tar order -> (key, {suffix: value}) samples, by the rule above."""
    key: str | None = None
    files: dict[str, V] = {}
    for k, ext, value in members:
        if files and (k != key or ext in files):
            yield key, files  # type: ignore[misc]
            files = {}
        key = k
        files[ext] = value
    if files:
        yield key, files  # type: ignore[misc]


def read_samples(path: str | PathLike, problems: Problems) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {suffix: bytes}) for each sample of a tar (or compressed tar), streamed in file order; a sample
    with a member over `MAX_MEMBER_BYTES` is counted and left out, its data skipped unread."""
    name = _name(path)
    return _capped(name, group_members(_stream_members(name, problems)), problems)


def index_samples(
    path: str | PathLike, problems: Problems
) -> Iterator[tuple[str, dict[str, tuple[int, int]]]]:
    """(key, {suffix: (data offset, size)}) for each sample of an uncompressed tar, reading headers only;
    a sample with a member over `MAX_MEMBER_BYTES` is counted and left out, as in `read_samples`."""
    name = _name(path)
    return _capped(name, group_members(_header_members(name, problems)), problems)


class _TooLarge(int):
    """Stands for the data of a member that was not read: over `MAX_MEMBER_BYTES` (the int is its size), or
    behind extended headers over `MAX_EXTENDED_HEADER_BYTES` (`header`: their size, skipped unread)."""

    header = 0


def _too_large(member: tarfile.TarInfo) -> _TooLarge | None:
    header = getattr(member, "skipped_header", 0)
    if member.size <= MAX_MEMBER_BYTES and not header:
        return None
    big = _TooLarge(member.size)
    big.header = header
    return big


def _capped(path: str, samples: Iterator[tuple[str, dict]], problems: Problems) -> Iterator[tuple[str, dict]]:
    for key, files in samples:
        big = [f"{key}.{ext} {_over(v)}" for ext, v in files.items() if isinstance(v, _TooLarge)]
        if big:
            problems.add(MEMBER_TOO_LARGE, f"{path}: {', '.join(big)}; sample not read")
            continue
        yield key, files


def _over(big: _TooLarge) -> str:
    if big.header:
        return (
            f"(extended headers of {big.header} bytes, over the {MAX_EXTENDED_HEADER_BYTES}-byte limit, "
            "hype.io.tar.MAX_EXTENDED_HEADER_BYTES)"
        )
    return f"({int(big)} bytes, over the {MAX_MEMBER_BYTES}-byte member limit, hype.io.tar.MAX_MEMBER_BYTES)"


def _name(path: str | PathLike) -> str:
    return path if isinstance(path, str) else str(path) if is_url(path) else os.fspath(path)


def _stream_members(path: str, problems: Problems) -> Iterator[tuple[str, str, bytes]]:
    try:
        with (
            open_input(path, stream=True) as f,
            tarfile.open(fileobj=f, mode="r|*", tarinfo=_BoundedTarInfo) as tar,
        ):
            for member, key, ext in _sample_files(tar):
                if (big := _too_large(member)) is not None:  # from the header: the data is skipped unread
                    yield key, ext, big
                else:
                    yield key, ext, tar.extractfile(member).read()  # type: ignore[union-attr]
                tar.members = []  # as webdataset does: a streamed tar need not remember its members
            if tar.fileobj.comptype == "tar" and not _ends_with_marker(f, tar.offset):  # type: ignore[attr-defined]
                problems.add(
                    UNREADABLE_SHARD, f"{path}: no end-of-archive marker after byte {tar.offset}: cut short?"
                )
    except (tarfile.TarError, OSError, EOFError) as e:
        _problem(path, e, problems)


def _problem(path: str, error: BaseException, problems: Problems) -> None:
    """Count a shard that cannot be read: missing, or damaged. A store that failed (retries exhausted,
    refused credentials) is not the shard's fault: re-raised, so the shard fails and a rerun retries it
    instead of recording it as read."""
    if isinstance(error, StorageError):
        raise error
    if isinstance(error, FileNotFoundError):
        problems.add(MISSING_SHARD, f"{path}: no such file or object (deleted after the pool was listed?)")
        return
    problems.add(UNREADABLE_SHARD, f"{path}: {type(error).__name__}: {error}")


def _header_members(path: str, problems: Problems) -> Iterator[tuple[str, str, tuple[int, int]]]:
    try:
        with open_input(path, stream=True) as f:  # a URL: read ahead front to back, seeks skip in memory
            size = f.seek(0, os.SEEK_END)
            f.seek(0)
            # Seekable mode: tarfile seeks over member data instead of reading it.
            with tarfile.open(fileobj=f, mode="r:", tarinfo=_BoundedTarInfo) as tar:
                for member, key, ext in _sample_files(tar):
                    if member.offset_data + member.size > size:
                        problems.add(TRUNCATED, f"{path}:{member.name}: data runs past the end of the tar")
                        return
                    big = _too_large(member)
                    yield key, ext, (member.offset_data, member.size) if big is None else big
                if not _ends_with_marker(f, tar.offset):
                    problems.add(
                        TRUNCATED, f"{path}: no end-of-archive marker after byte {tar.offset}: cut short?"
                    )
    except (tarfile.TarError, OSError, EOFError) as e:
        _problem(path, e, problems)


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile's header parser with extended headers bounded before they are read (see the module docstring).
    `skipped_header`: the bytes of extended headers skipped unread before this member (0: none)."""

    skipped_header = 0

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type not in _EXTENDED:
            tar._hype_extended = (0, 0)  # type: ignore[attr-defined]
            return super()._proc_member(tar)
        count, size = getattr(tar, "_hype_extended", (0, 0))
        count, size = count + 1, size + self.size
        tar._hype_extended = (count, size)  # type: ignore[attr-defined]
        if count > MAX_EXTENDED_HEADERS:
            raise tarfile.TarError(
                f"more than {MAX_EXTENDED_HEADERS} extended headers in a row at byte {self.offset}"
            )
        if size <= MAX_EXTENDED_HEADER_BYTES:
            return super()._proc_member(tar)
        # Over the limit: its data skipped unread (a stream reads it in 10 KiB blocks), and the member it
        # belongs to is read as the ustar header gives it, marked, so that its sample is a counted skip.
        tar.fileobj.seek(tar.fileobj.tell() + self._block(self.size))  # type: ignore[attr-defined]
        member = self.fromtarfile(tar)
        member.offset = self.offset
        member.skipped_header = max(member.skipped_header, size)  # type: ignore[attr-defined]
        return member

    def _refuse_sparse(self, *args: object) -> None:
        raise tarfile.TarError(f"a sparse member at byte {self.offset}: not a webdataset shard")

    # GNU and PAX sparse maps are read whole (the PAX 1.0 map from the member's data, without a bound).
    _proc_sparse = _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


def _sample_files(tar: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, str, str]]:
    """(member, key, suffix) of the regular files that belong to samples (not hidden, with a suffix)."""
    for member in tar:
        if member.isfile() and (parts := split_member_name(member.name)) is not None:
            yield member, *parts


def _ends_with_marker(f, offset: int) -> bool:
    # tarfile stops quietly at a cut-off or damaged header; a complete tar has two zero blocks there.
    f.seek(offset)
    tail = f.read(2 * BLOCK)
    return len(tail) == 2 * BLOCK and not tail.strip(b"\0")


# --- writing --------------------------------------------------------------------------------------


def ustar_header(name: str, size: int, kind: bytes = b"0") -> bytes:
    """A POSIX ustar header with fixed metadata; the same bytes `tarfile` writes for such a member (`kind`:
    the type flag, a regular file unless given)."""
    raw = name.encode("utf-8")
    if len(raw) > 100:
        raise ValueError(f"tar member name too long for ustar: {name!r}")
    head = b"".join(
        [
            raw.ljust(100, b"\0"),
            b"0000644\0",  # mode
            b"0000000\0",  # uid
            b"0000000\0",  # gid
            b"%011o\0" % size,
            b"00000000000\0",  # mtime
            b"        ",  # checksum placeholder
            kind,
            b"\0" * 100,  # linkname
            b"ustar\x0000",
            b"\0" * 64,  # uname, gname
            b"\0" * 16,  # devmajor, devminor: empty for regular files, as tarfile writes them
            b"\0" * 155,  # prefix
        ]
    ).ljust(BLOCK, b"\0")
    chksum = b"%06o\0 " % sum(head)
    return head[:148] + chksum + head[156:]


def write_tar(path: str | PathLike, members: Iterable[tuple[str, bytes]]) -> int:
    """Write `(name, data)` members in the given order, atomically; returns the number of members.

    Hand-rolled because `tarfile` spends more time building headers than writing our tiny files.
    """
    n = 0
    written = 0
    with atomic_write(path) as f:
        for name, data in members:
            pad = -len(data) % BLOCK
            chunk = ustar_header(name, len(data)) + data + b"\0" * pad
            f.write(chunk)
            written += len(chunk)
            n += 1
        end = 2 * BLOCK
        end += -(written + end) % RECORD
        f.write(b"\0" * end)
    return n

"""The one lock on an output: two commands never write the same output at once.

Every command that writes an output holds its lock for the whole run (`output_lock`); a second command on
the same output is refused at once, naming the holder, instead of interleaving its files with the first
one's (each would then report success over a folder that holds a mix, or only the last one's files).

- A local output: `flock` on a lock file, released by the kernel when the holder dies. The file is
  deleted on release; a process that opened it just before is told by the inode check and opens again.
  It is opened as hype's own file (`files.create_own_file`): a symbolic or hard link planted at its name
  is refused, never followed (the lock's record would overwrite the file it points at).
- A URL (`s3://...`): an object created only if absent (a conditional PUT, `storage.create_exclusive`),
  holding who took it, deleted on release. A holder that was killed leaves it behind: a later command on
  the same host whose recorded pid is gone takes it over; from another host it is refused with the holder
  and the command that removes the lock. On a store without conditional writes the create is
  check-then-write, so two commands starting in the same instant could both get in (DESIGN §4.1).

The lock of an output is `.<name>.lock` beside it, so that taking it creates nothing inside the output
(commands check that an output folder is empty or theirs); `hype score` keeps its lock inside its run
directory (`RUN_DIR/.lock`, `lock_at`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from os import PathLike

from hype.io import storage
from hype.io.files import UnsafePathError, create_own_file, make_folder, read_json
from hype.io.storage import AnyPath


class LockError(RuntimeError):
    """An output another command is writing: its lock is held."""


def output_lock(
    out: str | PathLike | AnyPath, command: str, *, what: str = "output", option: str = "--out"
) -> FileLock | ObjectLock:
    """The lock of the output `out` (a file or a folder, local or a URL) for `hype COMMAND`; hold it with
    `with output_lock(out, "reshard"):`. `what` and `option` name the output in the refusal."""
    target = storage.location(storage.absolute(out))  # ./x, x/ and a symlink to x share one lock
    path = target.parent / f".{target.name}.lock" if target.name else target / ".lock"
    return lock_at(path, str(out), command, what=what, option=option)


def lock_at(
    path: str | PathLike | AnyPath, out: str, command: str, *, what: str = "output", option: str = "--out"
) -> FileLock | ObjectLock:
    """The lock held in the file (or object) `path`, guarding the output `out`."""
    p = storage.location(path)
    cls = ObjectLock if storage.is_url(p) else FileLock
    return cls(p, out, command, what, option)


class _Lock:
    def __init__(self, path: AnyPath, out: str, command: str, what: str, option: str):
        self.path, self.out, self.command, self.what, self.option = path, out, command, what, option
        self.token = uuid.uuid4().hex

    def _record(self) -> bytes:
        me = {
            "command": self.command,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": self.token,
            "since": time.time(),
        }
        return json.dumps(me).encode()

    def _holder(self, holder: Mapping) -> tuple[str, str]:
        """(`hype COMMAND`, `pid N[ on HOST]`) of a lock record (a bare pid in older local ones)."""
        command = holder.get("command") or self.command
        host = holder.get("host")
        where = f" on {host}" if host and host != socket.gethostname() else ""
        return f"`hype {command}`", f"pid {holder.get('pid', '?')}{where}"

    def __enter__(self):
        raise NotImplementedError

    def __exit__(self, *exc) -> None:
        raise NotImplementedError


class FileLock(_Lock):
    """A local output's lock: `flock` on `path`."""

    _fd: int | None = None

    def __enter__(self) -> FileLock:
        make_folder(self.path.parent)
        while True:
            try:  # never through a link planted at the lock's name: flock'd and truncated, it is ours
                fd = create_own_file(self.path, reuse=True, mode=0o644)
            except UnsafePathError as e:
                raise LockError(f"{self.out}: cannot take its lock: {e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _parse_record(os.pread(fd, 4096, 0))
                os.close(fd)
                command, who = self._holder(holder)
                raise LockError(
                    f"{self.out}: another {command} ({who}) is running on this {self.what}; "
                    f"wait for it or use another {self.option}"
                ) from None
            # Its last holder may have deleted the file between our open and our flock: then we hold a
            # lock on a file nobody else will open; open the path again.
            try:
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, self._record())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # still held: whoever opened it finds another inode
            os.close(self._fd)
            self._fd = None


def _parse_record(data: bytes) -> dict:
    text = data.decode("utf-8", "replace").strip()
    if text.isdigit():  # written by older versions: the pid alone
        return {"pid": int(text)}
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


class ObjectLock(_Lock):
    """A URL output's lock: the object `path`, created only if absent (see the module docstring)."""

    held = False

    def __enter__(self) -> ObjectLock:
        # A missing bucket or refused credentials, named with the output (some stores create a bucket
        # on the first write, which would be the lock's).
        storage.check_reachable(self.out)
        for _ in range(2):
            if storage.create_exclusive(self.path, self._record()):
                self.held = True
                return self
            holder = read_json(self.path) or {}
            if holder.get("token") == self.token:  # our own create, retried after a lost reply
                self.held = True
                return self
            if not _dead_here(holder):
                break
            storage.remove(self.path)  # its command died on this host: take it over
        command, who = self._holder(holder)
        raise LockError(
            f"{self.out}: another {command} ({who}) holds this {self.what}'s lock ({self.path}); "
            f"wait for it or use another {self.option}. If that run is dead (killed on another machine), "
            f"delete the lock object, e.g. `aws s3 rm {self.path}`, and run again"
        )

    def __exit__(self, *exc) -> None:
        if self.held:
            try:
                storage.remove(self.path)
            except OSError:  # the store is unreachable: the next run on this host takes the lock over
                pass
            self.held = False


def _dead_here(holder: Mapping) -> bool:
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False

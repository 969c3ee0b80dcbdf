"""Small file-system helpers for durable, atomic writes.

A write goes to a temporary file in the same directory, is fsynced, renamed over the target,
and the directory is fsynced, so a crash leaves either the old content or the new, never a
torn file. On a full disk, a small file that already exists can still be rewritten in place
(its block is already allocated): `write_small` falls back to that.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_small(path: str | os.PathLike, data: bytes) -> None:
    """`atomic_write_bytes`, or on a full disk, when `path` exists and `data` fits in its
    first block, an in-place overwrite (one sector-sized write: not torn in practice; the
    reader strips the padding). OSError if neither is possible."""
    try:
        atomic_write_bytes(path, data)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or len(data) > 512:
            raise
        full = exc
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        raise full from None
    try:
        size = os.fstat(fd).st_size
        if size > 512:
            raise full
        padded = data.rstrip(b"\n").ljust(size - 1) + b"\n" if size > len(data) else data
        os.pwrite(fd, padded, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


class NotRegularFile(ValueError):
    """A path that must be a regular file is a FIFO, a device, a directory..."""


class TooLarge(ValueError):
    """A file is larger than its reader takes."""


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of `path`, which must be a regular file of at most `limit` bytes, opened
    without blocking (a FIFO planted there cannot hang the caller; /dev/zero is refused, not
    read until memory runs out). OSError as opening and reading raise it (FileNotFoundError
    when absent); NotRegularFile or TooLarge (ValueErrors) otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile("not a regular file")
        data = b""
        while len(data) <= limit and (block := os.read(fd, limit + 1)):
            data += block
    finally:
        os.close(fd)
    if len(data) > limit:
        raise TooLarge(f"larger than {limit} bytes")
    return data


def dangling(path: Path) -> str | None:
    """What to say of `path` when it is a symbolic link to nothing (a disk not mounted)."""
    if not path.is_symlink() or path.exists():
        return None
    return (f"it is a link to {os.readlink(path)}, which does not exist (is that disk "
            f"mounted?): mount it, or remove the link")


def describe_os_error(exc: OSError) -> str:
    """One line for a failed write: what went wrong, and where."""
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def remove_orphans(parent: Path, prefix: str) -> list[Path]:
    """Remove `parent/<prefix><pid>` and `parent/<prefix><anything>-<pid>` entries whose
    process is gone (a SIGKILL or a power cut left them: nothing else ever would); returns
    what was removed."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        pid = p.name[len(prefix):].rsplit("-", 1)[-1]
        if not (p.name.startswith(prefix) and pid.isdigit()) or _alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, and is another user's
        return True
    return True

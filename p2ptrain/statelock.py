"""One process per state directory: an exclusive `flock` on `<state dir>/lock`, taken before
anything in the directory is read or written and held until the process ends (the kernel
drops it then, also after kill -9, so a stale lock cannot exist).

Two nodes on one directory would share one identity -- one of them invisible to the swarm --
and prune each other's checkpoints; a second process gets a `UserError` naming the directory
and the pid written into the lock file by its holder. The pid is a courtesy: on a full disk
it may be missing, the lock holds all the same. Driver code: files only.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from p2ptrain.errors import UserError
from p2ptrain.fsutil import dangling

LOCK_FILE = "lock"
IDENTITY_MARKERS = (LOCK_FILE, "identity.key")  # files that make a directory a state dir

_held: dict[Path, int] = {}  # directory -> open lock fd, for the life of the process


def lock_state_dir(state_dir: Path, instead: str = "give each node its own --state-dir"
                   ) -> None:
    """Hold `state_dir` for this process (created if absent); UserError if another holds it.
    Taking a directory this process already holds again is a no-op."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        key = state_dir.resolve()
        if key in _held:
            return
        fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        why = (dangling(state_dir) or "it is a file, not a directory"
               if exc.errno == errno.EEXIST and not state_dir.is_dir()
               else exc.strerror or exc)  # (mkdir's "File exists")
        raise UserError(f"cannot use state directory {state_dir}: {why}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _read_pid(fd)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise UserError(f"cannot lock state directory {state_dir}: "
                            f"{exc.strerror or exc}") from None
        by = f"pid {holder}" if holder else "a process whose pid is not recorded"
        raise UserError(f"state directory {state_dir} is in use by another p2ptrain process "
                        f"({by}); stop it first, or {instead}") from None
    _write_pid(fd)
    _held[key] = fd


def state_dir_of(path: Path) -> Path | None:
    """The state directory `path` writes into: `path` itself or, for `<state>/checkpoints`,
    its parent -- if that directory holds a node's files (None otherwise)."""
    for candidate in (path, path.parent) if path.name == "checkpoints" else (path,):
        if any((candidate / name).exists() for name in IDENTITY_MARKERS):
            return candidate
    return None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _write_pid(fd: int) -> None:
    """Record our pid, in place (a full disk still has room in the file's existing block)."""
    data = f"{os.getpid()}\n".encode()
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    except OSError:  # a full disk: the lock holds without the courtesy
        pass

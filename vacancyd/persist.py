"""Private, atomic JSON files under the state directory, and reading files safely.

A state file is written to a temporary sibling, fsynced, renamed over the old one and the
directory fsynced, so a crash leaves either the old file or the new one, never half of
either. Files are 0600 in a 0700 directory: they describe the owner's habits.

A file is read back only if it is what vacancyd itself would have written: it is opened
without following a symbolic link (a link could point anywhere, including at a file
another user may write), it must be a regular file owned by the daemon's user with no
group or other permission bits, and at most `MAX_STATE_FILE_BYTES` of it are read. A
missing file is simply absent (start from defaults); a file that fails any check, or
whose content is corrupt or foreign, raises `UntrustedFile` naming the path and the
reason, so the caller decides what "safe" means for that file and reports it. Nothing
untrustworthy is ever parsed into state, and nothing here crashes the daemon.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import attrs

log = logging.getLogger(__name__)

FORMAT_KEY: Final = "vacancyd_state"

# A state file is a few KiB; anything this large was not written by vacancyd, and reading
# it in full would let whoever made it spend the daemon's memory and CPU at start-up.
MAX_STATE_FILE_BYTES: Final = 16 * 1024 * 1024

_OPEN_FLAGS: Final = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    # A FIFO planted under the file's name would block a plain open forever.
    | getattr(os, "O_NONBLOCK", 0)
)


class UntrustedFile(Exception):
    """A file exists but cannot be trusted; `reason` says why, for a person."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def daemon_uid() -> int | None:
    """The effective uid files must belong to; None where the platform has no uids."""
    return os.geteuid() if hasattr(os, "geteuid") else None


def read_private_bytes(path: Path, *, max_bytes: int, owners: Collection[int]) -> bytes:
    """The bytes of a private regular file, checked on the very file descriptor read.

    Raises FileNotFoundError when nothing is there (the caller's "missing"), and
    UntrustedFile when something is there but is a symbolic link, not a regular file,
    owned by a uid outside `owners` (not checked where the platform has no uids), open to
    group or others, or larger than `max_bytes`. The checks are made with fstat on the
    descriptor that is then read, so the file cannot be swapped between check and read.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        if exc.errno == errno.ELOOP:
            raise UntrustedFile(path, "is a symbolic link; it is not followed") from exc
        raise UntrustedFile(path, f"cannot be opened: {exc.strerror or exc}") from exc
    try:
        _check_descriptor(path, os.fstat(fd), max_bytes=max_bytes, owners=owners)
        return _read_capped(path, fd, max_bytes)
    finally:
        os.close(fd)


def _check_descriptor(
    path: Path, info: os.stat_result, *, max_bytes: int, owners: Collection[int]
) -> None:
    """Refuse what vacancyd would never have written itself (see read_private_bytes)."""
    if not stat.S_ISREG(info.st_mode):
        raise UntrustedFile(path, "is not a regular file")
    if daemon_uid() is not None and info.st_uid not in owners:
        allowed = " or ".join(f"uid {uid}" for uid in sorted(set(owners)))
        raise UntrustedFile(path, f"is owned by uid {info.st_uid}, not by {allowed}")
    mode = stat.S_IMODE(info.st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UntrustedFile(
            path, f"is readable or writable by other users (mode {mode:04o}); chmod 600 it"
        )
    if info.st_size > max_bytes:
        raise UntrustedFile(path, f"is larger than {max_bytes} bytes ({info.st_size})")


def _read_capped(path: Path, fd: int, max_bytes: int) -> bytes:
    """Read at most `max_bytes`; a file that grew past the cap since fstat is refused."""
    chunks: list[bytes] = []
    left = max_bytes + 1
    try:
        while left > 0:
            chunk = os.read(fd, min(left, 1024 * 1024))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise UntrustedFile(path, f"cannot be read: {exc.strerror or exc}") from exc
    if left <= 0:
        raise UntrustedFile(path, f"is larger than {max_bytes} bytes")
    return b"".join(chunks)


def ensure_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)


def write_json(path: Path, kind: str, payload: dict[str, Any]) -> None:
    ensure_private_dir(path.parent)
    document = {FORMAT_KEY: kind, "version": 1, "data": payload}
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(document, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path, kind: str) -> dict[str, Any] | None:
    """The payload of a state file of this kind; None when there is no file.

    Raises UntrustedFile when a file is there but fails the checks of read_private_bytes,
    is not JSON, or is not a vacancyd file of this kind and version.
    """
    uid = daemon_uid()
    try:
        raw = read_private_bytes(
            path, max_bytes=MAX_STATE_FILE_BYTES, owners=() if uid is None else (uid,)
        )
    except FileNotFoundError:
        return None
    try:
        document = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UntrustedFile(path, "is not JSON: not UTF-8 text") from exc
    except (ValueError, RecursionError, MemoryError) as exc:
        # RecursionError: JSON nested deeper than the parser's stack allows.
        raise UntrustedFile(path, f"is not JSON: {type(exc).__name__}: {exc}") from exc
    if (
        not isinstance(document, dict)
        or document.get(FORMAT_KEY) != kind
        or document.get("version") != 1
        or not isinstance(document.get("data"), dict)
    ):
        raise UntrustedFile(path, f"is not a vacancyd {kind} file (version 1)")
    return document["data"]  # type: ignore[no-any-return]


def move_aside(path: Path) -> Path:
    """Rename a rejected file to `<name>.rejected-<UTC time>` beside it; return the new path.

    Nothing is deleted: the operator can still read what was there. A symbolic link is
    moved as the link itself. An existing name is never overwritten.
    """
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    for attempt in range(1000):
        suffix = f".rejected-{stamp}" + (f".{attempt}" if attempt else "")
        target = path.with_name(path.name + suffix)
        if not os.path.lexists(target):
            os.rename(path, target)
            _fsync_dir(path.parent)
            return target
    raise FileExistsError(errno.EEXIST, "no free name to move the file aside", str(path))


@attrs.frozen
class StateFileProblem:
    """A state file that was there but could not be trusted, for the log and /status.

    `consequence` says what vacancyd does about it; `resources` are those it refuses to
    lend because of it (empty when the file's defaults are safe).
    """

    path: str
    kind: str
    reason: str
    consequence: str
    resources: tuple[str, ...] = ()
    found_at: str = attrs.field(
        factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"), eq=False
    )


class StateFileProblems:
    """The state-file problems of this run, one per path, readable from any thread.

    Files are read in worker threads (the calibration store) and shown by the API in the
    trio thread, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[str, StateFileProblem] = {}

    def report(self, problem: StateFileProblem) -> None:
        """Record a problem and log it with its path, reason and consequence."""
        log.warning("state file %s %s; %s", problem.path, problem.reason, problem.consequence)
        with self._lock:
            self._by_path[problem.path] = problem

    def resolve(self, path: Path | str) -> None:
        with self._lock:
            self._by_path.pop(str(path), None)

    @property
    def problems(self) -> tuple[StateFileProblem, ...]:
        with self._lock:
            return tuple(self._by_path[key] for key in sorted(self._by_path))


def runtime_directory(environ: Mapping[str, str]) -> Path | None:
    """Where copies that must outlive a restart, but not a reboot, may go: systemd's
    RuntimeDirectory ($RUNTIME_DIRECTORY, a tmpfs under /run kept across restarts by the
    unit's RuntimeDirectoryPreserve), else a `vacancyd` folder in the login session's
    $XDG_RUNTIME_DIR; None when neither is there."""
    systemd = environ.get("RUNTIME_DIRECTORY", "").split(":", 1)[0]
    if systemd:
        return Path(systemd)
    session = environ.get("XDG_RUNTIME_DIR", "")
    if session and Path(session).is_dir():
        return Path(session) / "vacancyd"
    return None

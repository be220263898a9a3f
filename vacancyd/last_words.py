"""A stuck daemon's thread stacks, into the journal as one entry at error priority.

systemd's watchdog kills a daemon that stopped pinging with SIGABRT, and faulthandler then
writes every thread's stack from inside the signal handler: raw lines on stderr, where
journald makes each line an entry of its own, at the default priority, interleaved with
whatever else was logged. Under systemd ($RUNTIME_DIRECTORY is set, a tmpfs the unit keeps
across restarts) the stacks go to a file there instead, and the next start, seconds later
with `Restart=on-failure`, logs the file as one ERROR record (folded like every multi-line
message, see logs.py) and removes it. Run from a terminal, they go to stderr as before.
"""

from __future__ import annotations

import faulthandler
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO

FILE_NAME = "stacks-at-abort.txt"
# More than any dump of a few threads; a larger file is cut, not read whole.
MAX_REPORTED_BYTES = 256 * 1024

# faulthandler writes to this file's descriptor; it must stay open for the whole run.
_ARMED: list[IO[str]] = []


def arm(log: logging.Logger, environ: Mapping[str, str] = os.environ) -> Path | None:
    """Report the last run's stacks (if it left any), then send this run's there; where
    they go, None for stderr. Never raises: a file that cannot be written leaves the
    stacks on stderr, which is where they went before."""
    directory = environ.get("RUNTIME_DIRECTORY", "").split(":", 1)[0]
    if not directory:
        faulthandler.enable(all_threads=True)
        return None
    path = Path(directory) / FILE_NAME
    report_previous(path, log)
    try:
        handle = path.open("w", encoding="utf-8")
    except OSError as exc:
        log.warning("cannot write %s (%s): stacks at an abort go to stderr", path, exc)
        faulthandler.enable(all_threads=True)
        return None
    faulthandler.enable(file=handle, all_threads=True)
    _ARMED.append(handle)
    return path


def report_previous(path: Path, log: logging.Logger) -> None:
    """Log what the last run's abort left in `path` as one record, and remove it."""
    try:
        with path.open("rb") as handle:
            dump = handle.read(MAX_REPORTED_BYTES + 1)
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("cannot read the last run's stacks in %s: %s", path, exc)
        return
    if not dump.strip():
        return
    cut = len(dump) > MAX_REPORTED_BYTES
    text = dump[:MAX_REPORTED_BYTES].decode("utf-8", "replace").rstrip()
    log.error(
        "the last run was stopped by a fatal signal (a watchdog timeout sends SIGABRT); "
        "its threads were at:\n%s%s",
        text,
        "\n[cut]" if cut else "",
    )

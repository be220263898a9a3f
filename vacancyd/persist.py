"""Private, atomic JSON files under the state directory.

A state file is written to a temporary sibling, fsynced, renamed over the old one and the
directory fsynced, so a crash leaves either the old file or the new one, never half of
either. Files are 0600 in a 0700 directory: they describe the owner's habits. A file that
is corrupt, foreign or unreadable is reported and replaced by a safe default, never
trusted and never a crash.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT_KEY = "vacancyd_state"


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
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_json(path: Path, kind: str) -> dict[str, Any] | None:
    """The payload of a state file of this kind, or None (logged) when it cannot be trusted."""
    try:
        text = path.read_text("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("state file %s is unreadable (%s); starting from defaults", path, exc)
        return None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        log.warning("state file %s is corrupt (%s); starting from defaults", path, exc)
        return None
    if (
        not isinstance(document, dict)
        or document.get(FORMAT_KEY) != kind
        or document.get("version") != 1
        or not isinstance(document.get("data"), dict)
    ):
        log.warning("state file %s is not a vacancyd %s file; starting from defaults", path, kind)
        return None
    return document["data"]  # type: ignore[no-any-return]

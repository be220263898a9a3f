"""Learned footprints: what real loads of a model were measured to take, kept across restarts.

A footprint measured on this machine (the GPU's free memory before and after a load, or
the upstream's process tree for host memory) is better evidence than any estimate, so
admission uses it when the operator configured none. It is kept per (upstream, model,
resource) in `<state_dir>/footprints.json`, privately and atomically through
vacancyd.persist.

The prior is conservative: it is the largest of the last `WINDOW` (3) observations. A
single lower observation therefore never lowers it; it comes down only after three loads
in a row measured less (a model re-quantised, a smaller context configured), so one
measurement disturbed by the owner freeing memory mid-load cannot make vacancyd lend
more than a real load takes, while a prior that is simply out of date does not stay
wrong forever. A higher observation raises it at once.

`record`, `get` and `snapshot` touch no files: they are safe to call from the trio thread.
`load` and `save` are blocking file I/O for a worker thread. A lock makes the two sides
safe together.

Nothing read back is trusted. A file persist refuses (a symbolic link, another user's,
too large, corrupt or foreign) is reported through the daemon's state-file problems and
ignored: with no learned priors, requests fall back to the configured, estimated or
default footprint, which is the conservative side. The file is replaced at the next save.
An entry that fails validation is logged and left out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from vacancyd.persist import (
    StateFileProblem,
    StateFileProblems,
    UntrustedFile,
    read_json,
    write_json,
)

log = logging.getLogger(__name__)

FOOTPRINTS_FILE: Final = "footprints.json"
FOOTPRINTS_KIND: Final = "footprints"
WINDOW: Final = 3
MAX_ENTRIES: Final = 512
MAX_NAME_CHARS: Final = 512
MAX_MIB: Final = 1 << 30  # a PiB: anything larger is not a measurement
UNTRUSTED_CONSEQUENCE: Final = (
    "learned footprints start from nothing (requests use the configured, estimated or "
    "default footprint); the file is replaced at the next save"
)


class LearnedFootprints:
    """The learned footprint of every (upstream, model), per resource, in MiB."""

    def __init__(self, state_dir: Path, problems: StateFileProblems | None = None) -> None:
        self.path = Path(state_dir) / FOOTPRINTS_FILE
        self._problems = problems if problems is not None else StateFileProblems()
        self._lock = threading.Lock()
        # (upstream, model) -> {"upstream", "model", "updated": ISO time,
        #                       "resources": {name: [recent MiB, oldest first]}},
        # oldest-updated first; saved in this order as a list.
        self._entries: dict[tuple[str, str], dict[str, Any]] = {}
        self._dirty = False
        self._generation = 0

    def load(self) -> None:
        """Read the file (blocking); what cannot be trusted is reported and left out."""
        try:
            payload = read_json(self.path, FOOTPRINTS_KIND)
        except UntrustedFile as exc:
            self._problems.report(
                StateFileProblem(str(self.path), FOOTPRINTS_KIND, exc.reason, UNTRUSTED_CONSEQUENCE)
            )
            with self._lock:
                self._entries = {}
            return
        entries: dict[tuple[str, str], dict[str, Any]] = {}
        models = payload.get("models") if payload is not None else []
        if not isinstance(models, list):
            self._problems.report(
                StateFileProblem(
                    str(self.path), FOOTPRINTS_KIND, "has no list of models", UNTRUSTED_CONSEQUENCE
                )
            )
            models = []
        for position, entry in enumerate(models[-MAX_ENTRIES:]):
            problem = _entry_problem(entry)
            if problem is not None:
                log.warning(
                    "footprints file %s: ignoring entry %d: %s", self.path, position, problem
                )
                continue
            entries[(entry["upstream"], entry["model"])] = _copy_entry(entry)
        with self._lock:
            self._entries = entries
            self._dirty = False

    def save(self) -> None:
        """Write every entry atomically (0600 in a 0700 directory). May raise OSError."""
        with self._lock:
            models = [_copy_entry(entry) for entry in self._entries.values()]
            generation = self._generation
        write_json(self.path, FOOTPRINTS_KIND, {"models": models})
        self._problems.resolve(self.path)
        with self._lock:
            # Still dirty if something was recorded while the file was being written.
            self._dirty = self._generation != generation

    @property
    def dirty(self) -> bool:
        """Whether something was recorded since the last load or save."""
        with self._lock:
            return self._dirty

    def record(self, upstream: str, model: str, resource: str, mib: int) -> int:
        """Take one measured load into account; return the prior it leaves (see module).

        Raises ValueError for a measurement that cannot be one (negative, absurdly large,
        not an integer) or names too long to keep.
        """
        if isinstance(mib, bool) or not isinstance(mib, int) or not 0 <= mib <= MAX_MIB:
            raise ValueError(f"not a measured footprint in MiB: {mib!r}")
        if max(len(upstream), len(model), len(resource)) > MAX_NAME_CHARS:
            raise ValueError("upstream, model or resource name too long to keep")
        key = (upstream, model)
        with self._lock:
            entry = self._entries.pop(key, None) or {
                "upstream": upstream,
                "model": model,
                "resources": {},
            }
            recent = entry["resources"].setdefault(resource, [])
            recent.append(mib)
            del recent[:-WINDOW]
            prior: int = max(recent)
            entry["updated"] = datetime.now(UTC).isoformat(timespec="seconds")
            # Re-inserted last, so the oldest-updated entry is the first one dropped.
            self._entries[key] = entry
            while len(self._entries) > MAX_ENTRIES:
                del self._entries[next(iter(self._entries))]
            self._dirty = True
            self._generation += 1
            return prior

    def get(self, upstream: str, model: str) -> dict[str, int]:
        """The learned footprint of a model per resource (MiB); empty when none is known."""
        with self._lock:
            entry = self._entries.get((upstream, model))
            if entry is None:
                return {}
            return {name: max(recent) for name, recent in entry["resources"].items()}

    def snapshot(self) -> dict[str, Any]:
        """Every learned footprint, for /status: plain JSON values, sorted for reading."""
        with self._lock:
            rows = [
                {
                    "upstream": entry["upstream"],
                    "model": entry["model"],
                    "need_mib": {n: max(r) for n, r in sorted(entry["resources"].items())},
                    "observations": {n: list(r) for n, r in sorted(entry["resources"].items())},
                    "updated": entry.get("updated", ""),
                }
                for entry in self._entries.values()
            ]
        rows.sort(key=lambda row: (row["upstream"], row["model"]))
        return {"path": str(self.path), "window": WINDOW, "models": rows}


def _copy_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "upstream": entry["upstream"],
        "model": entry["model"],
        "resources": {name: list(recent) for name, recent in entry["resources"].items()},
        "updated": str(entry.get("updated", "")),
    }


def _entry_problem(entry: Any) -> str | None:
    """Why a saved entry cannot be used, or None if it can."""
    if not isinstance(entry, Mapping):
        return "not an object"
    upstream, model, resources = entry.get("upstream"), entry.get("model"), entry.get("resources")
    if not isinstance(upstream, str) or not isinstance(model, str):
        return "upstream and model must be strings"
    if max(len(upstream), len(model)) > MAX_NAME_CHARS:
        return "names too long"
    if not isinstance(resources, Mapping) or not resources:
        return "no resources"
    for name, recent in resources.items():
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
            return "a resource name is not a string"
        if (
            not isinstance(recent, list)
            or not 1 <= len(recent) <= WINDOW
            or any(
                isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_MIB
                for v in recent
            )
        ):
            return f"resource {name!r}: not a list of 1 to {WINDOW} measurements in MiB"
    if not isinstance(entry.get("updated", ""), str):
        return "updated is not a string"
    return None

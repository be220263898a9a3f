"""The saved calibration of every GPU: `<state_dir>/calibration.json`.

Ten observed minutes of refusals after every restart would be a poor welcome, and a
threshold re-learned from nothing would also forget its bounded-rise history. So each
learned threshold is saved (privately and atomically, through vacancyd.persist) and
restored at start.

Entries are keyed by the resource name *and* the card's identity (its UUID where one is
known). A card swapped into the same slot, or a config that points `gpu0` at another
device, starts learning afresh instead of inheriting a threshold learned on different
hardware. Entries of cards not in use today are kept (up to a bound), so moving a card
back and forth does not lose what was learned.

Nothing read back is trusted: a file persist refuses (a symbolic link, another owner's,
too large, corrupt or foreign) is ignored and reported, in the log and through the
daemon's state-file problems in /status, so a reset calibration is never silent; an entry
that fails validation is reported here and ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from vacancyd.collect.threshold import LearnedThreshold, validate_payload
from vacancyd.persist import (
    StateFileProblem,
    StateFileProblems,
    UntrustedFile,
    read_json,
    write_json,
)

log = logging.getLogger(__name__)

CALIBRATION_FILE: Final = "calibration.json"
CALIBRATION_KIND: Final = "calibration"
MAX_ENTRIES: Final = 32
UNTRUSTED_CONSEQUENCE: Final = (
    "learned pressure thresholds start from nothing; the file is replaced at the next save"
)


def calibration_key(resource: str, device_identity: str) -> str:
    """The cache key of one GPU: its resource name and its device identity together."""
    return f"{resource}@{device_identity}"


class CalibrationStore:
    """Loads, holds and saves the learned thresholds of all GPUs (blocking file I/O)."""

    def __init__(self, state_dir: Path, problems: StateFileProblems | None = None) -> None:
        self.path = Path(state_dir) / CALIBRATION_FILE
        self._entries: dict[str, dict[str, Any]] = {}
        self._problems = problems if problems is not None else StateFileProblems()

    def load(self) -> None:
        """Read the file; whatever cannot be trusted is reported and left out."""
        self._entries = {}
        try:
            gpus = self._read_gpus()
        except UntrustedFile as exc:
            self._problems.report(
                StateFileProblem(
                    str(self.path), CALIBRATION_KIND, exc.reason, UNTRUSTED_CONSEQUENCE
                )
            )
            return
        for key, entry in gpus.items():
            problem = _entry_problem(key, entry)
            if problem is not None:
                log.warning("calibration cache %s: ignoring entry %r: %s", self.path, key, problem)
                continue
            self._entries[key] = entry

    def _read_gpus(self) -> dict[str, Any]:
        """The saved table of GPUs; empty with no file, UntrustedFile when it is unusable."""
        payload = read_json(self.path, CALIBRATION_KIND)
        if payload is None:
            return {}
        gpus = payload.get("gpus")
        if not isinstance(gpus, dict):
            raise UntrustedFile(self.path, "has no table of GPUs")
        return gpus

    def saved(self, resource: str, device_identity: str) -> dict[str, Any] | None:
        """The saved calibration of this GPU, if the file held a trustworthy one.

        Pass it to `pressure_guard.build_threshold`, which applies today's cap and model.
        """
        entry = self._entries.get(calibration_key(resource, device_identity))
        return None if entry is None else dict(entry["calibration"])

    def update(self, resource: str, device_identity: str, threshold: LearnedThreshold) -> None:
        """Take this GPU's current calibration into the next save."""
        key = calibration_key(resource, device_identity)
        self._entries.pop(key, None)
        self._entries[key] = {
            "resource": resource,
            "device": device_identity,
            "calibration": threshold.to_dict(),
        }
        while len(self._entries) > MAX_ENTRIES:
            # Oldest-updated first: dicts keep insertion order and update re-inserts.
            del self._entries[next(iter(self._entries))]

    def save(self) -> None:
        """Write every entry atomically (0600 in a 0700 directory). May raise OSError."""
        write_json(self.path, CALIBRATION_KIND, {"gpus": dict(self._entries)})

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self._entries)


def _entry_problem(key: Any, entry: Any) -> str | None:
    if not isinstance(entry, Mapping):
        return "not an object"
    resource = entry.get("resource")
    device = entry.get("device")
    if not isinstance(resource, str) or not isinstance(device, str):
        return "resource and device must be strings"
    if key != calibration_key(resource, device):
        return "its key does not match its resource and device"
    return validate_payload(entry.get("calibration"))

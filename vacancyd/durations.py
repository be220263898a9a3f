"""Durations as people type them on the command line: "90s", "10m", "2h", "1h30m", "1d".

A bare number is seconds. Units run from days down to seconds, each at most once, so a
typo such as "10mm" or "1m2h" is an error rather than a guess.
"""

from __future__ import annotations

import re

_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")


def parse_duration(text: str) -> float:
    """Seconds in `text`; ValueError saying what is wrong otherwise."""
    cleaned = text.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", cleaned):
        return float(cleaned)
    position = 0
    total = 0.0
    order = list(_UNITS)
    last = -1
    for match in _PART.finditer(cleaned):
        if match.start() != position:
            break
        index = order.index(match.group(2))
        if index <= last:
            raise ValueError(f"{text!r}: units must go from days down to seconds, once each")
        last = index
        total += float(match.group(1)) * _UNITS[match.group(2)]
        position = match.end()
    if position != len(cleaned) or not cleaned:
        raise ValueError(f"{text!r} is not a duration (examples: 90s, 10m, 2h, 1h30m, 1d)")
    return total


def describe_duration(seconds: float) -> str:
    """A duration for a person: "2h", "1h30m", "45s"."""
    remaining = round(seconds)
    if remaining <= 0:
        return "0s"
    parts = []
    for unit, size in _UNITS.items():
        count, remaining = divmod(remaining, int(size))
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)

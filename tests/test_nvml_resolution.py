"""The rule that says which device a configured GPU is, as a table (pure: no NVML)."""

from __future__ import annotations

import pytest

from vacancyd.collect.nvml.naming import DeviceIdentity, DeviceSelector
from vacancyd.collect.nvml.resolution import Resolved, Unresolved, resolve

A = DeviceIdentity(0, "GPU-aaaa", "00000000:01:00.0", "Card A")
B = DeviceIdentity(1, "GPU-bbbb", "00000000:02:00.0", "Card B")
TWIN = DeviceIdentity(1, "GPU-aaaa", "00000000:02:00.0", "Card A again")
BOTH = {0: A, 1: B}

ROWS: list[tuple[str, object, str | None, dict[int, object], set[int], dict[str, str], object]] = [
    # id, device, pinned uuid, found, broken, claimed by others, expected
    ("index", 1, None, BOTH, set(), {}, ("ok", 1)),
    ("uuid", "GPU-bbbb", None, BOTH, set(), {}, ("ok", 1)),
    ("uuid-any-case", "gpu-BBBB", None, BOTH, set(), {}, ("ok", 1)),
    ("bus-id-short", "0000:02:00.0", None, BOTH, set(), {}, ("ok", 1)),
    ("no-such-index", 5, None, BOTH, set(), {}, ("no", "no GPU at index 5", False)),
    (
        "unreadable-index",
        0,
        None,
        {0: "NVML could not open GPU 0"},
        set(),
        {},
        ("no", "could not open", False),
    ),
    ("no-match", "GPU-cccc", None, BOTH, set(), {}, ("no", "no GPU matches GPU-cccc", False)),
    (
        "ambiguous",
        "GPU-aaaa",
        None,
        {0: A, 1: TWIN},
        set(),
        {},
        ("no", "name exactly one GPU", False),
    ),
    # NVML renumbered the survivors after a loss: index 0 is now another card.
    ("renumbered", 0, "GPU-bbbb", BOTH, set(), {}, ("no", "renumbers GPUs", True)),
    ("pinned-same", 0, "GPU-AAAA", BOTH, set(), {}, ("ok", 0)),
    ("gone-after-seen", "GPU-bbbb", "GPU-bbbb", {0: A}, set(), {}, ("no", "no GPU matches", True)),
    ("broken-after-seen", 1, "GPU-bbbb", {1: "GPU is lost"}, {1}, {}, ("no", "GPU is lost", True)),
    ("unreadable-not-lost", 1, "GPU-bbbb", {1: "slow"}, set(), {}, ("no", "slow", False)),
    (
        "claimed-twice",
        0,
        None,
        BOTH,
        set(),
        {"gpu9": "gpu-aaaa"},
        ("no", "already resource 'gpu9'", False),
    ),
]


@pytest.mark.parametrize(
    ("device", "pinned", "found", "broken", "claimed", "expected"),
    [row[1:] for row in ROWS],
    ids=[row[0] for row in ROWS],
)
def test_resolution_table(
    device: int | str,
    pinned: str | None,
    found: dict[int, DeviceIdentity | str],
    broken: set[int],
    claimed: dict[str, str],
    expected: tuple[object, ...],
) -> None:
    got = resolve(DeviceSelector.parse(device), pinned, found, broken, 2, claimed)
    if expected[0] == "ok":
        assert isinstance(got, Resolved) and got.index == expected[1]
    else:
        assert isinstance(got, Unresolved)
        assert expected[1] in got.why
        assert got.lost is expected[2]


def test_a_refusal_lists_what_nvml_sees() -> None:
    got = resolve(DeviceSelector.parse("GPU-cccc"), None, BOTH, set(), 2, {})
    assert isinstance(got, Unresolved)
    assert "NVML sees 2 GPUs (0: GPU-aaaa at 00000000:01:00.0, 1: GPU-bbbb" in got.why

"""Which device a configured GPU is: the resolution rule, as a pure function.

Given what one NVML session could open (each index's identity, or why it could not be
read), a configured selector is resolved to exactly one device or refused with the
reason, never guessed:

* an index names that index, if NVML has it and could read it;
* a UUID or PCI bus id must match exactly one readable device (a census is taken, since
  only all of them can show a name is unique);
* a resource that resolved before is pinned to that device's UUID: NVML renumbers the
  survivors when a GPU drops off the bus, so "index 0" after a loss may be another card,
  which is refused (and marked lost) rather than measured;
* one device is never two resources.

`lost` on a refusal says the GPU was found before and has gone (the collector then
initialises NVML afresh); a GPU never found is a naming problem, not a loss.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from vacancyd.collect.nvml.naming import DeviceIdentity, DeviceSelector


@attrs.frozen
class Resolved:
    index: int
    identity: DeviceIdentity


@attrs.frozen
class Unresolved:
    why: str
    lost: bool = False


def resolve(
    selector: DeviceSelector,
    pinned_uuid: str | None,
    found: Mapping[int, DeviceIdentity | str],
    broken: frozenset[int] | set[int],
    count: int,
    claimed: Mapping[str, str],
) -> Resolved | Unresolved:
    """Resolve `selector` against one session's census.

    `found` maps each index that was tried to its identity or why it could not be read;
    `broken` holds indexes whose failure broke the session; `claimed` maps the other
    resources to the UUIDs they already hold.
    """
    readable = sorted(
        (identity for identity in found.values() if isinstance(identity, DeviceIdentity)),
        key=lambda identity: identity.index,
    )
    seen = census(readable, count)
    was_seen = pinned_uuid is not None
    if selector.index is not None:
        result = found.get(selector.index)
        if result is None:
            return Unresolved(f"no GPU at index {selector.index}; {seen}", lost=was_seen)
        if isinstance(result, str):
            return Unresolved(result, lost=was_seen and selector.index in broken)
        match = result
    else:
        matches = [identity for identity in readable if selector.matches(identity)]
        if len(matches) > 1:
            both = " and ".join(identity.describe() for identity in matches)
            return Unresolved(f"{selector.text} matches {both}; name exactly one GPU")
        if not matches:
            why = f"no GPU matches {selector.text}; {seen}"
            unreadable = [why for why in found.values() if isinstance(why, str)]
            if unreadable:
                why += "; not readable: " + "; ".join(unreadable)
            return Unresolved(why, lost=was_seen)
        match = matches[0]
    if pinned_uuid is not None and match.uuid.lower() != pinned_uuid.lower():
        return Unresolved(
            f"{selector.text} is now {match.describe()}, but it was {pinned_uuid}"
            " (NVML renumbers GPUs when one disappears); not measuring a different GPU",
            lost=True,
        )
    for resource, uuid in claimed.items():
        if uuid.lower() == match.uuid.lower():
            return Unresolved(
                f"{match.describe()} is already resource {resource!r};"
                " one GPU cannot be lent as two resources"
            )
    return Resolved(match.index, match)


def census(readable: list[DeviceIdentity], count: int) -> str:
    """What NVML sees, for a refusal's reason."""
    plural = "" if count == 1 else "s"
    if not readable:
        return f"NVML sees {count} GPU{plural}"
    listed = ", ".join(
        f"{identity.index}: {identity.uuid} at {identity.pci_bus_id}" for identity in readable
    )
    return f"NVML sees {count} GPU{plural} ({listed})"

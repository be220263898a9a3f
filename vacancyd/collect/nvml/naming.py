"""Naming a GPU: how the config says which card it means, and how a card identifies itself.

Pure: no NVML, no clock. A configured device is an index, a PCI bus id or a UUID; a
device NVML opened identifies itself by all three. Matching is exact (bus ids in either
of their spellings), because guessing which card was meant lends the wrong one.
"""

from __future__ import annotations

import re

import attrs

_PCI_ADDRESS = re.compile(
    r"(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<device>[0-9a-f]{1,2})"
    r"(?:\.(?P<function>[0-7]))?",
    re.IGNORECASE,
)


@attrs.frozen
class PciAddress:
    """A PCI address compared by number, so "0000:01:00.0" and "00000000:01:00.0" agree.

    `domain` None means the text left it out. It then matches any domain: on a machine
    with several PCI domains that can fit two GPUs, which is reported as ambiguous rather
    than resolved to domain 0 as NVML's own lookup would.
    """

    domain: int | None
    bus: int
    device: int
    function: int

    @classmethod
    def parse(cls, text: str) -> PciAddress | None:
        match = _PCI_ADDRESS.fullmatch(text.strip())
        if match is None:
            return None
        domain = match["domain"]
        return cls(
            domain=None if domain is None else int(domain, 16),
            bus=int(match["bus"], 16),
            device=int(match["device"], 16),
            function=int(match["function"] or "0", 16),
        )

    def matches(self, other: PciAddress) -> bool:
        same_domain = self.domain is None or other.domain is None or self.domain == other.domain
        return same_domain and (self.bus, self.device, self.function) == (
            other.bus,
            other.device,
            other.function,
        )


@attrs.frozen
class DeviceIdentity:
    """Who a GPU is, as NVML reported it when its handle was taken."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str

    def describe(self) -> str:
        return f"GPU {self.index} ({self.name}, {self.uuid} at {self.pci_bus_id})"


@attrs.frozen
class DeviceSelector:
    """A configured `device`, parsed once: exactly one of index, uuid and pci is set."""

    text: str
    index: int | None = None
    uuid: str | None = None
    pci: PciAddress | None = None

    @classmethod
    def parse(cls, device: int | str | None) -> DeviceSelector:
        """Raises ValueError with the reason when `device` names no GPU at all."""
        if device is None:
            raise ValueError("no device configured (an index, PCI bus id or GPU UUID)")
        if isinstance(device, int):
            if device < 0:
                raise ValueError(f"device {device} is not a GPU index")
            return cls(text=f"index {device}", index=device)
        text = device.strip()
        if text[:4].upper() == "GPU-":
            return cls(text=text, uuid=text.lower())
        if text[:4].upper() == "MIG-":
            raise ValueError(f"device {text!r} is a MIG instance; name its parent GPU")
        pci = PciAddress.parse(text)
        if pci is None:
            raise ValueError(f"device {text!r} is not an index, a PCI bus id or a GPU UUID")
        return cls(text=f"PCI {text}", pci=pci)

    def matches(self, identity: DeviceIdentity) -> bool:
        if self.index is not None:
            return identity.index == self.index
        if self.uuid is not None:
            return identity.uuid.lower() == self.uuid
        found = PciAddress.parse(identity.pci_bus_id)
        return self.pci is not None and found is not None and self.pci.matches(found)


# -- blocking NVML calls (worker threads only) ---------------------------------------------

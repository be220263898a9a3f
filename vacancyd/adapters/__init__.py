"""Upstream adapters: what each inference server's routes mean, as data.

No module outside this package names a product. The proxy asks an adapter to classify a
request and to read what it needs from a body; everything product-specific stays here.
"""

from vacancyd.adapters.actions import (
    CancelReport,
    JobState,
    ReclaimActions,
    UnloadReport,
    UpstreamContext,
)
from vacancyd.adapters.base import Adapter, Classification, Dialect, RouteClass, WorkFacts
from vacancyd.adapters.registry import adapter_for

__all__ = [
    "Adapter",
    "CancelReport",
    "Classification",
    "Dialect",
    "JobState",
    "ReclaimActions",
    "RouteClass",
    "UnloadReport",
    "UpstreamContext",
    "WorkFacts",
    "adapter_for",
]

"""What the admin API reads and acts on, handed over once as one value.

The service builds every part before the API starts; the API (and the status document
the service's notifications read) take this bundle instead of a dozen arguments, so
adding a part is one field here rather than a new parameter threaded through each call.
The bundle is frozen and its tables are read-only views, taken when it is made: the API
cannot add an upstream's reclaim or guard, only use the ones the service made.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from vacancyd.admission import Admission, Ledger
from vacancyd.api.operator import OperatorTools
from vacancyd.api.vacancy import Provers
from vacancyd.auth import Authenticator
from vacancyd.controls import OwnerControls
from vacancyd.decisions import DecisionLog
from vacancyd.footprint.book import FootprintBook
from vacancyd.published import Published
from vacancyd.reclaim import UpstreamReclaim
from vacancyd.serving import ListenerGuard
from vacancyd.state import SharedState


def _read_only(table: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(table))


@attrs.frozen(kw_only=True)
class DaemonParts:
    state: SharedState
    published: Published
    ledger: Ledger
    decisions: DecisionLog
    auth: Authenticator
    # Per upstream: whether its server can be asked to unload (the adapter's actions and
    # the upstream's yield_on_veto), its listener's guard and its reclaim.
    can_unload: Mapping[str, bool] = attrs.field(factory=dict, converter=_read_only)
    guards: Mapping[str, ListenerGuard] = attrs.field(factory=dict, converter=_read_only)
    reclaims: Mapping[str, UpstreamReclaim] = attrs.field(factory=dict, converter=_read_only)
    # Optional parts: routes and /status sections for what is not given are left out.
    operator: OperatorTools | None = None
    admission: Admission | None = None
    footprints: FootprintBook | None = None
    controls: OwnerControls | None = None
    provers: Provers | None = None

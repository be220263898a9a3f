"""Value types shared by every layer of vacancyd.

Everything here is a frozen attrs value with no behaviour that touches the outside world:
no clock, no I/O, no trio. The gate decides from these values alone, which is what lets
its tests be plain tables and lets the API print exactly what a decision saw.
"""

from __future__ import annotations

import enum

import attrs


class Quality(enum.Enum):
    """How far a reading can be trusted.

    UNKNOWN means nothing usable was ever read (or the probe cannot run); STALE means a
    reading exists but is older than its freshness bound. Both refuse: a plausible default
    would let a dead collector lend the machine.
    """

    UNKNOWN = "unknown"
    READY = "ready"
    STALE = "stale"


class ResourceKind(enum.Enum):
    MEMORY = "memory"
    CPU = "cpu"
    NVIDIA_GPU = "nvidia_gpu"

    @property
    def has_bytes(self) -> bool:
        """CPU has no byte capacity; memory and VRAM do, and only those are budgeted."""
        return self is not ResourceKind.CPU


class OwnerScope(enum.Enum):
    """Whether an upstream answers to the owner's presence ("host") or only to its resources."""

    HOST = "host"
    RESOURCE = "resource"


class Reason(enum.Enum):
    """Why a borrowed request was refused; the value is the wire code gateways see."""

    LENDING_DISABLED = "lending_disabled"
    OWNER_ACTIVE = "owner_active"
    RESOURCE_DISABLED = "resource_disabled"
    RESOURCE_UNMEASURED = "resource_unmeasured"
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    RESOURCE_PRESSURED = "resource_pressured"
    RESOURCE_BUSY = "resource_busy"
    # A job vacancyd could not prove stopped holds the resource until proof or an admin.
    JOB_HELD = "job_held"
    # The owner lends only in weekly windows ([owner] lending_hours); this is outside them.
    OUTSIDE_LENDING_HOURS = "outside_lending_hours"
    # The upstream missed a deadline for an answer and has not answered a health read since.
    UPSTREAM_UNRESPONSIVE = "upstream_unresponsive"
    # The machine runs on its battery (UPower OnBattery) and the owner lends on mains only.
    ON_BATTERY = "on_battery"
    # A GPU is hotter than its max_temperature_c, or the driver throttles it for heat or
    # power; it is lent again once it has stayed cool for the guard's release time.
    RESOURCE_HOT = "resource_hot"


class PressureQuality(enum.Enum):
    """A pressure guard adds UNCALIBRATED: it reads, but has not learned a threshold yet."""

    UNKNOWN = "unknown"
    STALE = "stale"
    UNCALIBRATED = "uncalibrated"
    READY = "ready"


class SessionState(enum.Enum):
    """What a presence backend saw at the machine's console.

    UNREADABLE is a session that exists but could not be read clearly; it refuses
    host-scoped work. NO_BACKEND is the platform without a presence source: an honest
    unknown that, as documented, gates on capacity alone.
    """

    LOGGED_OUT = "logged_out"
    ACTIVE = "active"
    IDLE = "idle"
    LOCKED = "locked"
    UNREADABLE = "unreadable"
    NO_BACKEND = "no_backend"


@attrs.frozen
class Observation:
    """One capacity reading of one resource, stamped with trio time when it was taken."""

    resource: str
    taken_at: float
    total_bytes: int | None = None
    free_bytes: int | None = None
    utilization_pct: float | None = None
    detail: str = ""


@attrs.frozen
class PresenceReading:
    """One sample of who is at the machine, stamped with trio time."""

    backend: str
    taken_at: float
    session: SessionState
    owner_programs: tuple[str, ...] = ()
    detail: str = ""
    # logind idle inhibitors held by the owner ("who: why (uid 1000)"): the owner's own
    # "keep my machine" switch, which makes them present whatever the session says.
    idle_inhibitors: tuple[str, ...] = ()
    # The session agent's deciding signal, where an agent judged the owner's desk
    # ("media playing: firefox (mpris)"); empty where logind's hints decided.
    agent_signal: str = ""


@attrs.frozen
class PowerReading:
    """Whether the machine runs on its battery, stamped with trio time. `on_battery` is
    None where it is not read (no UPower, no system bus): such a machine lends as before."""

    on_battery: bool | None
    taken_at: float
    detail: str = ""


@attrs.frozen
class PressureView:
    """The per-resource pressure guard as the gate sees it."""

    quality: PressureQuality
    engaged: bool = False
    detail: str = ""


@attrs.frozen
class HeatView:
    """A GPU's heat guard as the gate sees it (only where `max_temperature_c` is set).

    `quality` is UNKNOWN while the GPU's temperature could not be read (a GPU that does
    not report it stays so, and is never lent: a guard that cannot see heat must not
    guess), STALE when readings stopped arriving. `throttle_reasons` are the driver's
    clock event reasons as words, None where the driver does not report them;
    `engaged_at` is the trio time the guard last engaged, None while it is released.
    """

    quality: Quality
    engaged: bool = False
    detail: str = ""
    temperature_c: float | None = None
    throttle_reasons: tuple[str, ...] | None = None
    engaged_at: float | None = None


@attrs.frozen
class ResourceView:
    """Everything the gate needs about one resource, already judged for freshness.

    `lendable` is the resource's capacity policy applied to the reading (for example "keep
    2 GiB free for the owner"); `spare_mib` is what may be charged to a borrowed model
    after that reserve, or None where the resource has no byte capacity.
    """

    name: str
    switch_on: bool
    quality: Quality
    lendable: bool = True
    policy_detail: str = ""
    spare_mib: int | None = None
    pressure: PressureView | None = None
    quality_detail: str = ""
    heat: HeatView | None = None


@attrs.frozen
class PresenceView:
    """The owner's side of the decision, already judged for freshness."""

    sampled: bool
    fresh: bool
    evidence_complete: bool
    veto_engaged: bool
    detail: str = ""


@attrs.frozen
class LendingHoursView:
    """The owner's lending hours as the gate sees them, already judged against the wall
    clock by the shared state (the gate reads no clock).

    `opens_in_s` is how long until the next window opens while closed, None when none
    will (or while open); `detail` says when, in the owner's time, for the operator.
    """

    open: bool = True
    opens_in_s: float | None = None
    detail: str = ""


@attrs.frozen
class ModelNeed:
    """What one request would cost on each budgeted resource, in MiB.

    `resident_credit` is set only when residency was proved; the gate then charges
    `resident_min_free_mib` instead of the load requirement.
    """

    model: str | None
    need_mib: dict[str, int] = attrs.field(factory=dict)
    # Host memory the part of a model its server spilled to the CPU takes, charged on a
    # request that may load it (not on one with residency credit: it is there already).
    spill_mib: dict[str, int] = attrs.field(factory=dict)
    resident_credit: bool = False
    resident_min_free_mib: int = 0
    credit_detail: str = ""
    # Where need_mib came from: "configured", "learned", "estimated" or "default"; per
    # resource in `sources`, and `source` is the upstream's primary resource's (see
    # admission/need.py for the order and the default's floor).
    source: str = ""
    sources: dict[str, str] = attrs.field(factory=dict)
    # How the footprint was found, for the operator (a refusal's internal detail).
    detail: str = ""


@attrs.frozen
class Residency:
    """What an upstream showed about one request's model, read from the upstream itself.

    `resident` says the request would reuse a model the server holds as loaded (so it
    loads nothing); `detail` says why or why not, for a person. `slots` is how many
    requests the server serves at once for that model (None: it does not say). `taken_at`
    is trio time of the
    reading; `source` names what was read (for example "/slots", "/api/ps").
    """

    resident: bool
    taken_at: float
    source: str
    detail: str
    model: str | None = None
    slots: int | None = None
    # Memory the server's own allocator holds and reuses for the next job (ComfyUI): none
    # of it is the owner's, so it is added back to the request's one GPU.
    reusable_mib: int = 0


@attrs.frozen
class FootprintHint:
    """A model's footprint that is not configured: learned from measured loads, or
    estimated from its geometry. `source` says which, `detail` how it was found;
    `sources` names it per resource where the resources differ."""

    need_mib: dict[str, int]
    source: str  # "learned" or "estimated"
    detail: str = ""
    sources: dict[str, str] = attrs.field(factory=dict)

    def source_of(self, resource: str) -> str:
        return self.sources.get(resource, self.source)


@attrs.frozen
class GateInput:
    """One complete, frozen question to the gate."""

    upstream: str
    owner_scope: OwnerScope
    lending_enabled: bool
    presence: PresenceView
    resources: tuple[ResourceView, ...]
    need: ModelNeed
    lending_hours: LendingHoursView = LendingHoursView()
    # Why the upstream counts as not answering (it missed a deadline for an answer and
    # has not answered a health read since); empty while it answers.
    upstream_not_answering: str = ""
    # The machine runs on its battery and the owner lends on mains power only.
    on_battery: bool = False
    # The machine is about to sleep (logind's PrepareForSleep), until it has woken.
    machine_sleeping: bool = False


@attrs.frozen
class Admit:
    detail: str = ""

    @property
    def admitted(self) -> bool:
        return True


@attrs.frozen
class Refuse:
    """A refusal. `detail` is said to the borrower; `internal` is the evidence behind it
    that only the operator sees (collector errors, bus errors, the owner's programs),
    because a borrower has no business knowing the host's internals."""

    reason: Reason
    retry_after_s: int
    detail: str
    resource: str | None = None
    internal: str = ""

    @property
    def for_operator(self) -> str:
        """The detail with its evidence, for logs, /status and the decision log."""
        return f"{self.detail} ({self.internal})" if self.internal else self.detail

    @property
    def admitted(self) -> bool:
        return False


Decision = Admit | Refuse

# Retry hints a gateway sees for each refusal. owner_active has three: presence not yet
# (or no longer) sampled, a session that cannot be read clearly, and the owner's veto.
RETRY_LENDING_DISABLED = 300
RETRY_PRESENCE_UNSAMPLED = 5
RETRY_SESSION_INCOMPLETE = 30
RETRY_OWNER_VETO = 120
RETRY_RESOURCE_DISABLED = 300
RETRY_RESOURCE_UNMEASURED = 30
RETRY_INSUFFICIENT_CAPACITY = 30
RETRY_RESOURCE_PRESSURED = 30
RETRY_RESOURCE_BUSY = 2
# A hold ends on proof that the job stopped (polled every few seconds where the upstream
# can say) or on an admin's word, which takes minutes: come back then, not in 2 s.
RETRY_JOB_HELD = 300
# Outside the lending hours, Retry-After is the time until the next window opens, but at
# most an hour: a gateway that takes it literally still asks again within the hour (the
# daemon restarted with other hours, a clock set right) and never sleeps for days.
RETRY_OUTSIDE_HOURS_MAX = 3600
# A server that stopped answering is read again every few seconds; a gateway that comes
# back in half a minute finds it answering again, or is told again.
RETRY_UPSTREAM_UNRESPONSIVE = 30
# A laptop is plugged in again on a scale of minutes to hours.
RETRY_ON_BATTERY = 300
# A hot GPU cools for the guard's release time (60 s by default) before it is lent again.
RETRY_RESOURCE_HOT = 60

MIB = 1024 * 1024

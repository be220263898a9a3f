"""The configuration's shape: frozen attrs classes whose field names are the TOML keys.

Field names match the file exactly so that an error's key path is the path the operator
typed. Range rules live in field metadata (`ge`, `gt`, `le`) and are checked by the
loader with paths, because attrs validators would report them without one.
"""

from __future__ import annotations

import enum
import functools

import attrs

from vacancyd.config.addresses import Target, parse_target
from vacancyd.model import OwnerScope, Reason, ResourceKind


def _ge(bound: float) -> dict[str, float]:
    return {"ge": bound}


def _gt(bound: float) -> dict[str, float]:
    return {"gt": bound}


class Scope(enum.Enum):
    """What a bearer token may reach: borrow (the proxies), read (status, metrics), admin."""

    BORROW = "borrow"
    READ = "read"
    ADMIN = "admin"


class PresenceBackend(enum.Enum):
    AUTO = "auto"
    LOGIND = "logind"
    HEADLESS = "headless"


class AdapterName(enum.Enum):
    OLLAMA = "ollama"
    OPENAI = "openai"
    LLAMACPP = "llamacpp"
    COMFYUI = "comfyui"
    CHATTERBOX = "chatterbox"


class OnOwnerReturn(enum.Enum):
    DRAIN = "drain"
    CANCEL = "cancel"
    FINISH = "finish"


class SpilledModels(enum.Enum):
    """What a borrowed request to a model its server spilled to the CPU gets."""

    CHARGE = "charge"  # admitted only if host memory and CPU can take it too
    REFUSE = "refuse"  # refused: the owner does not lend CPU inference


class Management(enum.Enum):
    DENY = "deny"
    ALLOW = "allow"


class BusyStatus(enum.Enum):
    """The status of a `resource_busy` refusal. 503 is every refusal's; 429 reads to a
    gateway as "too many right now, come back soon", which LiteLLM and others handle under
    a policy of its own (docs/gateways.md, "Busy is not absent")."""

    SERVICE_UNAVAILABLE = 503
    TOO_MANY_REQUESTS = 429


class LogLevel(enum.Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@attrs.frozen
class LimitsConfig:
    """Bounds that keep a slow or hostile client from holding a listener's resources."""

    max_request_body_mib: int = attrs.field(default=64, metadata=_gt(0))
    # None: 256 MiB, or max_request_body_mib if that is larger.
    max_buffered_body_mib: int | None = attrs.field(default=None, metadata=_gt(0))
    header_timeout_s: float = attrs.field(default=10.0, metadata=_gt(0))
    # A request head (request line and headers) must end within this many bytes and carry
    # at most this many header lines, however its bytes arrive; over either: 431.
    max_head_bytes: int = attrs.field(default=16384, metadata=_ge(1024))
    max_header_count: int = attrs.field(default=100, metadata=_ge(8))
    body_read_timeout_s: float = attrs.field(default=120.0, metadata=_gt(0))
    body_idle_timeout_s: float = attrs.field(default=30.0, metadata=_gt(0))
    write_stall_timeout_s: float = attrs.field(default=60.0, metadata=_gt(0))
    max_connections: int = attrs.field(default=512, metadata=_ge(1))
    max_websockets: int = attrs.field(default=64, metadata=_ge(1))
    websocket_idle_timeout_s: float = attrs.field(default=600.0, metadata=_gt(0))
    upstream_connect_timeout_s: float = attrs.field(default=5.0, metadata=_gt(0))
    # How long an upstream may take to start answering (its response head), from the
    # moment the request is sent: work routes get long, since a model may load first and
    # a request that is not streamed answers only at the end; pass-through reads are short.
    work_first_byte_timeout_s: float = attrs.field(default=300.0, metadata=_gt(0))
    pass_first_byte_timeout_s: float = attrs.field(default=30.0, metadata=_gt(0))
    # The longest silence between two pieces of an answer's body (a streamed generation
    # sends a token every fraction of a second; a stopped server sends nothing at all).
    upstream_idle_timeout_s: float = attrs.field(default=120.0, metadata=_gt(0))

    @property
    def buffered_budget_mib(self) -> int:
        if self.max_buffered_body_mib is not None:
            return self.max_buffered_body_mib
        return max(256, self.max_request_body_mib)


@attrs.frozen
class ServerConfig:
    api_listen: str = "127.0.0.1:9460"
    poll_interval_s: float = attrs.field(default=3.0, metadata=_gt(0))
    # Empty means the platform default: /var/lib/vacancyd for root, else the XDG state dir.
    state_dir: str = ""
    log_level: LogLevel = LogLevel.INFO
    shutdown_grace_s: float = attrs.field(default=10.0, metadata=_gt(0))
    probe_deadline_s: float = attrs.field(default=2.0, metadata=_gt(0))
    limits: LimitsConfig = attrs.Factory(LimitsConfig)


@attrs.frozen
class TokenConfig:
    """A bearer token, stored so that a leaked config file does not leak it.

    Either `sha256` (hex digest of the token) or `file` (a private file holding the token
    itself, which is also how the CLI finds a credential) must be given, not both.
    """

    name: str
    scopes: list[Scope]
    sha256: str | None = None
    file: str | None = None


@attrs.frozen
class AuthConfig:
    tokens: list[TokenConfig] = attrs.Factory(list)
    # The owner at the keyboard: requests from 127.0.0.0/8 and ::1 pass without a token.
    trust_loopback: bool = True
    allow_unauthenticated_remote: bool = False


@attrs.frozen
class LendingWindow:
    """One weekly lending window in the owner's wall time (see vacancyd/schedule.py).

    `from_` is the TOML key `from` (a Python keyword): metadata "key" names the key the
    loader reads and reports. Times are strings "HH:MM"; `to` may be "24:00", and a `to`
    at or before `from` ends the next day. `days` default to every day of the week.
    """

    from_: str = attrs.field(metadata={"key": "from"})
    to: str
    days: list[str] = attrs.Factory(lambda: ["mon", "tue", "wed", "thu", "fri", "sat", "sun"])


@attrs.frozen
class OwnerConfig:
    presence: PresenceBackend = PresenceBackend.AUTO
    release_after_s: float = attrs.field(default=60.0, metadata=_ge(0))
    lend_when_locked: bool = True
    lend_when_idle: bool = True
    # Lend while the machine runs on its battery (UPower's OnBattery); off: a laptop
    # unplugged refuses host-scoped work `on_battery` and reclaims what runs.
    lend_on_battery: bool = False
    # With a session agent reporting: the owner counts as present while their last input
    # is more recent than this (an agent's idle reading; logind's IdleHint is not used).
    idle_after_s: float = attrs.field(default=300.0, metadata=_gt(0))
    # The socket session agents report on; empty: agent.sock in the runtime directory
    # ($RUNTIME_DIRECTORY, /run/vacancyd under the unit), and no agents without one.
    agent_socket: str = ""
    owner_processes: list[str] = attrs.Factory(list)
    # Weekly windows outside which host-scoped upstreams refuse; empty: lend at any hour.
    lending_hours: list[LendingWindow] = attrs.Factory(list)
    # The IANA zone lending_hours are read in ("Europe/Berlin"); empty: the machine's own.
    timezone: str = ""


@attrs.frozen
class PressureConfig:
    """Attributed owner load on a GPU. `threshold_pct` unset means a learned threshold."""

    enabled: bool = True
    threshold_pct: float | None = attrs.field(default=None, metadata=_gt(0))
    cap_pct: float = attrs.field(default=30.0, metadata=_gt(0))
    poll_ms: int = attrs.field(default=1000, metadata=_ge(100))
    engage_after_s: float = attrs.field(default=2.0, metadata=_ge(0))
    release_after_s: float = attrs.field(default=30.0, metadata=_ge(0))


@attrs.frozen
class HeatConfig:
    """The heat guard's release rule on a GPU with `max_temperature_c` (see vacancyd/heat.py).

    It engages on the first reading over the limit or with a thermal or power-brake
    slowdown; it releases only after readings at or below the limit minus
    `release_margin_c`, with no such slowdown, for `release_after_s`. The margin keeps a
    card that hovers at its limit from being lent and taken back every few seconds.
    """

    release_margin_c: float = attrs.field(default=5.0, metadata=_ge(0))
    release_after_s: float = attrs.field(default=60.0, metadata=_ge(0))


@attrs.frozen
class ResourceConfig:
    name: str
    kind: ResourceKind
    enabled: bool = True
    # nvidia_gpu only: index, PCI bus id ("0000:01:00.0") or UUID ("GPU-...").
    device: int | str | None = None
    # Capacity policy: memory the owner always keeps (memory, nvidia_gpu) ...
    keep_free_mib: int = attrs.field(default=0, metadata=_ge(0))
    # ... and the utilisation above which the resource is not lent (cpu, nvidia_gpu).
    max_utilization_pct: float | None = attrs.field(default=None, metadata=_gt(0))
    pressure: PressureConfig | None = None
    # nvidia_gpu only: not lent while hotter than this, in degrees Celsius, or while the
    # driver slows it down for heat or power; unset: no heat guard, nothing read.
    max_temperature_c: float | None = attrs.field(default=None, metadata=_gt(0))
    # The heat guard's release rule; only with max_temperature_c.
    heat: HeatConfig | None = None
    # An emergency floor no borrowed load may eat into, on top of keep_free_mib (memory,
    # nvidia_gpu): this share of the total, but at least emergency_reserve_min_mib.
    emergency_reserve_pct: float = attrs.field(default=10.0, metadata=_ge(0))
    emergency_reserve_min_mib: int = attrs.field(default=2048, metadata=_ge(0))


@attrs.frozen
class ModelConfig:
    """A measured footprint: MiB that must be spare on each named resource to load it."""

    need_mib: dict[str, int] = attrs.Factory(dict)


@attrs.frozen
class UpstreamConfig:
    name: str
    adapter: AdapterName
    listen: str
    target: str
    resource: str
    also_requires: list[str] = attrs.Factory(list)
    owner_scope: OwnerScope = OwnerScope.HOST
    on_owner_return: OnOwnerReturn = OnOwnerReturn.DRAIN
    drain_timeout_s: float = attrs.field(default=30.0, metadata=_ge(0))
    completion_timeout_s: float = attrs.field(default=600.0, metadata=_gt(0))
    yield_on_veto: bool = True
    management: Management = Management.DENY
    forward_authorization: bool = False
    # A file holding the credential vacancyd presents to the upstream itself.
    credential_file: str | None = None
    # Browser origins ("https://app.example") whose pages may call this upstream; their
    # CORS preflights are answered with allow headers. Empty: none may.
    cors_allow_origins: list[str] = attrs.Factory(list)
    # Refusal reasons that tell SDK clients to retry in place (x-should-retry: true); every
    # other refusal says false, so the client fails over instead of sleeping Retry-After.
    retry_in_place: list[Reason] = attrs.Factory(lambda: [Reason.RESOURCE_BUSY])
    # The status of a refusal because every slot is serving borrowed work (resource_busy);
    # every other refusal is 503.
    busy_status: BusyStatus = BusyStatus.SERVICE_UNAVAILABLE
    default_need_mib: dict[str, int] = attrs.Factory(dict)
    models: dict[str, ModelConfig] = attrs.Factory(dict)
    resident_min_free_mib: int = attrs.field(default=0, metadata=_ge(0))
    # Most borrowed requests served at once on a model the upstream proved resident. Unset:
    # what the server reports (llama.cpp's slots), else 1.
    max_concurrent: int | None = attrs.field(default=None, metadata=_ge(1))
    # Hand-off between upstreams on one GPU (docs/configuration.md): how long this
    # upstream's borrowed models must sit idle before another upstream's borrower may have
    # their memory; how long this upstream's borrowers wait for another to give way (0:
    # they never ask); and its priority (unset: the adapter's). A borrower may ask only
    # upstreams whose priority is not above its own upstream's.
    handoff_idle_s: float = attrs.field(default=60.0, metadata=_ge(0))
    handoff_timeout_s: float = attrs.field(default=15.0, metadata=_ge(0))
    handoff_priority: int | None = None
    # A model the server placed partly in host memory (Ollama, when the GPU had no room):
    # charge its requests on the host's memory and CPU resources as well, or refuse them.
    spilled_models: SpilledModels = SpilledModels.CHARGE

    @functools.cached_property
    def endpoint(self) -> Target:
        """`target`, parsed once: the loader checks every upstream's, so it is valid in a
        loaded config (ValueError only for one built by hand with a bad URL)."""
        return parse_target(self.target)

    @functools.cached_property
    def resources(self) -> tuple[str, ...]:
        """Every resource a borrowed request to this upstream holds: its own first."""
        return (self.resource, *self.also_requires)


@attrs.frozen
class Config:
    server: ServerConfig = attrs.Factory(ServerConfig)
    auth: AuthConfig = attrs.Factory(AuthConfig)
    owner: OwnerConfig = attrs.Factory(OwnerConfig)
    resource: list[ResourceConfig] = attrs.Factory(list)
    upstream: list[UpstreamConfig] = attrs.Factory(list)

    def resource_named(self, name: str) -> ResourceConfig:
        for resource in self.resource:
            if resource.name == name:
                return resource
        raise KeyError(name)

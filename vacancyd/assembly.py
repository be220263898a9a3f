"""The daemon's parts, built: the admission core every listener shares, and one upstream.

The service (service.py) starts these in its supervision tree; tests that need a real
proxy, tunnel and reclaim for one upstream build them here too, so they run the wiring
the daemon runs instead of a copy of it that can drift.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from vacancyd.adapters.base import Adapter
from vacancyd.adapters.registry import adapter_for
from vacancyd.admission import Admission, Ledger
from vacancyd.auth import Authenticator, read_token_file
from vacancyd.config import Config, LimitsConfig, UpstreamConfig, parse_listen, resolve_state_dir
from vacancyd.controls import OwnerControls
from vacancyd.decisions import DecisionLog
from vacancyd.errors import StartupError
from vacancyd.footprint.book import FootprintBook
from vacancyd.persist import StateFileProblems, ensure_private_dir, runtime_directory
from vacancyd.proxy.app import ProxyApp
from vacancyd.proxy.health import HealthWatch
from vacancyd.proxy.tunnel import WebSocketTunnels, is_websocket_request
from vacancyd.reachability import Reachability
from vacancyd.reclaim import UpstreamReclaim
from vacancyd.serving import ListenerGuard, serve_app
from vacancyd.spills import SpillWatch
from vacancyd.state import SharedState

log = logging.getLogger("vacancyd.service")


@attrs.frozen
class Core:
    """What every listener and loop of one run shares: the readings, the owner's switches,
    the ledger with its restored holds, admission and the credentials."""

    config: Config
    # None for a core that keeps nothing on disk (see build_core).
    state_dir: Path | None
    runtime_dir: Path | None
    state: SharedState
    state_files: StateFileProblems
    controls: OwnerControls
    ledger: Ledger
    decisions: DecisionLog
    admission: Admission
    auth: Authenticator

    @property
    def limits(self) -> LimitsConfig:
        return self.config.server.limits

    def files(self) -> Path:
        """The state directory, for the parts that keep files (calibrations, footprints)."""
        if self.state_dir is None:
            raise RuntimeError("this core keeps no files (built with keep_files=False)")
        return self.state_dir


def build_core(
    config: Config, environ: Mapping[str, str] | None = None, *, keep_files: bool = True
) -> Core:
    """The shared core, before anything is lent: the state directory made private, the
    owner's saved switches restored (a pause survives a restart) and the durable holds
    re-held. StartupError when the state directory cannot be made.

    `keep_files=False` makes a core that reads and writes no file: switches and holds
    live in memory only. The daemon never runs so; a rig that tests one upstream's parts
    under a MockClock does.
    """
    state_dir = resolve_state_dir(config) if keep_files else None
    if state_dir is not None:
        try:
            ensure_private_dir(state_dir)
        except OSError as exc:
            raise StartupError(f"server.state_dir {state_dir}: {exc.strerror or exc}") from exc
    state = SharedState(config)
    # Untrusted state files, reported by each part that reads one, shown in /status.
    state_files = StateFileProblems()
    controls = OwnerControls.for_config(state, state_dir, state_files=state_files)
    controls.restore()
    runtime_dir = (
        runtime_directory(os.environ if environ is None else environ) if keep_files else None
    )
    ledger = Ledger(
        state,
        holds_path=state_dir / "holds.json" if state_dir is not None else None,
        state_files=state_files,
        runtime_dir=runtime_dir,
    )
    restored = ledger.restore_holds(set(state.resources))
    if restored:
        log.warning("%d durable hold(s) restored: those resources refuse until released", restored)
    decisions = DecisionLog([u.name for u in config.upstream])
    return Core(
        config=config,
        state_dir=state_dir,
        runtime_dir=runtime_dir,
        state=state,
        state_files=state_files,
        controls=controls,
        ledger=ledger,
        decisions=decisions,
        admission=Admission(state, ledger, decisions),
        auth=Authenticator(config.auth),
    )


def read_credential(upstream: UpstreamConfig, index: int) -> str | None:
    """The credential vacancyd presents to the upstream, read from its file (a config
    problem, with the key path, if it cannot be trusted)."""
    if not upstream.credential_file:
        return None
    return read_token_file(
        upstream.credential_file, f"upstream[{index}].credential_file", "credential file"
    )


@attrs.frozen
class UpstreamParts:
    """One upstream's share of the daemon: its listener's app and WebSocket tunnels behind
    one guard, the reclaim that takes its borrowed work back, the health read for a server
    that stopped answering, and, where the server can spill models to the CPU, their watch.
    """

    upstream: UpstreamConfig
    adapter: Adapter
    credential: str | None
    app: ProxyApp
    tunnels: WebSocketTunnels
    guard: ListenerGuard
    reclaim: UpstreamReclaim
    health: HealthWatch
    spills: SpillWatch | None
    limits: LimitsConfig

    @property
    def can_unload(self) -> bool:
        """Whether a reclaim may ask this server to give its memory back."""
        return self.adapter.actions is not None and self.upstream.yield_on_veto

    def listener(self, *, grace_s: float, shutdown_trigger: Callable[[], Awaitable[None]]) -> Any:
        """The upstream's listener as a component to start: `serve_app` on its `listen`
        address, HTTP to the app and WebSocket upgrades to the tunnels, behind the guard.
        Started, it reports the addresses it bound."""
        return partial(
            serve_app,
            self.app,
            parse_listen(self.upstream.listen),
            self.limits,
            grace_s=grace_s,
            shutdown_trigger=shutdown_trigger,
            guard=self.guard,
        )


def build_upstream(
    core: Core,
    upstream: UpstreamConfig,
    client: httpx.AsyncClient,
    *,
    credential: str | None = None,
    footprints: FootprintBook | None = None,
    learned_dir: Path | None = None,
    reachability: Reachability | None = None,
    background: trio.Nursery | None = None,
) -> UpstreamParts:
    """Build (not start) one upstream's parts. `background` is where the app starts the
    trackers of jobs the upstream runs after answering; `footprints` and `learned_dir`
    are where loads are learned (none: nothing is); `reachability` is shared by the
    upstream's app, tunnels and health read (a new one when not given)."""
    adapter = adapter_for(upstream.adapter.value)
    reachability = reachability if reachability is not None else Reachability()
    app = ProxyApp(
        upstream,
        adapter,
        core.admission,
        core.auth,
        core.limits,
        client,
        credential,
        learned_dir,
        footprints,
        reachability=reachability,
    )
    app.background = background
    tunnels = WebSocketTunnels(
        upstream,
        adapter,
        app.target,
        core.admission,
        core.auth,
        core.limits,
        credential,
        reachability=reachability,
        connector=app.connector,
    )
    guard = ListenerGuard(
        core.limits, takeover=tunnels.take_over, wants_takeover=is_websocket_request
    )
    spills = (
        SpillWatch(upstream, adapter, core.state, core.ledger, client, credential)
        if adapter.give_way.read_spills is not None
        else None
    )
    return UpstreamParts(
        upstream=upstream,
        adapter=adapter,
        credential=credential,
        app=app,
        tunnels=tunnels,
        guard=guard,
        reclaim=UpstreamReclaim(upstream, adapter, core.state, core.ledger, client, credential),
        health=HealthWatch(upstream.name, adapter, core.state, app.context(), reachability),
        spills=spills,
        limits=core.limits,
    )

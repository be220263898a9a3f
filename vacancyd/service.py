"""The daemon's root nursery: start-up order, supervision and shutdown.

Every long-lived component is essential and started with `nursery.start`, so the daemon
only reports ready once each one says it is. If any of them returns or raises while the
daemon is running, that is logged with the component's name and the daemon exits
non-zero: a half-dead vacancyd answering liveness checks would be worse than none.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import trio

from vacancyd.adapters import adapter_for
from vacancyd.admission import Admission, Ledger
from vacancyd.api.app import create_api_app
from vacancyd.api.status import status_document
from vacancyd.auth import Authenticator, read_token_file
from vacancyd.collect.calibration_store import CalibrationStore
from vacancyd.collect.listeners import SCAN_EVERY_S, run_listener_watch
from vacancyd.collect.nvml import NvmlCollector
from vacancyd.collect.pressure import PressureCollector
from vacancyd.collect.system import run_system_collector
from vacancyd.config import Config, parse_listen, parse_target, resolve_state_dir
from vacancyd.controls import OwnerControls
from vacancyd.decisions import DecisionLog
from vacancyd.errors import StartupError
from vacancyd.footprint.book import FootprintBook
from vacancyd.model import ResourceKind
from vacancyd.operations import Operations
from vacancyd.persist import ensure_private_dir
from vacancyd.presence.backends import choose_backend
from vacancyd.presence.loop import run_presence
from vacancyd.proxy.app import ProxyApp
from vacancyd.proxy.forward import open_upstream_client
from vacancyd.proxy.tunnel import WebSocketTunnels, is_websocket_request
from vacancyd.reclaim import UpstreamReclaim
from vacancyd.serving import ListenerGuard, serve_app
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

Component = Callable[..., Awaitable[Any]]


class EssentialTaskFailed(Exception):
    """An essential component returned or raised while the daemon was running."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"essential task {name!r} {why}")
        self.name = name


class Supervisor:
    """Runs essential components; any of them ending early takes the daemon down."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.stopping = False
        self.running: set[str] = set()
        self._ended = trio.Event()

    async def start(self, name: str, component: Component) -> Any:
        return await self._nursery.start(self._run, name, component)

    async def _run(
        self, name: str, component: Component, *, task_status: trio.TaskStatus[Any]
    ) -> None:
        self.running.add(name)
        try:
            await component(task_status=task_status)
        except BaseException as exc:
            if _only_cancellation(exc):
                raise
            why = describe_failure(exc)
            log.critical("essential task %s failed: %s", name, why)
            raise EssentialTaskFailed(name, f"failed: {why}") from exc
        finally:
            self.running.discard(name)
            self._ended.set()
            self._ended = trio.Event()
        if not self.stopping:
            log.critical("essential task %s exited unexpectedly", name)
            raise EssentialTaskFailed(name, "exited unexpectedly")

    async def wait_ended(self, names: set[str]) -> None:
        """Return once none of `names` is still running."""
        while self.running & names:
            await self._ended.wait()


def _only_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return isinstance(exc, trio.Cancelled)


async def _background_nursery(*, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    """A nursery for short-lived tasks that outlive the request that started them."""
    async with trio.open_nursery() as nursery:
        task_status.started(nursery)
        await trio.sleep_forever()


def describe_failure(exc: BaseException) -> str:
    """Name the real errors inside any nesting of exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe_failure(inner) for inner in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


async def _watch_signals(stop: trio.Event, *, task_status: trio.TaskStatus[None]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            stop.set()
            return


async def run_daemon(
    config: Config,
    *,
    extra_components: dict[str, Component] | None = None,
    handle_signals: bool = True,
    stop: trio.Event | None = None,
    environ: Mapping[str, str] | None = None,
    task_status: trio.TaskStatus[SharedState] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run vacancyd until `stop` is set (or SIGTERM/SIGINT), then shut down gracefully.

    Shutdown is bounded: listeners get `shutdown_grace_s` to finish in-flight responses,
    after which everything left is cancelled. systemd's variables ($NOTIFY_SOCKET,
    $WATCHDOG_USEC) are read from `environ`, the process environment by default.
    """
    stop = stop if stop is not None else trio.Event()
    state_dir = resolve_state_dir(config)
    try:
        ensure_private_dir(state_dir)
    except OSError as exc:
        raise StartupError(f"server.state_dir {state_dir}: {exc.strerror or exc}") from exc
    state = SharedState(config)
    # The owner's saved switches, before anything can be lent: a pause survives a restart.
    controls = OwnerControls.for_config(state, state_dir)
    controls.restore()
    ledger = Ledger(state, holds_path=state_dir / "holds.json")
    restored = ledger.restore_holds(set(state.resources))
    if restored:
        log.warning("%d durable hold(s) restored: those resources refuse until released", restored)
    decisions = DecisionLog([u.name for u in config.upstream])
    admission = Admission(state, ledger, decisions)
    auth = Authenticator(config.auth)
    limits = config.server.limits
    grace = config.server.shutdown_grace_s
    ops = Operations(config, environ)
    poll, deadline = config.server.poll_interval_s, config.server.probe_deadline_s

    async with ops.open(), open_upstream_client(limits) as client, trio.open_nursery() as root:
        supervisor = Supervisor(root)
        if handle_signals:
            await root.start(_watch_signals, stop)
        await supervisor.start("debug-window", ops.debug.run)
        # Snooze and lending hours are judged before any listener admits work.
        await supervisor.start("owner-controls", controls.run)

        memory_and_cpu = [r for r in config.resource if r.kind is not ResourceKind.NVIDIA_GPU]
        gpus = [r for r in config.resource if r.kind is ResourceKind.NVIDIA_GPU]
        nvml: NvmlCollector | None = None
        if gpus:
            nvml = NvmlCollector(
                state,
                gpus,
                deadline_s=config.server.probe_deadline_s,
                # init, finding the GPUs and a sample may each take a deadline
                heartbeat=ops.heartbeat(
                    "collector:nvml", every_s=poll, round_within_s=3 * deadline
                ),
            )
            await supervisor.start("collector:nvml", nvml.run)
            pressure = PressureCollector(
                state,
                gpus,
                {u.name: parse_target(u.target) for u in config.upstream},
                nvml,
                lambda: {entry.upstream for entry in ledger.statistics().entries},
                CalibrationStore(state_dir, state.state_files),
                deadline_s=config.server.probe_deadline_s,
            )
            pressure.heartbeat = ops.heartbeat(
                "collector:pressure",
                every_s=pressure.poll_s,
                round_within_s=pressure.round_within_s,
            )
            await supervisor.start("collector:pressure", pressure.run)
        await supervisor.start(
            "collector:system",
            partial(
                run_system_collector,
                state,
                memory_and_cpu,
                deadline_s=config.server.probe_deadline_s,
                heartbeat=ops.heartbeat("collector:system", every_s=poll, round_within_s=deadline),
            ),
        )
        backend = choose_backend(config.owner)
        await supervisor.start(
            "collector:listeners",
            partial(
                run_listener_watch,
                state,
                {u.name: parse_target(u.target) for u in config.upstream},
                deadline_s=config.server.probe_deadline_s,
                heartbeat=ops.heartbeat(
                    "collector:listeners", every_s=SCAN_EVERY_S, round_within_s=deadline
                ),
            ),
        )
        await supervisor.start(
            "presence",
            partial(
                run_presence,
                state,
                backend,
                deadline_s=config.server.probe_deadline_s,
                heartbeat=ops.heartbeat("presence", every_s=poll, round_within_s=deadline),
            ),
        )
        for name, component in (extra_components or {}).items():
            await supervisor.start(name, component)

        background: trio.Nursery = await supervisor.start("job-trackers", _background_nursery)
        reclaims: dict[str, UpstreamReclaim] = {}
        can_unload: dict[str, bool] = {}
        guards: dict[str, ListenerGuard] = {}
        # Learned and estimated footprints, shared by every proxy (read once, here).
        footprints = FootprintBook(state_dir, state.state_files)
        for index, upstream in enumerate(config.upstream):
            adapter = adapter_for(upstream.adapter.value)
            can_unload[upstream.name] = adapter.actions is not None and upstream.yield_on_veto
            credential = (
                read_token_file(
                    upstream.credential_file,
                    f"upstream[{index}].credential_file",
                    "credential file",
                )
                if upstream.credential_file
                else None
            )
            app = ProxyApp(
                upstream,
                adapter,
                admission,
                auth,
                limits,
                client,
                credential,
                state_dir,
                footprints,
                reachability=state.reachability,
            )
            app.background = background
            reclaims[upstream.name] = UpstreamReclaim(
                upstream, adapter, state, ledger, client, credential
            )
            await supervisor.start(f"reclaim:{upstream.name}", reclaims[upstream.name].run)
            tunnels = WebSocketTunnels(
                upstream,
                adapter,
                app.target,
                admission,
                auth,
                limits,
                credential,
                reachability=state.reachability,
            )
            guards[upstream.name] = ListenerGuard(
                limits, takeover=tunnels.take_over, wants_takeover=is_websocket_request
            )
            state.listeners[upstream.name] = await supervisor.start(
                f"proxy:{upstream.name}",
                partial(
                    serve_app,
                    app,
                    parse_listen(upstream.listen),
                    limits,
                    grace_s=grace,
                    shutdown_trigger=stop.wait,
                    guard=guards[upstream.name],
                ),
            )
        guards["api"] = ListenerGuard(limits)
        api = create_api_app(
            state,
            ledger,
            decisions,
            auth,
            can_unload,
            guards,
            reclaims,
            admission=admission,
            operator=ops.tools(nvml),
            footprints=footprints,
            controls=controls,
        )
        state.listeners["api"] = await supervisor.start(
            "api",
            partial(
                serve_app,
                api,
                parse_listen(config.server.api_listen),
                limits,
                grace_s=grace,
                shutdown_trigger=stop.wait,
                date_header=True,
                guard=guards["api"],
            ),
        )
        state.all_listeners_bound = True
        listener_names = ["api", *(f"proxy:{u.name}" for u in config.upstream)]
        log.info(
            "vacancyd ready: api on %s; %s",
            ", ".join(state.listeners["api"]),
            "; ".join(
                f"{u.name} on {', '.join(state.listeners[u.name])} -> {u.target}"
                for u in config.upstream
            ),
        )
        await supervisor.start(
            "service-notifications",
            partial(
                ops.serve_notifications,
                supervisor.running,
                partial(status_document, state, ledger, decisions, can_unload, guards, reclaims),
                stop,
            ),
        )
        task_status.started(state)

        await stop.wait()
        supervisor.stopping = True
        # Listeners drain on their own (hypercorn's graceful timeout); give them a bounded
        # moment, then cancel whatever is left, collectors included.
        with trio.move_on_after(grace + 1.0):
            await supervisor.wait_ended(set(listener_names))
        root.cancel_scope.cancel()
    log.info("vacancyd stopped")

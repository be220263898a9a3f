"""The daemon's supervision tree: start-up order, supervision and shutdown.

The root nursery holds one branch per kind of work, each a nursery of its own opened
with `nursery.start`:

    root
    |-- operations   debug-window, holds-saver, service-notifications (systemd READY /
    |                WATCHDOG)
    |-- collectors   owner-controls, collector:nvml, collector:pressure, collector:system,
    |                collector:listeners, power (Linux), presence: everything that writes
    |                SharedState
    |-- yield        sleep (Linux: gives borrowed work back before a suspend),
    |                reclaim:<upstream>, one per upstream
    |-- proxies      job-trackers, health:<upstream> (reads a server that stopped
    |                answering), proxy:<upstream>, one listener per upstream
    '-- api          api, the API's listener

Every component is essential and is started into its branch with `nursery.start`, so the
daemon only reports ready once each one says it is. If any of them returns or raises
while the daemon is running, that is logged with the component's name and the daemon
exits non-zero: the failure leaves its branch, which leaves the root, which cancels
everything else. A half-dead vacancyd answering liveness checks would be worse than none.

Shutdown runs the tree from the front: the listeners stop accepting and drain, then the
branches are closed in the reverse of the order they were opened, so reclaim and the
collectors (which the listeners' requests read) are still there while the last responses
finish.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import attrs
import trio

from vacancyd.adapters.base import Adapter
from vacancyd.adapters.registry import adapter_for
from vacancyd.admission import Admission, Ledger, Prove
from vacancyd.admission.handoff import ServerTerms
from vacancyd.api.app import create_api_app
from vacancyd.api.status import status_document
from vacancyd.auth import Authenticator, read_token_file
from vacancyd.collect.attribution import server_pids
from vacancyd.collect.calibration_store import CalibrationStore
from vacancyd.collect.listeners import SCAN_EVERY_S, ListenerWatch
from vacancyd.collect.nvml import NvmlCollector
from vacancyd.collect.pressure import PressureCollector
from vacancyd.collect.system import run_system_collector
from vacancyd.config import (
    Config,
    PresenceBackend,
    UpstreamConfig,
    parse_listen,
    resolve_state_dir,
)
from vacancyd.controls import OwnerControls, agent_socket_path, answer_owner
from vacancyd.decisions import DecisionLog
from vacancyd.errors import StartupError
from vacancyd.footprint.book import FootprintBook
from vacancyd.handoff import HandOver
from vacancyd.model import ResourceKind
from vacancyd.operations import Operations
from vacancyd.persist import StateFileProblems, ensure_private_dir, runtime_directory
from vacancyd.presence.agents import AgentHub
from vacancyd.presence.backends import choose_backend
from vacancyd.presence.loop import run_presence
from vacancyd.presence.power import PowerWatch
from vacancyd.presence.sleep import SleepWatch
from vacancyd.proxy.app import ProxyApp
from vacancyd.proxy.forward import open_upstream_client
from vacancyd.proxy.health import HealthWatch
from vacancyd.proxy.tunnel import WebSocketTunnels, is_websocket_request
from vacancyd.published import NOT_WATCHED, BoundListeners, PresenceSource, Published
from vacancyd.reachability import Reachability
from vacancyd.reclaim import UpstreamReclaim
from vacancyd.serving import ListenerGuard, serve_app
from vacancyd.spills import SpillWatch
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

Component = Callable[..., Awaitable[Any]]


@attrs.frozen
class RunningDaemon:
    """What run_daemon reports once ready: the readings and what its parts publish."""

    state: SharedState
    published: Published


# The branches of the supervision tree, in the order they are opened. Shutdown closes them
# in reverse: the listeners' branches first, the collectors (which every request and every
# reclaim reads) and the operator's side last.
BRANCHES = ("operations", "collectors", "yield", "proxies", "api")


class EssentialTaskFailed(Exception):
    """An essential component returned or raised while the daemon was running."""

    def __init__(self, name: str, why: str, *, branch: str = "") -> None:
        super().__init__(f"essential task {name!r} {why}")
        self.name = name
        self.branch = branch


class Supervisor:
    """The root of the supervision tree: named branches of essential components.

    Any component ending early takes the daemon down. `running` is the set of component
    names alive right now, across every branch: the systemd watchdog's health check
    reads it.
    """

    def __init__(self, root: trio.Nursery) -> None:
        self._root = root
        self.stopping = False
        self.running: set[str] = set()
        self._ended = trio.Event()
        self._branches: list[Branch] = []

    async def open_branch(self, name: str) -> Branch:
        """Open a named branch: a nursery of its own under the root."""
        branch: Branch = await self._root.start(self._hold_branch, name)
        self._branches.append(branch)
        return branch

    async def _hold_branch(self, name: str, *, task_status: trio.TaskStatus[Branch]) -> None:
        branch = Branch(self, name)
        try:
            async with trio.open_nursery() as nursery:
                branch.nursery = nursery
                task_status.started(branch)
                await trio.sleep_forever()
        finally:
            branch.closed.set()

    async def run_component(
        self,
        branch: str,
        name: str,
        component: Component,
        *,
        task_status: trio.TaskStatus[Any],
    ) -> None:
        """Run one component in its branch; its end, unless the daemon is stopping, is fatal."""
        self.running.add(name)
        try:
            await component(task_status=task_status)
        except BaseException as exc:
            if _only_cancellation(exc):
                raise
            why = describe_failure(exc)
            log.critical("essential task %s failed: %s", name, why)
            raise EssentialTaskFailed(name, f"failed: {why}", branch=branch) from exc
        finally:
            self.running.discard(name)
            self._ended.set()
            self._ended = trio.Event()
        if not self.stopping:
            log.critical("essential task %s exited unexpectedly", name)
            raise EssentialTaskFailed(name, "exited unexpectedly", branch=branch)

    async def wait_ended(self, names: set[str]) -> None:
        """Return once none of `names` is still running."""
        while self.running & names:
            await self._ended.wait()

    async def shut_down(self, listeners: set[str], *, drain_s: float) -> None:
        """Take the tree down from the front, once `stop` has told the listeners to stop.

        The listeners stopped accepting when `stop` was set (it is their shutdown trigger)
        and finish the responses in flight on their own; they get `drain_s` for that.
        Then every branch is cancelled, in the reverse of the order it was opened, each
        one gone before the next is touched: whatever is left of the listeners and the job
        trackers, then reclaim, then the collectors, then the operator's side.
        """
        self.stopping = True
        with trio.move_on_after(drain_s):
            await self.wait_ended(listeners)
        for branch in reversed(self._branches):
            await branch.close()


class Branch:
    """One named nursery of the supervision tree (see the module docstring)."""

    nursery: trio.Nursery

    def __init__(self, supervisor: Supervisor, name: str) -> None:
        self._supervisor = supervisor
        self.name = name
        self.closed = trio.Event()

    async def start(self, name: str, component: Component) -> Any:
        """Start an essential component here; returns what it reported when it started."""
        return await self.nursery.start(self._supervisor.run_component, self.name, name, component)

    async def close(self) -> None:
        """Cancel what is left in this branch and wait until it has all ended."""
        self.nursery.cancel_scope.cancel()
        await self.closed.wait()


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
    task_status: trio.TaskStatus[RunningDaemon] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run vacancyd until `stop` is set (or SIGTERM/SIGINT), then shut down gracefully.

    Shutdown is bounded: listeners get `shutdown_grace_s` to finish in-flight responses,
    after which everything left is cancelled, branch by branch. systemd's variables
    ($NOTIFY_SOCKET, $WATCHDOG_USEC) are read from `environ`, the process environment by
    default.

    `extra_components` are started after presence, in the collectors branch, or in the
    branch a name such as "yield/reclaim:probe" gives before its slash: tests put
    components that fail, or that watch the shutdown, into any branch of the real tree.
    """
    stop = stop if stop is not None else trio.Event()
    state_dir = resolve_state_dir(config)
    try:
        ensure_private_dir(state_dir)
    except OSError as exc:
        raise StartupError(f"server.state_dir {state_dir}: {exc.strerror or exc}") from exc
    state = SharedState(config)
    # Untrusted state files, reported by each part that reads one, shown in /status.
    state_files = StateFileProblems()
    # The owner's saved switches, before anything can be lent: a pause survives a restart.
    controls = OwnerControls.for_config(state, state_dir, state_files=state_files)
    controls.restore()
    runtime_dir = runtime_directory(os.environ if environ is None else environ)
    ledger = Ledger(
        state,
        holds_path=state_dir / "holds.json",
        state_files=state_files,
        runtime_dir=runtime_dir,
    )
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
    # Where each upstream's server listens: the pressure and listener collectors look there.
    targets = {u.name: u.endpoint for u in config.upstream}

    async with ops.open(), open_upstream_client(limits) as client, trio.open_nursery() as root:
        supervisor = Supervisor(root)
        if handle_signals:
            await root.start(_watch_signals, stop)
        # The branches open before any component starts, so components start one at a
        # time in the order below, whichever branch each one lives in.
        tree = {name: await supervisor.open_branch(name) for name in BRANCHES}
        operations, collectors, yielding = tree["operations"], tree["collectors"], tree["yield"]
        proxies, api_branch = tree["proxies"], tree["api"]
        await operations.start("debug-window", ops.debug.run)
        # A hold that could not be saved is saved again until it is (admission/holds.py).
        await operations.start("holds-saver", ledger.keep_holds_saved)
        # Snooze and lending hours are judged before any listener admits work.
        await collectors.start("owner-controls", controls.run)

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
            await collectors.start("collector:nvml", nvml.run)
            pressure = PressureCollector(
                state,
                gpus,
                targets,
                nvml,
                lambda: {entry.upstream for entry in ledger.statistics().entries},
                CalibrationStore(state_dir, state_files),
                deadline_s=config.server.probe_deadline_s,
            )
            pressure.heartbeat = ops.heartbeat(
                "collector:pressure",
                every_s=pressure.poll_s,
                round_within_s=pressure.round_within_s,
            )
            await collectors.start("collector:pressure", pressure.run)
        await collectors.start(
            "collector:system",
            partial(
                run_system_collector,
                state,
                memory_and_cpu,
                deadline_s=config.server.probe_deadline_s,
                heartbeat=ops.heartbeat("collector:system", every_s=poll, round_within_s=deadline),
            ),
        )
        # The owner's session agents report here (Linux, with logind); their uid must own
        # an active graphical session, which the logind backend read last.
        agents: AgentHub | None = None
        agent_socket = agent_socket_path(config.owner.agent_socket, runtime_dir)
        if agent_socket is not None and config.owner.presence is not PresenceBackend.HEADLESS:
            agents = AgentHub(
                agent_socket,
                lambda: getattr(backend, "owner_uids", frozenset()),
                partial(answer_owner, controls),
            )
        backend = choose_backend(config.owner, agents=agents)
        if agents is not None and hasattr(backend, "owner_uids"):
            await collectors.start("agents", agents.run)
        listener_watch = ListenerWatch(
            targets,
            deadline_s=config.server.probe_deadline_s,
            heartbeat=ops.heartbeat(
                "collector:listeners", every_s=SCAN_EVERY_S, round_within_s=deadline
            ),
        )
        await collectors.start("collector:listeners", listener_watch.run)
        bound = BoundListeners()
        # Filled in once the sleep watch exists (it needs the reclaims, made further down).
        sleep_view: list[Callable[[], Mapping[str, object]]] = []
        published = Published(
            sleep=lambda: sleep_view[0]() if sleep_view else NOT_WATCHED,
            listeners=bound,
            reachability=Reachability(),
            state_files=state_files,
            presence=PresenceSource(backend.name, backend.scope_note),
            agents=agents.view if agents is not None and hasattr(backend, "owner_uids") else None,
            collector_notes=nvml.broker.notes if nvml is not None else dict,
            unseen_gpu_work=(lambda: pressure.unseen_gpu_work) if gpus else frozenset,
            listener_states=listener_watch.states,
        )
        if sys.platform.startswith("linux"):
            # Signal-driven; a machine without UPower is simply not read (lends as before).
            await collectors.start("power", PowerWatch(state).run)
        await collectors.start(
            "presence",
            partial(
                run_presence,
                state,
                backend,
                deadline_s=config.server.probe_deadline_s,
                heartbeat=ops.heartbeat("presence", every_s=poll, round_within_s=deadline),
            ),
        )
        for key, component in (extra_components or {}).items():
            branch, _, name = key.rpartition("/")
            await tree[branch or "collectors"].start(name, component)

        background: trio.Nursery = await proxies.start("job-trackers", _background_nursery)
        reclaims: dict[str, UpstreamReclaim] = {}
        if sys.platform.startswith("linux"):
            # Gives borrowed work back before a suspend; reclaims are read when one comes.
            sleep_watch = SleepWatch(
                state,
                ledger.has_running_work,
                lambda seq: all(r.settled_seq >= seq for r in reclaims.values()),
            )
            sleep_view.append(sleep_watch.view)
            await yielding.start("sleep", sleep_watch.run)
        can_unload: dict[str, bool] = {}
        guards: dict[str, ListenerGuard] = {}
        # How the vacancy probe proves residency, per upstream (the proxies' own watches).
        provers: dict[str, Callable[[str | None], Prove | None]] = {}
        # Learned and estimated footprints, shared by every proxy (read once, here).
        footprints = FootprintBook(
            state_dir, state_files, resources=config.resource, find_server=server_pids
        )
        # What each upstream's server can do in a hand-off between upstreams on one GPU.
        handoff_servers: dict[str, tuple[UpstreamConfig, Adapter, str | None]] = {}
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
            footprints.use_credential(upstream.name, credential)
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
                reachability=published.reachability,
            )
            app.background = background
            provers[upstream.name] = app.probe_prover
            handoff_servers[upstream.name] = (upstream, adapter, credential)
            admission.handoffs.terms[upstream.name] = ServerTerms(
                can_release=adapter.give_way.can_release,
                cannot_release=adapter.give_way.cannot_release,
                priority=adapter.give_way.priority,
                working=adapter.give_way.working,
            )
            # Reads the server only while it counts as not answering (missed a deadline).
            health = HealthWatch(
                upstream.name, adapter, state, app.context(), published.reachability
            )
            await proxies.start(f"health:{upstream.name}", health.run)
            reclaims[upstream.name] = UpstreamReclaim(
                upstream, adapter, state, ledger, client, credential
            )
            await yielding.start(f"reclaim:{upstream.name}", reclaims[upstream.name].run)
            if adapter.give_way.read_spills is not None:
                # Sees models squeezed onto the CPU; unloads borrowed ones once they fit.
                spills = SpillWatch(upstream, adapter, state, ledger, client, credential)
                await yielding.start(f"spills:{upstream.name}", spills.run)
            tunnels = WebSocketTunnels(
                upstream,
                adapter,
                app.target,
                admission,
                auth,
                limits,
                credential,
                reachability=published.reachability,
                connector=app.connector,
            )
            guards[upstream.name] = ListenerGuard(
                limits, takeover=tunnels.take_over, wants_takeover=is_websocket_request
            )
            bound.record(
                upstream.name,
                await proxies.start(
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
                ),
            )
        admission.handoffs.carry_out = HandOver(state, ledger, client, handoff_servers)
        guards["api"] = ListenerGuard(limits)
        api = create_api_app(
            state,
            published,
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
            provers=provers,
        )
        bound.record(
            "api",
            await api_branch.start(
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
            ),
        )
        bound.mark_complete()
        listener_names = ["api", *(f"proxy:{u.name}" for u in config.upstream)]
        addresses = bound.view()
        log.info(
            "vacancyd ready: api on %s; %s",
            ", ".join(addresses.addresses("api")),
            "; ".join(
                f"{u.name} on {', '.join(addresses.addresses(u.name))} -> {u.target}"
                for u in config.upstream
            ),
        )
        await operations.start(
            "service-notifications",
            partial(
                ops.serve_notifications,
                supervisor.running,
                partial(
                    status_document,
                    state,
                    published,
                    ledger,
                    decisions,
                    can_unload,
                    guards,
                    reclaims,
                ),
                stop,
            ),
        )
        task_status.started(RunningDaemon(state, published))

        await stop.wait()
        # Listeners drain on their own (hypercorn's graceful timeout); give them a bounded
        # moment, then cancel the tree from the listeners back to the collectors.
        await supervisor.shut_down(set(listener_names), drain_s=grace + 1.0)
        root.cancel_scope.cancel()  # the signal watcher
    log.info("vacancyd stopped")

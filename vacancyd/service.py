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

`run_daemon` reads as that tree: one builder per branch (`_start_operations`,
`_start_collectors`, `_start_lending`, `_start_api`), each starting its components in
order. The shared core and each upstream's parts are built by assembly.py; supervising
a component is supervision.py.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable, Mapping
from functools import partial

import attrs
import httpx
import trio

from vacancyd.admission import Prove
from vacancyd.admission.handoff import ServerTerms
from vacancyd.api.app import create_api_app
from vacancyd.api.parts import DaemonParts
from vacancyd.api.status import status_document
from vacancyd.assembly import Core, UpstreamParts, build_core, build_upstream, read_credential
from vacancyd.collect.attribution import server_pids
from vacancyd.collect.calibration_store import CalibrationStore
from vacancyd.collect.listeners import SCAN_EVERY_S, ListenerWatch
from vacancyd.collect.nvml import NvmlBroker, NvmlCollector
from vacancyd.collect.pressure import PressureCollector
from vacancyd.collect.system import run_system_collector
from vacancyd.config import (
    Config,
    PresenceBackend,
    parse_listen,
)
from vacancyd.controls import agent_socket_path, answer_owner
from vacancyd.footprint.book import FootprintBook
from vacancyd.handoff import HandOver
from vacancyd.model import ResourceKind
from vacancyd.operations import Operations
from vacancyd.presence.agents import AgentHub
from vacancyd.presence.backends import choose_backend
from vacancyd.presence.loop import run_presence
from vacancyd.presence.power import PowerWatch
from vacancyd.presence.sleep import SleepWatch
from vacancyd.proxy.forward import open_upstream_client
from vacancyd.published import NOT_WATCHED, BoundListeners, PresenceSource, Published
from vacancyd.reachability import Reachability
from vacancyd.serving import ListenerGuard, serve_app
from vacancyd.state import SharedState
from vacancyd.supervision import BRANCHES, Branch, Component, Supervisor

log = logging.getLogger(__name__)


@attrs.frozen
class RunningDaemon:
    """What run_daemon reports once ready: the readings and what its parts publish."""

    state: SharedState
    published: Published


async def _background_nursery(*, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    """A nursery for short-lived tasks that outlive the request that started them."""
    async with trio.open_nursery() as nursery:
        task_status.started(nursery)
        await trio.sleep_forever()


async def _watch_signals(stop: trio.Event, *, task_status: trio.TaskStatus[None]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            stop.set()
            return


@attrs.frozen
class Seen:
    """What the collectors branch made that later branches read."""

    published: Published
    bound: BoundListeners
    nvml: NvmlCollector | None
    # Filled in once the sleep watch exists (the lending branch makes it).
    sleep_view: list[Callable[[], Mapping[str, object]]]


@attrs.frozen
class Lent:
    """What the lending branches made: every upstream's parts and the shared footprints."""

    upstreams: dict[str, UpstreamParts]
    footprints: FootprintBook
    provers: dict[str, Callable[[str | None], Prove | None]]


async def _start_operations(branch: Branch, core: Core, ops: Operations) -> None:
    await branch.start("debug-window", ops.debug.run)
    # A hold that could not be saved is saved again until it is (admission/holds.py).
    await branch.start("holds-saver", core.ledger.keep_holds_saved)


async def _start_collectors(branch: Branch, core: Core, ops: Operations) -> Seen:
    """Everything that writes SharedState: the owner's switches first (snooze and lending
    hours are judged before any listener admits work), then the GPUs, the host, the
    servers' listeners, power and presence."""
    config, state = core.config, core.state
    poll, deadline = config.server.poll_interval_s, config.server.probe_deadline_s
    # Where each upstream's server listens: the pressure and listener collectors look there.
    targets = {u.name: u.endpoint for u in config.upstream}
    await branch.start("owner-controls", core.controls.run)
    memory_and_cpu = [r for r in config.resource if r.kind is not ResourceKind.NVIDIA_GPU]
    gpus = [r for r in config.resource if r.kind is ResourceKind.NVIDIA_GPU]
    nvml: NvmlCollector | None = None
    pressure: PressureCollector | None = None
    if gpus:
        # One GPU access, shared by the capacity loop and the pressure loop.
        broker = NvmlBroker(state, gpus, deadline_s=deadline)
        nvml = NvmlCollector(
            state,
            gpus,
            deadline_s=deadline,
            broker=broker,
            # init, finding the GPUs and a sample may each take a deadline
            heartbeat=ops.heartbeat("collector:nvml", every_s=poll, round_within_s=3 * deadline),
        )
        await branch.start("collector:nvml", nvml.run)
        pressure = PressureCollector(
            state,
            gpus,
            targets,
            broker,
            lambda: {entry.upstream for entry in core.ledger.statistics().entries},
            CalibrationStore(core.files(), core.state_files),
            deadline_s=deadline,
        )
        pressure.heartbeat = ops.heartbeat(
            "collector:pressure", every_s=pressure.poll_s, round_within_s=pressure.round_within_s
        )
        await branch.start("collector:pressure", pressure.run)
    await branch.start(
        "collector:system",
        partial(
            run_system_collector,
            state,
            memory_and_cpu,
            deadline_s=deadline,
            heartbeat=ops.heartbeat("collector:system", every_s=poll, round_within_s=deadline),
        ),
    )
    # The owner's session agents report here (Linux, with logind); their uid must own
    # an active graphical session, which the logind backend read last.
    agents: AgentHub | None = None
    agent_socket = agent_socket_path(config.owner.agent_socket, core.runtime_dir)
    if agent_socket is not None and config.owner.presence is not PresenceBackend.HEADLESS:
        agents = AgentHub(
            agent_socket,
            lambda: getattr(backend, "owner_uids", frozenset()),
            partial(answer_owner, core.controls),
        )
    backend = choose_backend(config.owner, agents=agents)
    hears_agents = agents is not None and hasattr(backend, "owner_uids")
    if agents is not None and hears_agents:
        await branch.start("agents", agents.run)
    listener_watch = ListenerWatch(
        targets,
        deadline_s=deadline,
        heartbeat=ops.heartbeat(
            "collector:listeners", every_s=SCAN_EVERY_S, round_within_s=deadline
        ),
    )
    await branch.start("collector:listeners", listener_watch.run)
    bound = BoundListeners()
    sleep_view: list[Callable[[], Mapping[str, object]]] = []
    published = Published(
        sleep=lambda: sleep_view[0]() if sleep_view else NOT_WATCHED,
        listeners=bound,
        reachability=Reachability(),
        state_files=core.state_files,
        presence=PresenceSource(backend.name, backend.scope_note),
        agents=agents.view if agents is not None and hears_agents else None,
        collector_notes=nvml.broker.notes if nvml is not None else dict,
        unseen_gpu_work=(lambda: pressure.unseen_gpu_work) if pressure is not None else frozenset,
        listener_states=listener_watch.states,
    )
    if sys.platform.startswith("linux"):
        # Signal-driven; a machine without UPower is simply not read (lends as before).
        await branch.start("power", PowerWatch(state).run)
    await branch.start(
        "presence",
        partial(
            run_presence,
            state,
            backend,
            deadline_s=deadline,
            heartbeat=ops.heartbeat("presence", every_s=poll, round_within_s=deadline),
        ),
    )
    return Seen(published=published, bound=bound, nvml=nvml, sleep_view=sleep_view)


async def _start_lending(
    tree: Mapping[str, Branch],
    core: Core,
    seen: Seen,
    client: httpx.AsyncClient,
    stop: trio.Event,
) -> Lent:
    """The yield and proxies branches: the job trackers, the sleep watch, then per
    upstream its health read, reclaim, spill watch and listener; last, the hand-over of
    GPU memory between upstreams."""
    yielding, proxies = tree["yield"], tree["proxies"]
    state, ledger, admission = core.state, core.ledger, core.admission
    background: trio.Nursery = await proxies.start("job-trackers", _background_nursery)
    upstreams: dict[str, UpstreamParts] = {}
    if sys.platform.startswith("linux"):
        # Gives borrowed work back before a suspend; reclaims are read when one comes.
        sleep_watch = SleepWatch(
            state,
            ledger.has_running_work,
            lambda seq: all(p.reclaim.settled_seq >= seq for p in upstreams.values()),
        )
        seen.sleep_view.append(sleep_watch.view)
        await yielding.start("sleep", sleep_watch.run)
    # Learned and estimated footprints, shared by every proxy (read once, here).
    footprints = FootprintBook(
        core.files(), core.state_files, resources=core.config.resource, find_server=server_pids
    )
    provers: dict[str, Callable[[str | None], Prove | None]] = {}
    for index, upstream in enumerate(core.config.upstream):
        credential = read_credential(upstream, index)
        footprints.use_credential(upstream.name, credential)
        parts = build_upstream(
            core,
            upstream,
            client,
            credential=credential,
            footprints=footprints,
            learned_dir=core.state_dir,
            reachability=seen.published.reachability,
            background=background,
        )
        upstreams[upstream.name] = parts
        # How the vacancy probe proves residency (the proxy's own watch).
        provers[upstream.name] = parts.app.probe_prover
        give_way = parts.adapter.give_way
        admission.handoffs.terms[upstream.name] = ServerTerms(
            can_release=give_way.can_release,
            cannot_release=give_way.cannot_release,
            priority=give_way.priority,
            working=give_way.working,
        )
        # Reads the server only while it counts as not answering (missed a deadline).
        await proxies.start(f"health:{upstream.name}", parts.health.run)
        await yielding.start(f"reclaim:{upstream.name}", parts.reclaim.run)
        if parts.spills is not None:
            # Sees models squeezed onto the CPU; unloads borrowed ones once they fit.
            await yielding.start(f"spills:{upstream.name}", parts.spills.run)
        listener = parts.listener(
            grace_s=core.config.server.shutdown_grace_s, shutdown_trigger=stop.wait
        )
        seen.bound.record(upstream.name, await proxies.start(f"proxy:{upstream.name}", listener))
    # What each upstream's server can do in a hand-off between upstreams on one GPU.
    admission.handoffs.carry_out = HandOver(
        state,
        ledger,
        client,
        {name: (p.upstream, p.adapter, p.credential) for name, p in upstreams.items()},
    )
    return Lent(upstreams=upstreams, footprints=footprints, provers=provers)


async def _start_api(
    branch: Branch, core: Core, seen: Seen, lent: Lent, ops: Operations, stop: trio.Event
) -> DaemonParts:
    """The admin API's listener, over one bundle of what it reads and acts on."""
    guards = {name: p.guard for name, p in lent.upstreams.items()}
    guards["api"] = ListenerGuard(core.limits)
    parts = DaemonParts(
        state=core.state,
        published=seen.published,
        ledger=core.ledger,
        decisions=core.decisions,
        auth=core.auth,
        can_unload={name: p.can_unload for name, p in lent.upstreams.items()},
        guards=guards,
        reclaims={name: p.reclaim for name, p in lent.upstreams.items()},
        operator=ops.tools(seen.nvml),
        admission=core.admission,
        footprints=lent.footprints,
        controls=core.controls,
        provers=lent.provers,
    )
    seen.bound.record(
        "api",
        await branch.start(
            "api",
            partial(
                serve_app,
                create_api_app(parts),
                parse_listen(core.config.server.api_listen),
                core.limits,
                grace_s=core.config.server.shutdown_grace_s,
                shutdown_trigger=stop.wait,
                date_header=True,
                guard=guards["api"],
            ),
        ),
    )
    seen.bound.mark_complete()
    return parts


def _log_ready(config: Config, bound: BoundListeners) -> None:
    addresses = bound.view()
    log.info(
        "vacancyd ready: api on %s; %s",
        ", ".join(addresses.addresses("api")),
        "; ".join(
            f"{u.name} on {', '.join(addresses.addresses(u.name))} -> {u.target}"
            for u in config.upstream
        ),
    )


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
    core = build_core(config, environ)
    ops = Operations(config, environ)
    grace = config.server.shutdown_grace_s
    async with (
        ops.open(),
        open_upstream_client(config.server.limits) as client,
        trio.open_nursery() as root,
    ):
        supervisor = Supervisor(root)
        if handle_signals:
            await root.start(_watch_signals, stop)
        # The branches open before any component starts, so components start one at a
        # time in the order below, whichever branch each one lives in.
        tree = {name: await supervisor.open_branch(name) for name in BRANCHES}
        await _start_operations(tree["operations"], core, ops)
        seen = await _start_collectors(tree["collectors"], core, ops)
        for key, component in (extra_components or {}).items():
            branch, _, name = key.rpartition("/")
            await tree[branch or "collectors"].start(name, component)
        lent = await _start_lending(tree, core, seen, client, stop)
        parts = await _start_api(tree["api"], core, seen, lent, ops, stop)
        _log_ready(config, seen.bound)
        # systemd's STATUS line reads the status document without the operator's tools.
        notified = attrs.evolve(parts, operator=None, footprints=None)
        await tree["operations"].start(
            "service-notifications",
            partial(
                ops.serve_notifications,
                supervisor.running,
                partial(status_document, notified),
                stop,
            ),
        )
        task_status.started(RunningDaemon(core.state, seen.published))

        await stop.wait()
        # Listeners drain on their own (hypercorn's graceful timeout); give them a bounded
        # moment, then cancel the tree from the listeners back to the collectors.
        listeners = {"api", *(f"proxy:{u.name}" for u in config.upstream)}
        await supervisor.shut_down(listeners, drain_s=grace + 1.0)
        root.cancel_scope.cancel()  # the signal watcher
    log.info("vacancyd stopped")

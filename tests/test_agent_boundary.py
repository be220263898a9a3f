"""The session agent stands apart from the daemon: it imports the agent protocol and a
few leaves of vacancyd, nothing that holds the daemon's state or speaks for it.

The agent runs in every owner's desktop session; keeping it off the daemon's modules
keeps it small to load, free of the daemon's configuration, and unable to drift into
deciding things the daemon decides. The layers contract in pyproject.toml only forbids
upward imports; this names what the agent may reach at all, transitively.
"""

from __future__ import annotations

import grimp

ALLOWED = {
    "vacancyd.agent_protocol",  # the wire protocol, shared with the daemon
    "vacancyd.json_input",  # the strict JSON reader the protocol parses with
    "vacancyd.probe",  # blocking calls on a worker thread under a deadline (Xlib)
    "vacancyd.once",  # reports a reconnecting watcher started once
    "vacancyd.dbus_watch",  # a bus connection that watches signals
    "vacancyd.durations",
    "vacancyd.errors",
}


def test_the_agent_reaches_only_the_protocol_and_leaves() -> None:
    graph = grimp.build_graph("vacancyd", cache_dir=None)
    reached = graph.find_upstream_modules("vacancyd.agent", as_package=True)
    daemon_modules = {
        module for module in reached if module.startswith("vacancyd.") or module == "vacancyd"
    }
    outside = sorted(
        module
        for module in daemon_modules
        if module not in ALLOWED and not module.startswith("vacancyd.agent.")
    )
    assert outside == []

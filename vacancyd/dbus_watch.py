"""A D-Bus connection that watches signals: the steps every bus watcher takes, in one place.

logind's presence reader, the sleep and power watchers and the session agent each keep
one connection to a bus, ask it for some signals and wake on them. The steps have
traps that cost a dead watcher each when they were learned, so they are written once:

* connecting (socket, auth, Hello) runs under its own deadline, not the connection's
  life (jeepney's `open_dbus_router` would put both under one);
* every signal goes into one memory channel whose receiving end outlives the router:
  jeepney's receiver raises, and dies, if it dispatches to a channel whose receiving
  end is already closed;
* each filter gets its own clone of the sending end and is never closed from here:
  when the router stops, its receiver closes every filter's channel itself, and
  closing one concurrently races with that (it walks its filter table across an await).

A rule comes as a pair: what the bus is asked to match (AddMatch, where a well-known
sender name matches its current owner) and what jeepney's local filter compares (the
sender field literally, a unique name, so a local rule usually leaves the sender out).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio
from jeepney import MatchRule, Message, message_bus
from jeepney.io.trio import DBusRouter, open_dbus_connection
from jeepney.wrappers import unwrap_msg


@asynccontextmanager
async def watching(
    address: str,
    rules: Sequence[tuple[MatchRule, MatchRule]],
    *,
    timeout_s: float,
    buffer: int,
    enable_fds: bool = False,
) -> AsyncIterator[tuple[DBusRouter, trio.MemoryReceiveChannel[Message]]]:
    """A router on the bus at `address`, and the signals `rules` match as they come.

    Connecting and each AddMatch have `timeout_s`; `buffer` signals may wait unread.
    """
    with trio.fail_after(timeout_s):
        connection = await open_dbus_connection(bus=address, enable_fds=enable_fds)
    send, receive = trio.open_memory_channel[Message](buffer)
    with receive:
        async with connection, connection.router() as router:
            for bus_rule, local_rule in rules:
                router.filter(local_rule, channel=send.clone())
                with trio.fail_after(timeout_s):
                    unwrap_msg(await router.send_and_get_reply(message_bus.AddMatch(bus_rule)))
            send.close()
            yield router, receive

"""What the real-client tests share: a daemon in front of a real server, the owner's moves,
and vacancyd's own count of what it was asked.

The clients under test (openai, ollama, LiteLLM) are synchronous or asyncio libraries, so
they run in worker threads while the daemon serves on the test's trio loop. Attempts are
counted on the server side, from /status, never inferred from the client's timing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import trio

from tests.support.configs import daemon_config, upstream
from tests.support.daemon import InProcessDaemon
from vacancyd.model import PresenceReading, SessionState

T = TypeVar("T")

# LiteLLM must never reach the network: every table it would fetch comes from its package.
for _table in (
    "MODEL_COST_MAP",
    "ANTHROPIC_BETA_HEADERS",
    "AUTOROUTER_PRESETS",
    "BLOG_POSTS",
    "POLICY_TEMPLATES",
):
    os.environ.setdefault(f"LITELLM_LOCAL_{_table}", "True")


def lender_config(
    target: str,
    state_dir: Path,
    *,
    adapter: str = "llamacpp",
    name: str = "lender",
    policy: str = "cancel",
    upstream_extra: str = "",
) -> str:
    """One headless daemon, one memory resource, one upstream; the owner's return (a
    recorded ACTIVE reading) holds the veto for ten minutes, far past any test."""
    return daemon_config(
        upstream(name, target, adapter=adapter, on_owner_return=policy),
        state_dir=state_dir,
        owner={"release_after_s": 600.0},
        tail=upstream_extra,
    )


def owner_returns(daemon: InProcessDaemon) -> None:
    """The owner sits down: the veto engages (and reclaim starts) at once."""
    now = trio.current_time()
    daemon.state.record_presence(PresenceReading("test", now, SessionState.ACTIVE))


async def upstream_status(daemon: InProcessDaemon, name: str) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        status = (await http.get(f"{daemon.api}/status")).json()
    entry: dict[str, Any] = status["upstreams"][name]
    return entry


async def attempts(daemon: InProcessDaemon, name: str) -> int:
    """Work requests the upstream's proxy judged: admitted plus refused, any reason."""
    entry = await upstream_status(daemon, name)
    return int(entry["admitted"]) + sum(int(n) for n in entry["refused"].values())


async def in_thread(call: Callable[[], T]) -> T:
    """Run a blocking client call off the trio loop that serves the daemon."""
    return await trio.to_thread.run_sync(call)


async def close_litellm_clients() -> None:
    """Close the SDK clients LiteLLM cached, in the loop (or thread) that used them: left
    open, their sockets would be reported as unclosed during some later test."""
    import inspect

    import litellm

    cache = litellm.in_memory_llm_clients_cache
    for client in list(cache.cache_dict.values()):
        closing = getattr(client, "close", None)
        done = closing() if callable(closing) else None
        if inspect.isawaitable(done):
            await done
    cache.flush_cache()

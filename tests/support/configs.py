"""Configs for tests and benches: one builder of daemon config text, and small configs
built through the real loader so they stay valid configs.

`daemon_config` writes a whole config from keyword arguments; `memory`, `cpu`,
`nvidia_gpu` and `upstream` make its tables, with port 0 for every listener. A nested
mapping or a list of mappings becomes an inline table (or an array of them), which TOML
reads as the same thing as a `[table]` or `[[table]]` of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from vacancyd.config import Config, parse_config

LOOPBACK_ANY_PORT = "127.0.0.1:0"
# Exact figures: no emergency floor under a resource's free memory.
NO_RESERVE: Mapping[str, Any] = {"emergency_reserve_pct": 0.0, "emergency_reserve_min_mib": 0}
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def config_from(text: str) -> Config:
    return parse_config(text, source="<test>")


def toml_value(value: Any) -> str:
    """`value` as a TOML value: mappings as inline tables, sequences as arrays; anything
    else that is not a bool or a number (a Path, say) as a string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Mapping):
        pairs = ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return f"{{ {pairs} }}" if pairs else "{}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


def toml_table(header: str, keys: Mapping[str, Any], raw: str = "") -> str:
    """`[header]` (or `[[header]]`, as given) with its keys (those set to None left out),
    then `raw` TOML text."""
    lines = [header]
    lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in keys.items() if v is not None]
    if raw.strip():
        lines.append(raw.strip("\n"))
    return "\n".join(lines) + "\n"


def memory(name: str = "ram", **keys: Any) -> dict[str, Any]:
    """A [[resource]] of kind memory."""
    return {"name": name, "kind": "memory", **keys}


def cpu(name: str = "cpu", **keys: Any) -> dict[str, Any]:
    """A [[resource]] of kind cpu."""
    return {"name": name, "kind": "cpu", **keys}


def nvidia_gpu(name: str = "gpu0", device: int = 0, **keys: Any) -> dict[str, Any]:
    """A [[resource]] of kind nvidia_gpu, NVML's device `device`."""
    return {"name": name, "kind": "nvidia_gpu", "device": device, **keys}


def upstream(
    name: str,
    target: object,
    *,
    adapter: str = "openai",
    resource: str = "ram",
    listen: str = LOOPBACK_ANY_PORT,
    **keys: Any,
) -> dict[str, Any]:
    """An [[upstream]]: `name` in front of `target`, on port 0 of loopback."""
    return {
        "name": name,
        "adapter": adapter,
        "listen": listen,
        "target": target,
        "resource": resource,
        **keys,
    }


def chat_and_stream(target: object) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two llama.cpp upstreams on one server for the owner's-return tests: "chat" on
    "ram", and "stream" on a resource of its own ("ram2") whose work is cancelled when the
    owner returns, so a reclaim of each can be told apart."""
    return (
        upstream("chat", target, adapter="llamacpp", default_need_mib={"ram": 64}),
        upstream(
            "stream",
            target,
            adapter="llamacpp",
            resource="ram2",
            on_owner_return="cancel",
            default_need_mib={"ram2": 64},
        ),
    )


def daemon_config(
    *upstreams: Mapping[str, Any],
    state_dir: object | None = None,
    api_listen: str | None = LOOPBACK_ANY_PORT,
    poll_interval_s: float | None = 0.5,
    server: Mapping[str, Any] | None = None,
    limits: Mapping[str, Any] | str | None = None,
    auth: Mapping[str, Any] | None = None,
    owner: Mapping[str, Any] | None = None,
    presence: str | None = "headless",
    resources: Sequence[Mapping[str, Any]] = (memory(),),
    head: str = "",
    tail: str = "",
) -> str:
    """A daemon config: [server] (the API on port 0 of loopback, `state_dir`, polled every
    `poll_interval_s`, and the keys of `server`), [server.limits] where `limits` is given
    (a mapping, or TOML text), [auth], [owner] (`presence`, then the keys of `owner`;
    none with neither), the `resources` (one memory resource "ram" unless given) and the
    `upstreams`, in order.

    A key given None is left out. `head` is TOML text written before everything, `tail`
    after everything (it may continue the last upstream's table).
    """
    server_keys = {
        "api_listen": api_listen,
        "state_dir": state_dir,
        "poll_interval_s": poll_interval_s,
        **(server or {}),
    }
    parts = [head.strip("\n") + "\n" if head.strip() else "", toml_table("[server]", server_keys)]
    if isinstance(limits, str):
        parts.append(toml_table("[server.limits]", {}, limits))
    elif limits is not None:
        parts.append(toml_table("[server.limits]", limits))
    if auth is not None:
        parts.append(toml_table("[auth]", auth))
    owner_keys = {"presence": presence, **(owner or {})}
    if any(v is not None for v in owner_keys.values()):
        parts.append(toml_table("[owner]", owner_keys))
    parts += [toml_table("[[resource]]", keys) for keys in resources]
    parts += [toml_table("[[upstream]]", keys) for keys in upstreams]
    if tail.strip():
        parts.append(tail.strip("\n") + "\n")
    return "".join(parts)


BASIC = daemon_config(
    upstream(
        "llama",
        "http://127.0.0.1:9",
        adapter="llamacpp",
        also_requires=["cpu"],
        default_need_mib={"ram": 500},
        models={"big": {"need_mib": {"ram": 8000}}},
    ),
    api_listen=None,
    poll_interval_s=3.0,
    owner={"release_after_s": 60.0},
    resources=[
        # Exact figures in tests: no emergency floor (its own tests set one).
        memory(keep_free_mib=1000, **NO_RESERVE),
        cpu(max_utilization_pct=80.0),
        nvidia_gpu(**NO_RESERVE),
    ],
)


def one_upstream_config(
    target: str,
    state_dir: object,
    *,
    limits: str = "",
    upstream_extra: str = "",
    head: str = "",
    poll_interval_s: float | None = 0.5,
    adapter: str = "openai",
    name: str = "echo",
) -> str:
    """A headless daemon with one memory resource and one upstream named `name` (openai
    unless `adapter` names another).

    Listeners use port 0; `limits` goes under [server.limits], `upstream_extra` into the
    [[upstream]] table, `head` before everything (for top-level tables such as [auth]).
    """
    return daemon_config(
        upstream(name, target, adapter=adapter),
        state_dir=state_dir,
        poll_interval_s=poll_interval_s,
        limits=limits,
        head=head,
        tail=upstream_extra,
    )


# One memory resource polled every 50 ms, headless presence, an upstream nobody calls:
# for tests that watch the collectors' own loops.
FAST_POLL_RAM = daemon_config(
    upstream("llama", "http://127.0.0.1:9", adapter="llamacpp"),
    api_listen=None,
    poll_interval_s=0.05,
)

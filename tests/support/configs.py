"""Small configs for tests, built through the real loader so they stay valid configs."""

from __future__ import annotations

from vacancyd.config import Config, parse_config


def config_from(text: str) -> Config:
    return parse_config(text, source="<test>")


BASIC = """
[server]
poll_interval_s = 3.0
[owner]
presence = "headless"
release_after_s = 60.0
[[resource]]
name = "ram"
kind = "memory"
keep_free_mib = 1000
# Exact figures in tests: no emergency floor (its own tests set one).
emergency_reserve_pct = 0.0
emergency_reserve_min_mib = 0
[[resource]]
name = "cpu"
kind = "cpu"
max_utilization_pct = 80.0
[[resource]]
name = "gpu0"
kind = "nvidia_gpu"
device = 0
emergency_reserve_pct = 0.0
emergency_reserve_min_mib = 0
[[upstream]]
name = "llama"
adapter = "llamacpp"
listen = "127.0.0.1:0"
target = "http://127.0.0.1:9"
resource = "ram"
also_requires = ["cpu"]
default_need_mib = { ram = 500 }
[upstream.models."big"]
need_mib = { ram = 8000 }
"""


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
    poll = f"poll_interval_s = {poll_interval_s}" if poll_interval_s is not None else ""
    return f"""
{head}
[server]
api_listen = "127.0.0.1:0"
state_dir = "{state_dir}"
{poll}
[server.limits]
{limits}
[owner]
presence = "headless"
[[resource]]
name = "ram"
kind = "memory"
[[upstream]]
name = "{name}"
adapter = "{adapter}"
listen = "127.0.0.1:0"
target = "{target}"
resource = "ram"
{upstream_extra}
"""


# One memory resource polled every 50 ms, headless presence, an upstream nobody calls:
# for tests that watch the collectors' own loops.
FAST_POLL_RAM = """
[server]
poll_interval_s = 0.05
[owner]
presence = "headless"
[[resource]]
name = "ram"
kind = "memory"
[[upstream]]
name = "llama"
adapter = "llamacpp"
listen = "127.0.0.1:0"
target = "http://127.0.0.1:9"
resource = "ram"
"""

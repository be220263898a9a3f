"""The real LiteLLM proxy server, started the way its users start it.

A gateway recipe is only worth what the gateway does with it, and the LiteLLM proxy is
not the Router in a test's own process: it reads `config.yaml`, imports callbacks by
name, authenticates end users, and keeps its own retries and cooldowns. So tests and
benches that claim something of "LiteLLM in front of a fleet" run the console script from
the test environment (`litellm --config config.yaml --host 127.0.0.1 --port 0`) as a
subprocess and talk to it over HTTP with the openai SDK, as end users do.

It must reach nothing beyond loopback: every table LiteLLM would fetch at start comes
from its package (LITELLM_LOCAL_*), its telemetry is vetoed, no database is named (so it
runs no schema migration), and proxy variables are dropped so that calls to the lenders
cannot leave the machine. Readiness is the port uvicorn reports as bound, then
`GET /health/readiness` answering 200 (it needs no key); the process runs in its own
session and is stopped by SIGTERM to the group, then SIGKILL.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

REPO = Path(__file__).resolve().parents[2]
MASTER_KEY = "sk-vacancyd-gateway-test"
# uvicorn names the port it bound, which is how `--port 0` becomes a URL.
RUNNING_ON = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
# Tables LiteLLM fetches from GitHub unless told to read its packaged copy.
LOCAL_TABLES = (
    "MODEL_COST_MAP",
    "ANTHROPIC_BETA_HEADERS",
    "AUTOROUTER_PRESETS",
    "BLOG_POSTS",
    "POLICY_TEMPLATES",
)
# Variables that would point the proxy at a database, a remote config or the internet.
DROPPED = (
    "DATABASE_URL",
    "DIRECT_URL",
    "DATABASE_URL_READ_REPLICA",
    "LITELLM_CONFIG_BUCKET_NAME",
    "LITELLM_CONFIG_BUCKET_TYPE",
    "LITELLM_LICENSE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
)


def litellm_bin() -> Path:
    """The console script installed next to this interpreter (the test venv's)."""
    return Path(sys.executable).parent / "litellm"


def proxy_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The proxy's environment: the test's own, offline, with `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env.update({f"LITELLM_LOCAL_{table}": "True" for table in LOCAL_TABLES})
    env.update(
        {
            "LITELLM_TELEMETRY_DISABLED": "True",  # the veto: consent off whatever is stored
            "DISABLE_SCHEMA_UPDATE": "True",  # no prisma migration, even if a DB appeared
            "DISABLE_AIOHTTP_TRUST_ENV": "True",
            "NO_PROXY": "127.0.0.1,localhost",
            "PYTHONUNBUFFERED": "1",
            # The callback is named by its dotted path; import it from this checkout.
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
    )
    env.update(extra or {})
    return env


def deployment(
    group: str,
    api_base: str,
    *,
    model: str = "openai/gemma3-270m",
    probe: str | None = None,
    weight: int | None = None,
    params: Mapping[str, Any] | None = None,
    info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One `model_list` entry: `api_base` is a server's root (`/v1` is added), `probe` its
    vacancyd probe URL when it is a lender."""
    litellm_params: dict[str, Any] = {
        "model": model,
        "api_base": f"{api_base.rstrip('/')}/v1",
        "api_key": "sk-none",
        **(params or {}),
    }
    if weight is not None:
        litellm_params["weight"] = weight
    entry: dict[str, Any] = {"model_name": group, "litellm_params": litellm_params}
    model_info = dict(info or {})
    if probe is not None:
        model_info["vacancy_probe"] = probe
    if model_info:
        entry["model_info"] = model_info
    return entry


def write_config(
    path: Path,
    model_list: Sequence[Mapping[str, Any]],
    *,
    master_key: str = MASTER_KEY,
    callbacks: Sequence[str] = (),
    litellm_settings: Mapping[str, Any] | None = None,
    router_settings: Mapping[str, Any] | None = None,
) -> Path:
    """A config.yaml as an operator writes it."""
    import yaml  # LiteLLM's dependency: present wherever its proxy is

    path.parent.mkdir(parents=True, exist_ok=True)
    settings = dict(litellm_settings or {})
    if callbacks:
        settings["callbacks"] = list(callbacks)
    document: dict[str, Any] = {
        "model_list": [dict(entry) for entry in model_list],
        "general_settings": {"master_key": master_key},
    }
    if settings:
        document["litellm_settings"] = settings
    if router_settings:
        document["router_settings"] = dict(router_settings)
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@attrs.define
class LiteLLMProxy:
    url: str
    master_key: str
    config_path: Path
    process: trio.Process
    # The proxy's last lines of output, for a failure message.
    lines: collections.deque[str] = attrs.Factory(lambda: collections.deque(maxlen=400))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)


async def _pump(stream: trio.abc.ReceiveStream, proxy: LiteLLMProxy, bound: list[str]) -> None:
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            line = raw.decode("utf-8", "replace")
            proxy.lines.append(line)
            match = RUNNING_ON.search(line)
            if match and not bound:
                bound.append(match.group(1))


@asynccontextmanager
async def litellm_proxy(
    directory: Path,
    model_list: Sequence[Mapping[str, Any]],
    *,
    master_key: str = MASTER_KEY,
    callbacks: Sequence[str] = (),
    litellm_settings: Mapping[str, Any] | None = None,
    router_settings: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 120.0,
) -> AsyncIterator[LiteLLMProxy]:
    """Write `directory/config.yaml`, run `litellm --config` on it, yield once it is ready.

    Start-up takes 5-10 s on two cores (it imports its whole server); `ready_timeout_s`
    is generous for a loaded machine.
    """
    config = write_config(
        directory / "config.yaml",
        model_list,
        master_key=master_key,
        callbacks=callbacks,
        litellm_settings=litellm_settings,
        router_settings=router_settings,
    )
    command = [str(litellm_bin()), "--config", str(config), "--host", "127.0.0.1", "--port", "0"]
    process = await trio.lowlevel.open_process(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=proxy_env(env),
        cwd=str(directory),
        start_new_session=True,  # its own group: a worker it forks goes with it
    )
    proxy = LiteLLMProxy("", master_key, config, process)
    bound: list[str] = []
    async with trio.open_nursery() as nursery:
        assert process.stdout is not None
        nursery.start_soon(_pump, process.stdout, proxy, bound)
        try:
            proxy.url = await _until_ready(proxy, bound, ready_timeout_s)
            yield proxy
        finally:
            await _stop(process)


async def _until_ready(proxy: LiteLLMProxy, bound: list[str], timeout_s: float) -> str:
    with trio.move_on_after(timeout_s):
        async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
            while True:
                if proxy.process.returncode is not None:
                    raise RuntimeError(
                        f"litellm exited ({proxy.process.returncode}) before it was ready:\n"
                        + proxy.log[-6000:]
                    )
                if bound:
                    try:
                        answer = await http.get(f"{bound[0]}/health/readiness")
                    except httpx.HTTPError:
                        pass
                    else:
                        if answer.status_code == 200:
                            return bound[0]
                await trio.sleep(0.2)
    raise RuntimeError(f"litellm not ready after {timeout_s:.0f}s:\n" + proxy.log[-6000:])


async def _stop(process: trio.Process) -> None:
    if process.returncode is not None:
        return
    with trio.CancelScope(shield=True):
        _signal_group(process, signal.SIGTERM)
        with trio.move_on_after(15) as late:
            await process.wait()
        if late.cancelled_caught:
            _signal_group(process, signal.SIGKILL)
            await process.wait()


def _signal_group(process: trio.Process, signum: int) -> None:
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signum)

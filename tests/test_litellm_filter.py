"""The LiteLLM callback (vacancyd.integrations.litellm) against real probes over loopback.

The callback runs where LiteLLM runs, on an asyncio loop: here each decision is one
`asyncio.run` in a worker thread, while the probes it reads are served on the test's trio
loop: vacancyd daemons in-process (their real `/vacancy/<upstream>`), or a scripted server
that counts what it is asked and answers what the test says (a hung one, a hostile one).
The Router in front of a real llama-server is in tests/test_clients_litellm.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.support.clients import in_thread, lender_config, upstream_status
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.fake_http import serve_fake
from tests.support.fake_ollama import FakeOllama
from tests.support.upstreams import EchoUpstream

litellm_filter = pytest.importorskip("vacancyd.integrations.litellm")
VacancyFilter = litellm_filter.VacancyFilter

YES = b'{"upstream": "chat", "vacancy": true}'
GUARD_S = 10.0


@attrs.define
class ScriptedProbe:
    """Answers every GET with `status` and `body` (or never, with `hang`); counts them."""

    url: str = ""
    status: int = 200
    body: bytes = YES
    hang: bool = False
    needs_token: str | None = None
    asked: int = 0
    authorizations: list[str | None] = attrs.Factory(list)
    targets: list[str] = attrs.Factory(list)

    async def serve(self, stream: trio.SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                data = await stream.receive_some(65536)
                if not data:
                    return
                head += data
            self.asked += 1
            lines = head.decode("latin-1").split("\r\n")
            self.targets.append(lines[0].split(" ")[1])
            authorization = next(
                (line.split(":", 1)[1].strip() for line in lines if line.lower().startswith(
                    "authorization:"
                )),
                None,
            )  # fmt: skip
            self.authorizations.append(authorization)
            if self.hang:
                await trio.sleep_forever()
            status, body = self.status, self.body
            if self.needs_token is not None and authorization != f"Bearer {self.needs_token}":
                status, body = 401, b'{"error": {"code": "unauthorized"}}'
            await stream.send_all(
                b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, len(body), body)
            )


@asynccontextmanager
async def scripted(**options: Any) -> AsyncIterator[ScriptedProbe]:
    probe = ScriptedProbe(**options)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, probe.serve, 0, host="127.0.0.1"))
        probe.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/vacancy/chat"
        yield probe
        nursery.cancel_scope.cancel()


def deployment(
    name: str, probe: str | None = None, token: str | None = None, model: str = "openai/m"
) -> dict[str, Any]:
    info: dict[str, Any] = {"id": name}
    if probe is not None:
        info["vacancy_probe"] = probe
    if token is not None:
        info["vacancy_token"] = token
    return {"model_name": "chat", "litellm_params": {"model": model}, "model_info": info}


async def decide(
    chooser: Any, deployments: list[dict[str, Any]], concurrent: int = 1
) -> list[list[str]]:
    """What `concurrent` routing decisions made at once keep, as deployment ids."""

    async def all_at_once() -> list[list[dict[str, Any]]]:
        return list(
            await asyncio.gather(
                *(
                    chooser.async_filter_deployments("chat", list(deployments), None)
                    for _ in range(concurrent)
                )
            )
        )

    with trio.fail_after(GUARD_S):
        kept = await in_thread(lambda: asyncio.run(all_at_once()))
    return [[d["model_info"]["id"] for d in decision] for decision in kept]


async def test_a_refusing_lender_is_left_out_and_comes_back_when_it_lends(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    async with (
        in_process_daemon(lender_config(echo.url, tmp_path / "a")) as lending,
        in_process_daemon(lender_config(echo.url, tmp_path / "b")) as paused,
    ):
        paused.state.set_lending(False)
        deployments = [
            deployment("desk-a", f"{lending.api}/vacancy/lender"),
            deployment("desk-b", f"{paused.api}/vacancy/lender"),
            deployment("always-on"),
        ]
        # A probe that takes over probe_timeout_s counts as no vacancy (tested on its own
        # below); here the lender that resumes must be read, and its first probe after the
        # pause reads the server's residency, which on a loaded machine can take longer
        # than the default 0.5 s.
        chooser = VacancyFilter(cache_s=0, probe_timeout_s=GUARD_S / 2)
        assert await decide(chooser, deployments) == [["desk-a", "always-on"]]
        paused.state.set_lending(True)
        lending.state.set_lending(False)
        assert await decide(chooser, deployments) == [["desk-b", "always-on"]]
        assert await decide(chooser, deployments[2:]) == [["always-on"]]
        assert chooser.probes_sent == 4  # a decision with no probe asks nothing


async def test_one_probe_per_cache_period_however_many_decisions_ask() -> None:
    async with scripted() as probe:
        deployments = [deployment("desk", probe.url), deployment("desk-too", probe.url)]
        cached = VacancyFilter(cache_s=600)
        assert await decide(cached, deployments, concurrent=20) == [["desk", "desk-too"]] * 20
        for _ in range(5):
            assert await decide(cached, deployments) == [["desk", "desk-too"]]
        assert probe.asked == cached.probes_sent == 1
        uncached = VacancyFilter(cache_s=0)
        for _ in range(3):
            await decide(uncached, deployments)
        assert probe.asked == 4


ProbeCase = Callable[[ScriptedProbe], Awaitable[None]]


@pytest.mark.parametrize(
    "answer",
    [
        {"status": 503, "body": b'{"vacancy": false}'},
        {"status": 200, "body": b'{"vacancy": "yes"}'},  # another server's 200
        {"status": 200, "body": b"<html>ok</html>"},
        {"status": 200, "body": b'{"vacancy": true, "pad": "' + b"x" * 40_000 + b'"}'},
        {"status": 404, "body": b"{}"},
        {"hang": True},
    ],
    ids=["refusal", "not-ours", "not-json", "oversized", "not-found", "hung"],
)
async def test_anything_but_vacancyds_yes_is_no_vacancy(answer: dict[str, Any]) -> None:
    async with scripted(**answer) as probe:
        chooser = VacancyFilter(cache_s=600, probe_timeout_s=0.3)
        deployments = [deployment("desk", probe.url), deployment("always-on")]
        assert await decide(chooser, deployments, concurrent=3) == [["always-on"]] * 3
        assert probe.asked == 1  # the no is cached like a yes: a hung lender costs one wait


BUSY = b'{"vacancy": false, "error": {"type": "no_vacancy", "code": "resource_busy"}}'
AWAY = b'{"vacancy": false, "error": {"type": "no_vacancy", "code": "owner_active"}}'


@pytest.mark.parametrize(
    ("status", "body", "asked"), [(429, BUSY, 3), (503, BUSY, 3), (503, AWAY, 1)]
)
async def test_a_busy_no_is_kept_only_briefly(status: int, body: bytes, asked: int) -> None:
    """A slot frees within seconds, so a busy lender is asked again after `busy_cache_s`
    (0 here); an owner who is back keeps the no for the whole `cache_s`."""
    async with scripted(status=status, body=body) as probe:
        chooser = VacancyFilter(cache_s=600, busy_cache_s=0)
        for _ in range(3):
            assert await decide(chooser, [deployment("desk", probe.url), deployment("x")]) == [
                ["x"]
            ]
        assert probe.asked == asked


async def test_a_lender_that_is_not_there_is_no_vacancy() -> None:
    async with scripted() as probe:
        gone = probe.url
    chooser = VacancyFilter(cache_s=0, probe_timeout_s=1.0)
    assert await decide(chooser, [deployment("desk", gone), deployment("x")]) == [["x"]]


async def test_the_token_is_sent_read_from_the_environment_as_litellm_spells_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with scripted(needs_token="s3cret") as probe:
        chooser = VacancyFilter(cache_s=0)
        monkeypatch.setenv("DESK_PROBE_TOKEN", "s3cret")
        by_environment = deployment("desk", probe.url, "os.environ/DESK_PROBE_TOKEN")
        assert await decide(chooser, [by_environment]) == [["desk"]]
        assert await decide(chooser, [deployment("desk", probe.url, "s3cret")]) == [["desk"]]
        monkeypatch.delenv("DESK_PROBE_TOKEN")
        assert await decide(chooser, [by_environment]) == [[]]  # no token: 401: no
    assert probe.authorizations == ["Bearer s3cret", "Bearer s3cret", None]


async def test_the_probe_is_asked_about_the_model_the_deployment_sends() -> None:
    async with scripted() as probe:
        chooser = VacancyFilter(cache_s=0)
        named = deployment("named", probe.url, model="ollama/llama3.2:3b")
        named["model_info"]["vacancy_model"] = "llama3.2:latest"
        for one in (
            deployment("openai", probe.url, model="openai/gemma3"),
            deployment("nested", probe.url, model="openai/google/gemma-3-1b"),
            deployment("bare", probe.url + "?x=1", model="gemma3"),
            named,
        ):
            await decide(chooser, [one])
    assert probe.targets == [
        "/vacancy/chat?model=gemma3",
        "/vacancy/chat?model=google%2Fgemma-3-1b",
        "/vacancy/chat?x=1&model=gemma3",
        "/vacancy/chat?model=llama3.2%3Alatest",
    ]


@asynccontextmanager
async def ollama_lender(state: Path) -> AsyncIterator[InProcessDaemon]:
    async with serve_fake(FakeOllama()) as server:
        config = lender_config(server.url, state, adapter="ollama")
        async with in_process_daemon(config) as daemon:
            yield daemon


# A probe that reads residency can outlast the callback's default 0.5 s on a loaded
# machine; the timeout's own behaviour keeps its own test.
PROBE_TIMEOUT_S = 5.0


async def test_lenders_that_hold_the_model_are_preferred_while_they_have_vacancy(
    tmp_path: Path,
) -> None:
    """Two lenders with the real probe in front of Ollama; one has served the model, so
    its server holds it and a request there loads nothing."""
    async with (
        ollama_lender(tmp_path / "a") as holding,
        ollama_lender(tmp_path / "b") as empty,
        httpx.AsyncClient(trust_env=False, timeout=20) as http,
    ):
        served = await http.post(
            f"{holding.proxy('lender')}/v1/chat/completions",
            json={"model": "llama3.2:latest", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert served.status_code == 200, served.text
        model = "ollama/llama3.2:latest"
        deployments = [
            deployment("holding", f"{holding.api}/vacancy/lender", model=model),
            deployment("empty", f"{empty.api}/vacancy/lender", model=model),
            deployment("always-on", model=model),
        ]
        assert await decide(
            VacancyFilter(cache_s=0, probe_timeout_s=PROBE_TIMEOUT_S), deployments
        ) == [["holding", "always-on"]]
        indifferent = VacancyFilter(
            cache_s=0, probe_timeout_s=PROBE_TIMEOUT_S, prefer_resident=False
        )
        assert await decide(indifferent, deployments) == [["holding", "empty", "always-on"]]
        other = [deployment(d["model_info"]["id"], d["model_info"].get("vacancy_probe"),
                            model="ollama/qwen2.5:0.5b") for d in deployments]  # fmt: skip
        assert await decide(VacancyFilter(cache_s=0, probe_timeout_s=PROBE_TIMEOUT_S), other) == [
            ["holding", "empty", "always-on"]
        ]
        holding.state.set_lending(False)
        assert await decide(
            VacancyFilter(cache_s=0, probe_timeout_s=PROBE_TIMEOUT_S), deployments
        ) == [["empty", "always-on"]]


@pytest.mark.slow
# LiteLLM's own code, as the installed pydantic reads it (see tests/test_clients_litellm.py).
@pytest.mark.filterwarnings("ignore:Items? .*ReadOnly. qualifier:UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_a_lender_that_refuses_is_asked_again_before_the_retry_picks(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    """The lender's last slot is taken after the probe said yes: the Router's request is
    refused there (resource_busy), the failure drops that yes, and LiteLLM's retry asks
    the probe again and goes to the always-on server instead of the busy lender."""
    import litellm

    config = lender_config(echo.url, tmp_path / "state", adapter="openai")
    chooser = VacancyFilter(cache_s=600)
    async with (
        in_process_daemon(config) as lender,
        serve_fake(FakeOllama()) as always_on,
        httpx.AsyncClient(trust_env=False, timeout=20) as http,
    ):
        deployments = [
            {
                "model_name": "chat",
                "litellm_params": {
                    "model": "openai/llama3.2:latest",
                    "api_base": f"{lender.proxy('lender')}/v1",
                    "api_key": "x",
                },
                "model_info": {"id": "lender", "vacancy_probe": f"{lender.api}/vacancy/lender"},
            },
        ]
        assert await decide(chooser, deployments) == [["lender"]]  # cached: a yes
        async with http.stream(
            "POST",
            f"{lender.proxy('lender')}/v1/completions",
            json={"echo_stream": {"events": 2}},
        ) as running:
            assert running.status_code == 200
            router = litellm.Router(
                model_list=[
                    *deployments,
                    {
                        "model_name": "chat",
                        "litellm_params": {
                            "model": "openai/llama3.2:latest",
                            "api_base": f"{always_on.url}/v1",
                            "api_key": "x",
                        },
                        "model_info": {"id": "always-on"},
                    },
                ],
                num_retries=3,
            )
            router.optional_callbacks = None
            litellm.callbacks = [chooser]

            async def ask_until_the_lender_is_tried() -> list[str]:
                served = []
                for _ in range(20):
                    answer = await router.acompletion(
                        model="chat", messages=[{"role": "user", "content": "hi"}]
                    )
                    served.append(answer._hidden_params["model_id"])
                    if chooser.probes_sent > 1:
                        break
                return served

            try:
                with trio.fail_after(60):
                    served = await in_thread(lambda: asyncio.run(ask_until_the_lender_is_tried()))
            finally:
                litellm.callbacks = []
            echo.gate.set()
        status = await upstream_status(lender, "lender")
    # Every request was served by the always-on server, including the one the busy lender
    # refused; the refusal made the callback ask the probe again (which said busy).
    assert set(served) == {"always-on"}, served
    assert status["refused"] == {"resource_busy": 1}, status
    assert chooser.probes_sent == 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="cache_s"):
        VacancyFilter(cache_s=-1)
    with pytest.raises(ValueError, match="probe_timeout_s"):
        VacancyFilter(probe_timeout_s=0)
    with pytest.raises(ValueError, match="busy_cache_s"):
        VacancyFilter(busy_cache_s=-1)

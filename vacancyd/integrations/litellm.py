"""Lenders with no vacancy left out of LiteLLM's routing, before it picks one.

A gateway that learns of a refusal only from a 503 sends every refusing lender a request
now and then to find out, benches it for a cooldown, and comes back only when the
cooldown ends, however soon lending resumed. This callback asks each lender first: every
deployment whose `model_info` names a vacancyd probe (`GET /vacancy/<upstream>` on the
lender's API) is kept in the routing decision only while that probe says there is
vacancy. A refusing lender then gets no borrowed request at all, only probes, at most one
per `cache_s` per gateway; a lender that resumes is back in the choice within `cache_s`.

Install it where the gateway runs: `pip install 'vacancyd[litellm]'` (the daemon itself
never imports LiteLLM). Then name a probe on each lent deployment, and register the
callback:

    # LiteLLM proxy, config.yaml
    model_list:
      - model_name: chat
        litellm_params: {model: openai/gemma3, api_base: "http://desk-a:8081/v1"}
        model_info:
          vacancy_probe: "http://desk-a:9460/vacancy/chat"
          vacancy_token: os.environ/DESK_A_PROBE_TOKEN  # only where the probe asks for one
    litellm_settings:
      callbacks: ["vacancyd.integrations.litellm.vacancy_filter"]

    # the Router, in code
    from vacancyd.integrations.litellm import VacancyFilter
    litellm.callbacks.append(VacancyFilter(cache_s=2.0, probe_timeout_s=0.5))

The shared `vacancy_filter` reads its settings from VACANCYD_PROBE_CACHE_S and
VACANCYD_PROBE_TIMEOUT_S (defaults 2 and 0.5 seconds). Deployments without a probe (a
server nobody borrows) pass untouched. A probe that cannot be read, times out, or answers
anything but vacancyd's own yes counts as no vacancy: a gateway must not send borrowed
work to a machine it cannot ask. When every deployment of a group is left out, LiteLLM
raises as for a group with none, and its fallbacks apply.

The probes of one decision go out together, so a decision waits at most
`probe_timeout_s`, once per `cache_s` per lender; requests that arrive while a probe is
out wait for that one rather than send their own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

import attrs
import httpx
from litellm.integrations.custom_logger import CustomLogger

from vacancyd.vacancy_probe import Probe, probe_of

log = logging.getLogger(__name__)

# vacancyd's answer is a few dozen bytes; anything much larger is not vacancyd.
MAX_ANSWER_BYTES = 16 * 1024


@attrs.frozen
class Answer:
    vacancy: bool
    read_at: float  # time.monotonic()
    why: str  # for the log: what said no, or "vacancy"


def says_vacancy(status: int, body: bytes) -> bool:
    """vacancyd's yes: 200 with `"vacancy": true`. Anything else (its 503, a 401 for a
    missing token, another server's 200) is no."""
    if status != 200:
        return False
    try:
        document = json.loads(body)
    except ValueError:
        return False
    return isinstance(document, dict) and document.get("vacancy") is True


class VacancyFilter(CustomLogger):  # type: ignore[misc]  # LiteLLM's class is untyped here
    """LiteLLM calls `async_filter_deployments` on every routing decision; see the module."""

    def __init__(self, *, cache_s: float = 2.0, probe_timeout_s: float = 0.5) -> None:
        if cache_s < 0 or probe_timeout_s <= 0:
            raise ValueError("cache_s must be at least 0 and probe_timeout_s above 0")
        super().__init__()
        self.cache_s = cache_s
        self.probe_timeout_s = probe_timeout_s
        self.probes_sent = 0
        self._answers: dict[Probe, Answer] = {}
        # One probe out per lender and event loop; later askers wait for it.
        self._in_flight: dict[tuple[Probe, int], asyncio.Task[Answer]] = {}

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list[Any],
        messages: Any,
        request_kwargs: dict[str, Any] | None = None,
        parent_otel_span: Any = None,
    ) -> list[Any]:
        probes = [probe_of(deployment) for deployment in healthy_deployments]
        wanted = list(dict.fromkeys(probe for probe in probes if probe is not None))
        if not wanted:
            return healthy_deployments
        answers = dict(zip(wanted, await asyncio.gather(*map(self.answer, wanted)), strict=True))
        return [
            deployment
            for deployment, probe in zip(healthy_deployments, probes, strict=True)
            if probe is None or answers[probe].vacancy
        ]

    async def answer(self, probe: Probe) -> Answer:
        """The probe's answer, read at most `cache_s` ago."""
        cached = self._answers.get(probe)
        if cached is not None and time.monotonic() - cached.read_at < self.cache_s:
            return cached
        key = (probe, id(asyncio.get_running_loop()))
        task = self._in_flight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._ask(probe))
            self._in_flight[key] = task
            task.add_done_callback(lambda _: self._in_flight.pop(key, None))
        # A caller that gives up (its request was cancelled) leaves the probe running for
        # the others waiting on it.
        return await asyncio.shield(task)

    async def _ask(self, probe: Probe) -> Answer:
        self.probes_sent += 1
        headers = {"Authorization": f"Bearer {probe.token}"} if probe.token else {}
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                status, body = await _get(probe.url, headers)
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            answer = Answer(False, time.monotonic(), f"probe unreadable ({type(exc).__name__})")
        else:
            vacancy = says_vacancy(status, body)
            why = "vacancy" if vacancy else f"HTTP {status}"
            answer = Answer(vacancy, time.monotonic(), why)
        previous = self._answers.get(probe)
        if previous is None or previous.vacancy != answer.vacancy:
            log.info(
                "vacancyd: %s %s (%s)",
                probe.url,
                "has vacancy" if answer.vacancy else "has no vacancy",
                answer.why,
            )
        self._answers[probe] = answer
        return answer


async def _get(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """One GET, its body read up to MAX_ANSWER_BYTES (an answer that long is not ours)."""
    async with (
        httpx.AsyncClient(trust_env=False, follow_redirects=False) as client,
        client.stream("GET", url, headers=headers) as response,
    ):
        body = b""
        async for piece in response.aiter_raw():
            body += piece
            if len(body) > MAX_ANSWER_BYTES:
                return response.status_code, b""
        return response.status_code, body


def _setting(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        return float(value) if value else default
    except ValueError:
        log.warning("vacancyd: %s=%r is not a number; using %g", name, value, default)
        return default


# The instance a LiteLLM proxy's config.yaml names (see the module docstring).
vacancy_filter = VacancyFilter(
    cache_s=_setting("VACANCYD_PROBE_CACHE_S", 2.0),
    probe_timeout_s=_setting("VACANCYD_PROBE_TIMEOUT_S", 0.5),
)

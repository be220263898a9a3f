"""Lenders with no vacancy left out of LiteLLM's routing, before it picks one.

A gateway that learns of a refusal only from a 503 sends every refusing lender a request
now and then to find out, benches it for a cooldown, and comes back only when the
cooldown ends, however soon lending resumed. This callback asks each lender first: every
deployment whose `model_info` names a vacancyd probe (`GET /vacancy/<upstream>` on the
lender's API) is kept in the routing decision only while that probe says there is
vacancy for the deployment's model. A refusing lender then gets no borrowed request at
all, only probes, at most one per `cache_s` per gateway; a lender that resumes is back in
the choice within `cache_s`.

Among lenders with vacancy, those whose server already holds the model (the probe says
`resident`) are preferred: while one of them has a free slot, lenders that would have to
load the model are left out too (`prefer_resident`). A lender whose free memory cannot
take the model's footprint says no vacancy for that model, so it is left out as well.

Busy is not absent. A lender whose slots all serve borrowed work says so
(`resource_busy`); that no is kept only `busy_cache_s` (0.25 s), since a slot frees within
seconds, where any other answer is kept `cache_s`. A lender that refuses a request anyway
(its last slot was taken between probe and request) costs the caller one retry
elsewhere, not a bench: the failure drops that lender's cached answer, so LiteLLM's retry
asks the probe again instead of picking it once more from a stale yes.

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

The probe is asked about the model the deployment sends (`litellm_params.model` less its
provider prefix, or `model_info.vacancy_model`). The shared `vacancy_filter` reads its
settings from VACANCYD_PROBE_CACHE_S, VACANCYD_PROBE_TIMEOUT_S,
VACANCYD_PROBE_BUSY_CACHE_S (defaults 2, 0.5 and 0.25 seconds) and
VACANCYD_PREFER_RESIDENT (default 1; 0 turns the preference off).
Deployments without a probe (a server nobody borrows) pass untouched. A probe that cannot
be read, times out, or answers anything but vacancyd's own yes counts as no vacancy: a
gateway must not send borrowed work to a machine it cannot ask. When every deployment of
a group is left out, LiteLLM raises as for a group with none, and its fallbacks apply.

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

from vacancyd.refusals import BUSY_CODE
from vacancyd.vacancy_probe import Probe, probe_of

log = logging.getLogger(__name__)

# vacancyd's answer is a few dozen bytes; anything much larger is not vacancyd.
MAX_ANSWER_BYTES = 16 * 1024


@attrs.frozen
class Answer:
    vacancy: bool
    read_at: float  # time.monotonic()
    why: str  # for the log: what said no, or "vacancy"
    # The lender's server holds the model as loaded (the request loads nothing).
    resident: bool = False
    # A no because every slot serves borrowed work (`resource_busy`): one frees within
    # seconds, so the no is kept only `busy_cache_s`.
    busy: bool = False


def read_answer(status: int, body: bytes) -> tuple[bool, bool, str | None]:
    """(vacancy, resident, reason) from a probe's answer. vacancyd's yes is 200 with
    `"vacancy": true`; anything else (its 503 or 429, a 401 for a missing token, another
    server's 200) is no, with vacancyd's reason code where it gave one."""
    try:
        document = json.loads(body)
    except ValueError:
        return False, False, None
    if not isinstance(document, dict):
        return False, False, None
    if status != 200 or document.get("vacancy") is not True:
        error = document.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        return False, False, code if isinstance(code, str) else None
    return True, document.get("resident") is True, None


class VacancyFilter(CustomLogger):  # type: ignore[misc]  # LiteLLM's class is untyped here
    """LiteLLM calls `async_filter_deployments` on every routing decision; see the module."""

    def __init__(
        self,
        *,
        cache_s: float = 2.0,
        probe_timeout_s: float = 0.5,
        prefer_resident: bool = True,
        busy_cache_s: float = 0.25,
    ) -> None:
        if cache_s < 0 or busy_cache_s < 0 or probe_timeout_s <= 0:
            raise ValueError(
                "cache_s and busy_cache_s must be at least 0 and probe_timeout_s above 0"
            )
        super().__init__()
        self.cache_s = cache_s
        self.busy_cache_s = min(busy_cache_s, cache_s)
        self.probe_timeout_s = probe_timeout_s
        self.prefer_resident = prefer_resident
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
        any_resident = self.prefer_resident and any(
            answer.vacancy and answer.resident for answer in answers.values()
        )
        return [
            deployment
            for deployment, probe in zip(healthy_deployments, probes, strict=True)
            if probe is None
            or (answers[probe].vacancy and (answers[probe].resident or not any_resident))
        ]

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        """A lender that failed a request is asked again before it is picked again: its
        cached yes is what sent the request there, and is no longer news."""
        probe = probe_of(_deployment_of(kwargs))
        if probe is not None and self._answers.pop(probe, None) is not None:
            log.info("vacancyd: %s failed a request; asking its probe again", probe.url)

    async def answer(self, probe: Probe) -> Answer:
        """The probe's answer, read at most `cache_s` ago (a busy no: `busy_cache_s`)."""
        cached = self._answers.get(probe)
        keep_s = self.busy_cache_s if cached is not None and cached.busy else self.cache_s
        if cached is not None and time.monotonic() - cached.read_at < keep_s:
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
                status, body = await _get(probe.asks, headers)
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            answer = Answer(False, time.monotonic(), f"probe unreadable ({type(exc).__name__})")
        else:
            vacancy, resident, reason = read_answer(status, body)
            why = "vacancy" if vacancy else f"HTTP {status}" + (f" {reason}" if reason else "")
            busy = reason == BUSY_CODE
            answer = Answer(vacancy, time.monotonic(), why, resident, busy)
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


def _deployment_of(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The deployment a failed call went to, as LiteLLM passes it to failure callbacks:
    its `model_info` and `litellm_params` (the fields `probe_of` reads)."""
    params = kwargs.get("litellm_params")
    params = params if isinstance(params, dict) else {}
    info = params.get("model_info") or kwargs.get("model_info")
    metadata = params.get("metadata")
    deployment = metadata.get("deployment") if isinstance(metadata, dict) else None
    return {
        "model_info": info if isinstance(info, dict) else {},
        "litellm_params": {"model": deployment if isinstance(deployment, str) else None},
    }


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
    prefer_resident=_setting("VACANCYD_PREFER_RESIDENT", 1.0) != 0,
    busy_cache_s=_setting("VACANCYD_PROBE_BUSY_CACHE_S", 0.25),
)

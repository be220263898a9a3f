"""llama-server's residency: it holds one model for its lifetime, serving `total_slots`
requests at once.

GET /props names the model and, on builds that can sleep, says whether it is asleep (a
sleeping server has unloaded its model and will load it again on the next request). GET
/slots lists each slot with its context and whether it is processing; the seed requires a
fresh /slots reading for llama.cpp credit, so a server started without --slots (501) gets
none. Any request to an awake server reuses its model, whatever model name it sends.
"""

from __future__ import annotations

from typing import Any

import attrs

from vacancyd.adapters.actions import UpstreamCallError, UpstreamContext, call
from vacancyd.adapters.residency import WorkRequest
from vacancyd.model import Residency


@attrs.frozen
class _Reading:
    props: dict[str, Any]
    slots: list[Any] | None  # None: the server does not serve /slots
    slots_error: str = ""


class LlamaCppResidency:
    source = "/props and /slots"

    async def read(self, context: UpstreamContext) -> _Reading:
        props = (await call(context, "GET", "/props")).expect_ok().json()
        if not isinstance(props, dict):
            raise UpstreamCallError("GET /props did not answer a JSON object")
        reply = await call(context, "GET", "/slots")
        if not reply.ok:
            return _Reading(props, None, f"GET /slots answered {reply.status}")
        slots = reply.json()
        if not isinstance(slots, list):
            return _Reading(props, None, "GET /slots did not answer a list")
        return _Reading(props, slots)

    def judge(self, reading: _Reading, request: WorkRequest, taken_at: float) -> Residency:
        props = reading.props
        model = _model_name(props)
        if props.get("is_sleeping") is True:
            return Residency(
                False, taken_at, self.source, "llama-server is asleep (its model is unloaded)"
            )
        if reading.slots is None:
            return Residency(
                False,
                taken_at,
                self.source,
                f"{reading.slots_error}: without /slots (llama-server --slots) residency is "
                "not proved",
            )
        total = props.get("total_slots")
        slots = total if isinstance(total, int) and total > 0 else len(reading.slots)
        busy = sum(
            1 for slot in reading.slots if isinstance(slot, dict) and slot.get("is_processing")
        )
        return Residency(
            True,
            taken_at,
            self.source,
            f"llama-server holds {model}; {busy} of {slots} slots busy",
            model=model,
            slots=slots,
        )

    async def learn(self, context: UpstreamContext, request: WorkRequest) -> None:
        return None


def _model_name(props: dict[str, Any]) -> str:
    alias = props.get("model_alias")
    if isinstance(alias, str) and alias:
        return alias
    path = props.get("model_path")
    if isinstance(path, str) and path:
        return path.rsplit("/", 1)[-1]
    return "its model"

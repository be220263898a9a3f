"""Footprints the daemon finds for itself: learned from measured loads, else estimated.

Admission charges a request the first of: the model's configured footprint; what this
book gives (`hint`); the upstream's default. The book answers with what was learned from
real loads of the model (the conservative prior in learned.py), else an estimate from the
model's geometry at the context the server runs, plus the estimate's margin:

* llama.cpp: `/props` names the model file and its slots and context; the file's GGUF
  header gives the geometry when the file is on this machine;
* Ollama: `/api/show` gives the geometry (`model_info`) and the Modelfile's `num_ctx`,
  `/api/tags` the size.

An estimate is worked out once per model and kept; one that cannot be made (no file here,
the server did not answer) is tried again after RETRY_AFTER_S. The blocking reads run in
a worker thread under READ_DEADLINE_S, so a slow server only costs the first request of a
model that deadline, and never the event loop.

A measured load is the fall in free GPU memory across an exclusive, uncredited job (no
other borrowed job may run on the resource meanwhile): `measure` records it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import httpx
import trio

from vacancyd.config import UpstreamConfig
from vacancyd.errors import log_unexpected
from vacancyd.footprint.estimate import estimate
from vacancyd.footprint.geometry import GeometryError, geometry_from_ollama_model_info
from vacancyd.footprint.gguf_reader import GGUFError, read_geometry
from vacancyd.footprint.learned import LearnedFootprints
from vacancyd.footprint.sources import SourceError, llamacpp_props, ollama_model
from vacancyd.model import FootprintHint
from vacancyd.persist import StateFileProblems

log = logging.getLogger(__name__)

READ_DEADLINE_S = 5.0
RETRY_AFTER_S = 60.0
# Ollama's num_ctx when neither the request nor the Modelfile sets one (v0.6.7 to v0.15.4).
OLLAMA_DEFAULT_CONTEXT = 4096
# A fall in free memory smaller than this across a job is noise, not a load.
MIN_LOAD_MIB = 256


@attrs.frozen
class _Estimate:
    total_mib: int | None
    detail: str
    made_at: float


class FootprintBook:
    def __init__(self, state_dir: Path, problems: StateFileProblems) -> None:
        self.learned = LearnedFootprints(state_dir, problems)
        self.learned.load()
        self._estimates: dict[tuple[str, str], _Estimate] = {}

    async def hint(self, upstream: UpstreamConfig, model: str | None) -> FootprintHint | None:
        """The learned, else estimated, footprint of `model` on `upstream`, if any."""
        if model is not None and model in upstream.models:
            return None  # configured: nothing to find
        key_model = model or ""
        learned = self.learned.get(upstream.name, key_model)
        if learned:
            return FootprintHint(learned, "learned", "measured on earlier loads")
        found = await self._estimate(upstream, key_model)
        if found.total_mib is None:
            return None
        return FootprintHint({upstream.resource: found.total_mib}, "estimated", found.detail)

    async def _estimate(self, upstream: UpstreamConfig, model: str) -> _Estimate:
        key = (upstream.name, model if upstream.adapter.value == "ollama" else "")
        known = self._estimates.get(key)
        now = trio.current_time()
        if known is not None and (
            known.total_mib is not None or now - known.made_at < RETRY_AFTER_S
        ):
            return known
        with trio.move_on_after(READ_DEADLINE_S):
            found = await trio.to_thread.run_sync(
                _estimate_blocking, upstream, model, abandon_on_cancel=True
            )
            self._estimates[key] = _Estimate(found[0], found[1], now)
            if found[0] is not None:
                log.info("estimated %s on %s: %s", model or "its model", upstream.name, found[1])
            return self._estimates[key]
        self._estimates[key] = _Estimate(None, "no answer in time", now)
        return self._estimates[key]

    def measure(self, upstream: str, model: str | None, resource: str, fell_mib: int) -> None:
        """One exclusive load took `fell_mib` of `resource`: learn it (and save, off-loop
        by the caller's choice; saving is small and atomic)."""
        if fell_mib < MIN_LOAD_MIB:
            return
        prior = self.learned.record(upstream, model or "", resource, fell_mib)
        log.info(
            "measured a load of %s on %s: %d MiB of %s (prior now %d MiB)",
            model or "its model",
            upstream,
            fell_mib,
            resource,
            prior,
        )
        try:
            self.learned.save()
        except OSError as exc:
            log.warning("cannot save learned footprints to %s: %s", self.learned.path, exc)


def _estimate_blocking(upstream: UpstreamConfig, model: str) -> tuple[int | None, str]:
    """(total MiB with margin, how it was found), or (None, why not). Blocking."""
    try:
        with httpx.Client(trust_env=False, timeout=READ_DEADLINE_S) as client:
            if upstream.adapter.value == "llamacpp":
                props = llamacpp_props(client, upstream.target)
                if props.model_path is None or not Path(props.model_path).is_file():
                    return None, "llama-server's model file is not on this machine"
                slots = props.total_slots or 1
                context = (props.slot_context or OLLAMA_DEFAULT_CONTEXT) * slots
                geometry = read_geometry(props.model_path)
                where = f"GGUF {props.model_path} at {context} tokens"
                parallel = slots
            elif upstream.adapter.value == "ollama" and model:
                found = ollama_model(client, upstream.target, model)
                geometry = geometry_from_ollama_model_info(found.model_info, found.size_bytes)
                context = found.num_ctx or OLLAMA_DEFAULT_CONTEXT
                where = f"Ollama /api/show at {context} tokens"
                parallel = 1
            else:
                return None, "no geometry source for this adapter"
    except (SourceError, GGUFError, GeometryError, OSError, httpx.HTTPError) as exc:
        return None, f"cannot estimate: {exc}"
    except Exception as exc:
        # The server's answers are outside input: a shape nobody planned for means no
        # estimate (the default footprint is charged), never a borrower's 500.
        log_unexpected(log, f"estimating {model or 'its model'} on {upstream.name}", exc)
        return None, f"cannot estimate ({type(exc).__name__})"
    result = estimate(geometry, context, parallel)
    parts = (
        f"weights {result.weights_mib} + KV {result.kv_cache_mib} + recurrent "
        f"{result.recurrent_state_mib} + overhead {result.overhead_mib} + margin "
        f"{result.margin_mib} MiB"
    )
    return result.total_mib, f"estimated from {where}: {parts}"

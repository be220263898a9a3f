"""Ollama's residency: /api/ps lists the loaded models, but a request reuses one only if it
would not make Ollama reload it.

Ollama reloads a model when a request's runner options differ from the loaded runner's
(research: `needsReload`), and it resolves an unset `num_ctx` from its own defaults, so a
listed model proves nothing by itself. A request is credited only when:

* /api/ps lists its model under the canonical name (`name:latest` for a bare name), with
  `expires_at` at least EXPIRY_MARGIN_S away (a model about to expire is as good as gone);
* it sets no runner option other than `num_ctx`;
* the loaded context is one it is known to reuse: its explicit `num_ctx` equals it; or an
  earlier request of the same kind (model digest, explicit or unset `num_ctx`, /api or
  /v1) was seen to load exactly that context (the learned context map, kept across
  restarts); or it leaves `num_ctx` unset and the Modelfile's own `num_ctx` (read from
  /api/show once per digest) equals it.

Ollama does not report its parallel slots (OLLAMA_NUM_PARALLEL does not change
`context_length` since v0.10), so the proof leaves `slots` unknown and the upstream's
`max_concurrent` decides.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs

from vacancyd.adapters.actions import UpstreamCallError, UpstreamContext, call
from vacancyd.adapters.residency import WorkRequest
from vacancyd.model import Residency
from vacancyd.persist import UntrustedFile, read_json, write_json

log = logging.getLogger(__name__)

CONTEXTS_KIND = "ollama_contexts"
EXPIRY_MARGIN_S = 30.0
# Options that are the runner's, not sampling's: any of them may reload the model.
RUNNER_OPTIONS = frozenset(
    {
        "num_batch",
        "num_gpu",
        "main_gpu",
        "use_mmap",
        "num_thread",
        "draft_num_predict",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mlock",
    }
)
_NUM_CTX_PARAMETER = re.compile(r"^\s*num_ctx\s+(\d+)\s*$", re.MULTILINE)


@attrs.frozen
class _Loaded:
    name: str
    digest: str
    context: int | None
    expires_in_s: float | None


@attrs.frozen
class _Kind:
    """Requests that load a model the same way: same weights, same context setting."""

    digest: str
    num_ctx: int | None
    dialect: str  # "api" or "v1"


class OllamaResidency:
    source = "/api/ps"

    def __init__(self, contexts_path: Path | None = None) -> None:
        self._contexts_path = contexts_path
        self._learned: dict[_Kind, int] = _load(contexts_path)
        self._modelfile_ctx: dict[str, int | None] = {}

    async def read(self, context: UpstreamContext) -> list[_Loaded]:
        document = (await call(context, "GET", "/api/ps")).expect_ok().json()
        wall = time.time()
        loaded = _parse(document, wall)
        for model in loaded:
            if model.digest and model.digest not in self._modelfile_ctx:
                self._modelfile_ctx[model.digest] = await _modelfile_num_ctx(context, model.name)
        return loaded

    def judge(self, reading: list[_Loaded], request: WorkRequest, taken_at: float) -> Residency:
        def no(detail: str) -> Residency:
            return Residency(False, taken_at, self.source, detail)

        if request.model is None:
            return no("the request names no model")
        name = canonical(request.model)
        model = next((m for m in reading if m.name == name), None)
        if model is None:
            return no(f"{name} is not loaded")
        if model.expires_in_s is None or model.expires_in_s < EXPIRY_MARGIN_S:
            return no(f"{name} expires within {EXPIRY_MARGIN_S:g}s")
        options = request.body.get("options")
        options = options if isinstance(options, dict) else {}
        reloading = sorted(RUNNER_OPTIONS & options.keys())
        if reloading:
            return no(f"runner options {', '.join(reloading)} may reload {name}")
        if model.context is None:
            return no("the server does not report the loaded context (Ollama before 0.10)")
        kind = _kind_of(model.digest, request)
        why = self._context_reused(model, kind)
        if why is None:
            return no(
                f"{name} is loaded with context {model.context}; this request's context is "
                "not known to match it"
            )
        return Residency(True, taken_at, self.source, f"{name} is loaded ({why})", model=name)

    def _context_reused(self, model: _Loaded, kind: _Kind) -> str | None:
        if kind.num_ctx is not None and kind.num_ctx == model.context:
            return "num_ctx matches"
        if self._learned.get(kind) == model.context:
            return "context learned from an earlier load"
        modelfile = self._modelfile_ctx.get(model.digest)
        if kind.num_ctx is None and modelfile is not None and modelfile == model.context:
            return "the Modelfile's num_ctx matches"
        return None

    async def learn(self, context: UpstreamContext, request: WorkRequest) -> None:
        """After a load: remember which context this kind of request loaded."""
        if request.model is None:
            return
        loaded = _parse((await call(context, "GET", "/api/ps")).expect_ok().json(), time.time())
        name = canonical(request.model)
        model = next((m for m in loaded if m.name == name), None)
        if model is None or model.context is None or not model.digest:
            return
        kind = _kind_of(model.digest, request)
        if self._learned.get(kind) != model.context:
            self._learned[kind] = model.context
            self._save()

    def _save(self) -> None:
        if self._contexts_path is None:
            return
        entries = [
            {"digest": k.digest, "num_ctx": k.num_ctx, "dialect": k.dialect, "context": v}
            for k, v in self._learned.items()
        ]
        try:
            write_json(self._contexts_path, CONTEXTS_KIND, {"contexts": entries})
        except OSError as exc:
            log.warning("cannot save learned Ollama contexts to %s: %s", self._contexts_path, exc)


def canonical(model: str) -> str:
    """Ollama's display name: a bare name means its `latest` tag."""
    return model if ":" in model.rsplit("/", 1)[-1] else f"{model}:latest"


def _kind_of(digest: str, request: WorkRequest) -> _Kind:
    dialect = "v1" if request.path.startswith("/v1/") else "api"
    options = request.body.get("options")
    num_ctx = options.get("num_ctx") if isinstance(options, dict) and dialect == "api" else None
    explicit = num_ctx if isinstance(num_ctx, int) and not isinstance(num_ctx, bool) else None
    return _Kind(digest, explicit, dialect)


def _parse(document: Any, wall: float) -> list[_Loaded]:
    if not isinstance(document, dict) or not isinstance(document.get("models") or [], list):
        raise UpstreamCallError('GET /api/ps did not answer {"models": [...]}')
    loaded = []
    for row in document.get("models") or []:
        if not isinstance(row, dict):
            continue
        name = row.get("name") or row.get("model")
        if not isinstance(name, str):
            continue
        context = row.get("context_length")
        expires = _parse_time(row.get("expires_at"))
        digest = row.get("digest")
        loaded.append(
            _Loaded(
                name=name,
                digest=digest if isinstance(digest, str) else "",
                context=context if isinstance(context, int) and context > 0 else None,
                expires_in_s=expires - wall if expires is not None else None,
            )
        )
    return loaded


def _parse_time(value: Any) -> float | None:
    """Go's RFC 3339 with nanoseconds and the server's offset, as a POSIX time."""
    if not isinstance(value, str):
        return None
    text = re.sub(r"(\.\d{6})\d+", r"\1", value.replace("Z", "+00:00"))
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


async def _modelfile_num_ctx(context: UpstreamContext, name: str) -> int | None:
    try:
        shown = (await call(context, "POST", "/api/show", {"model": name})).expect_ok().json()
    except UpstreamCallError:
        return None
    parameters = shown.get("parameters") if isinstance(shown, dict) else None
    found = _NUM_CTX_PARAMETER.search(parameters) if isinstance(parameters, str) else None
    return int(found.group(1)) if found else None


def _load(path: Path | None) -> dict[_Kind, int]:
    if path is None:
        return {}
    try:
        payload = read_json(path, CONTEXTS_KIND)
    except UntrustedFile as exc:
        # Nothing learned is the safe default here: requests are then charged in full.
        log.warning("ignoring learned Ollama contexts: %s %s", path, exc.reason)
        return {}
    learned: dict[_Kind, int] = {}
    for entry in (payload or {}).get("contexts", []):
        if not isinstance(entry, dict):
            continue
        digest, num_ctx, dialect, value = (
            entry.get("digest"),
            entry.get("num_ctx"),
            entry.get("dialect"),
            entry.get("context"),
        )
        if (
            isinstance(digest, str)
            and isinstance(num_ctx, int | None)
            and dialect in ("api", "v1")
            and isinstance(value, int)
        ):
            learned[_Kind(digest, num_ctx, dialect)] = value
    return learned

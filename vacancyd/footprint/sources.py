"""Where `vacancyd footprint` finds a model's geometry and context on a running server.

Blocking HTTP for the CLI (the daemon's adapters own their own asynchronous probes):

- llama-server: `GET /props` names the model file (`model_path`), the context of one slot
  (`default_generation_settings.n_ctx`), the number of slots (`total_slots`) and, where
  the server says, its KV cache types (`cache_type_k`, `cache_type_v`, at the top level
  or in `default_generation_settings`; builds of late 2025 do not say);
- Ollama: `POST /api/show` returns the model's GGUF metadata as `model_info` and its
  Modelfile parameters (`num_ctx` among them); `GET /api/tags` gives its size on disk and
  its digest, which changes whenever the model does (`ollama_listing`).

Replies are read up to MAX_REPLY_BYTES and must be JSON objects; anything else is a
SourceError that says which URL answered what.
"""

from __future__ import annotations

import re
from typing import Any, Final

import attrs
import httpx

from vacancyd.errors import quiet_detail
from vacancyd.json_input import JsonRejected, parse_json

MAX_REPLY_BYTES: Final = 64 * 1024 * 1024
_NUM_CTX: Final = re.compile(r"^\s*num_ctx\s+(\d+)\s*$", re.MULTILINE)


class SourceError(Exception):
    """A server could not tell us what we asked; the message says which and why."""


@attrs.frozen
class LlamaServerProps:
    model_path: str | None
    model_alias: str | None
    slot_context: int | None
    total_slots: int | None
    cache_type_k: str | None = None
    cache_type_v: str | None = None


@attrs.frozen
class OllamaListing:
    """What `/api/tags` says of one model: its size and digest (None: not listed)."""

    size_bytes: int | None
    digest: str | None


@attrs.frozen
class OllamaModel:
    model_info: dict[str, Any]
    size_bytes: int | None
    num_ctx: int | None
    digest: str | None = None


def llamacpp_props(client: httpx.Client, target: str) -> LlamaServerProps:
    """What llama-server's `/props` says about its model and slots."""
    props = _json(client, "GET", _url(target, "/props"))
    settings = props.get("default_generation_settings")
    settings = settings if isinstance(settings, dict) else {}
    return LlamaServerProps(
        model_path=_str_or_none(props.get("model_path")),
        model_alias=_str_or_none(props.get("model_alias")),
        slot_context=_positive_or_none(settings.get("n_ctx")),
        total_slots=_positive_or_none(props.get("total_slots")),
        cache_type_k=_str_or_none(props.get("cache_type_k") or settings.get("cache_type_k")),
        cache_type_v=_str_or_none(props.get("cache_type_v") or settings.get("cache_type_v")),
    )


def ollama_model(client: httpx.Client, target: str, model: str) -> OllamaModel:
    """Ollama's metadata, size and Modelfile `num_ctx` for one model.

    `/api/show` without `verbose` replaces arrays longer than five items with `[]`, and
    per-layer values are such arrays; when any model key came back that way, it is asked
    again with `verbose` (which also sends the whole vocabulary, hence the reply cap).
    """
    show = _json(client, "POST", _url(target, "/api/show"), {"model": model})
    info = show.get("model_info")
    if not isinstance(info, dict):
        raise SourceError(f"{target}/api/show has no model_info for {model!r}")
    architecture = info.get("general.architecture")
    if any(value == [] for key, value in info.items() if key.startswith(f"{architecture}.")):
        show = _json(client, "POST", _url(target, "/api/show"), {"model": model, "verbose": True})
        verbose_info = show.get("model_info")
        if isinstance(verbose_info, dict):
            info = verbose_info
    parameters = show.get("parameters")
    found = _NUM_CTX.search(parameters) if isinstance(parameters, str) else None
    try:
        listing = ollama_listing(client, target, model)
    except SourceError:
        listing = OllamaListing(None, None)
    return OllamaModel(
        model_info=info,
        size_bytes=listing.size_bytes,
        num_ctx=int(found.group(1)) if found else None,
        digest=listing.digest,
    )


def ollama_listing(client: httpx.Client, target: str, model: str) -> OllamaListing:
    """The model's size on disk and digest from `/api/tags` (Nones when it is not
    listed); a SourceError when the server does not answer."""
    tags = _json(client, "GET", _url(target, "/api/tags"))
    names = {model, model if ":" in model else f"{model}:latest"}
    listed = tags.get("models")
    for entry in listed if isinstance(listed, list) else []:
        if isinstance(entry, dict) and (entry.get("name") in names or entry.get("model") in names):
            return OllamaListing(
                _positive_or_none(entry.get("size")), _str_or_none(entry.get("digest"))
            )
    return OllamaListing(None, None)


def _json(client: httpx.Client, method: str, url: str, body: Any = None) -> dict[str, Any]:
    try:
        with client.stream(method, url, json=body) as response:
            raw = bytearray()
            for chunk in response.iter_bytes():
                raw += chunk
                if len(raw) > MAX_REPLY_BYTES:
                    raise SourceError(f"{url} answered more than {MAX_REPLY_BYTES} bytes")
            status = response.status_code
    except httpx.HTTPError as exc:
        # By class: httpx's messages may quote bytes of the server's answer.
        raise SourceError(f"cannot reach {url}: {type(exc).__name__}: {quiet_detail(exc)}") from exc
    if status != 200:
        raise SourceError(f"{url} answered {status}")
    try:
        document = parse_json(bytes(raw), max_bytes=MAX_REPLY_BYTES)
    except JsonRejected as exc:
        raise SourceError(f"{url} did not answer usable JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise SourceError(f"{url} did not answer a JSON object")
    return document


def _url(target: str, path: str) -> str:
    return target.rstrip("/") + path


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _positive_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

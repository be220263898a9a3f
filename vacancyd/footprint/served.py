"""What a running server serves, read once for admission and `vacancyd footprint` alike.

Admission's estimate (book.py) and the CLI's (command.py) must charge the same MiB for the
same model on the same server, so both read the server here and size it with
`size_served`; nothing else in either decides a number. Read from the server:

* the model's geometry: llama-server's `/props` names its model file, whose GGUF header
  is read when it is on this machine; Ollama's `/api/show` carries the same metadata;
* the context and slots: `/props` (per-slot `n_ctx` x `total_slots`); for Ollama the
  Modelfile's `num_ctx`, else the server's `OLLAMA_CONTEXT_LENGTH`, else 4096, times
  `OLLAMA_NUM_PARALLEL` (else 1);
* the KV cache type: `/props` where it says (builds of late 2025 do not), else
  llama-server's own `-ctk`/`-ctv` arguments or `LLAMA_ARG_CACHE_TYPE_K`/`_V` where its
  process can be read; for Ollama `OLLAMA_KV_CACHE_TYPE` when its environment can be
  read and `OLLAMA_FLASH_ATTENTION` is on (Ollama quantises the cache only with flash
  attention); else f16 (llama.cpp's and Ollama's default), stated as an assumption in
  `cache_type_source`;
* an identity: the model file (path, size, mtime, inode) or Ollama's digest, and the
  settings above. An estimate is good while the identity holds (`served_identity`
  re-reads it cheaply, with no GGUF header and no `/api/show`).

Every read sends the upstream's own credential (`upstream_client`): a server behind an
API key answers `/props` only to it. The runtime base follows the resource sized: a GPU's
CUDA context, or the host runtime for a memory resource (`runtime_mib`).

Blocking: the daemon calls it on a worker thread under a deadline.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import attrs
import httpx

from vacancyd.config import UpstreamConfig
from vacancyd.config.schema import AdapterName
from vacancyd.footprint.estimate import (
    CACHE_TYPE_BYTES,
    DEFAULT_MARGIN_PCT,
    GPU_RUNTIME_MIB,
    HOST_RUNTIME_MIB,
    FootprintEstimate,
    estimate,
)
from vacancyd.footprint.geometry import Geometry, geometry_from_ollama_model_info
from vacancyd.footprint.gguf_reader import read_geometry
from vacancyd.footprint.processes import FindServer, server_command, server_environment
from vacancyd.footprint.sources import (
    LlamaServerProps,
    llamacpp_props,
    ollama_listing,
    ollama_model,
)
from vacancyd.model import ResourceKind

# The context of a server that does not say: llama.cpp's and Ollama's (v0.6.7 to v0.15.4)
# default num_ctx.
DEFAULT_CONTEXT: Final = 4096
ASSUMED_CACHE_TYPE: Final = "f16"
# Ollama's environment, as its server reads it (envconfig).
OLLAMA_CACHE_TYPE_ENV: Final = "OLLAMA_KV_CACHE_TYPE"
OLLAMA_FLASH_ENV: Final = "OLLAMA_FLASH_ATTENTION"
OLLAMA_CONTEXT_ENV: Final = "OLLAMA_CONTEXT_LENGTH"
OLLAMA_PARALLEL_ENV: Final = "OLLAMA_NUM_PARALLEL"
_TRUE: Final = frozenset({"1", "t", "true"})  # Go's strconv.ParseBool, as Ollama reads it

Identity = tuple[object, ...]


class Unsizable(Exception):
    """This server cannot tell what its model takes; the message says why, for a person."""


@attrs.frozen
class Overrides:
    """What a person told the CLI instead of what the server says (None: ask it)."""

    gguf: str | None = None
    model: str | None = None
    context: int | None = None
    parallel: int | None = None
    cache_type: str | None = None
    unified_kv: bool = False


@attrs.frozen
class Served:
    """A model as its server runs it, with where each fact came from."""

    model: str
    geometry: Geometry
    geometry_source: str
    context: int
    parallel: int
    context_source: str
    cache_type: str
    cache_type_source: str
    unified_kv: bool
    identity: Identity


def runtime_mib(kind: ResourceKind) -> int:
    """The fixed runtime base of a load on this kind of resource."""
    return GPU_RUNTIME_MIB if kind is ResourceKind.NVIDIA_GPU else HOST_RUNTIME_MIB


def size_served(
    served: Served, kind: ResourceKind, margin_pct: float = DEFAULT_MARGIN_PCT
) -> FootprintEstimate:
    """The footprint of `served` on a resource of `kind`: the one sizing rule for both
    admission and the CLI. Raises ValueError for impossible numbers."""
    return estimate(
        served.geometry,
        served.context,
        served.parallel,
        CACHE_TYPE_BYTES[served.cache_type],
        margin_pct,
        runtime_mib=runtime_mib(kind),
        unified_kv=served.unified_kv,
    )


def describe(served: Served, result: FootprintEstimate) -> str:
    """How an estimate was reached, in one line: the operator's evidence behind a charge."""
    return (
        f"estimated from the {served.geometry_source} at {served.context} tokens "
        f"({served.parallel} slot(s)), {served.cache_type} KV cache "
        f"[{served.cache_type_source}]: weights {result.weights_mib} + KV "
        f"{result.kv_cache_mib} + recurrent {result.recurrent_state_mib} + overhead "
        f"{result.overhead_mib} + margin {result.margin_mib} = {result.total_mib} MiB"
    )


def can_size(upstream: UpstreamConfig) -> bool:
    """Whether this upstream's server can tell its model's geometry."""
    return upstream.adapter in (AdapterName.LLAMACPP, AdapterName.OLLAMA)


def upstream_client(credential: str | None, timeout_s: float) -> httpx.Client:
    """A client for vacancyd's own reads of an upstream, with its credential."""
    headers = {"Authorization": f"Bearer {credential}"} if credential else {}
    return httpx.Client(trust_env=False, timeout=timeout_s, headers=headers)


def read_served(
    upstream: UpstreamConfig,
    model: str | None,
    client: httpx.Client,
    *,
    overrides: Overrides = Overrides(),
    find_server: FindServer | None = None,
) -> Served:
    """Read what `upstream`'s server runs for `model` (blocking).

    Raises Unsizable, SourceError (the server did not answer usably), GGUFError,
    GeometryError or OSError (the model file).
    """
    if upstream.adapter is AdapterName.LLAMACPP:
        return _llamacpp(upstream, client, overrides, find_server)
    if upstream.adapter is AdapterName.OLLAMA:
        name = overrides.model or model
        if not name:
            raise Unsizable("an ollama upstream serves many models: name one")
        return _ollama(upstream, name, client, overrides, find_server)
    raise Unsizable(f"a {upstream.adapter.value} upstream cannot tell a model's geometry")


def served_identity(
    upstream: UpstreamConfig,
    model: str | None,
    client: httpx.Client,
    find_server: FindServer | None = None,
) -> Identity:
    """The identity `read_served` would give now, read cheaply (blocking; raises as it)."""
    if upstream.adapter is AdapterName.LLAMACPP:
        props = llamacpp_props(client, upstream.target)
        launched = _llamacpp_launch(upstream, find_server)
        return _llamacpp_identity(props, props.model_path, launched)
    name = model or ""
    digest = ollama_listing(client, upstream.target, name).digest
    return _ollama_identity(name, digest, _ollama_settings(upstream, find_server))


def read_gguf(path: str) -> Geometry:
    """A GGUF file's geometry (header only; raises GGUFError, GeometryError, OSError)."""
    return read_geometry(path)


# -- llama.cpp ---------------------------------------------------------------------------


@attrs.frozen
class _Launch:
    """llama-server's KV cache types as it was started (None: not given, or unread)."""

    readable: bool
    cache_type_k: str | None = None
    cache_type_v: str | None = None


_CACHE_FLAGS: Final = {
    "-ctk": "k",
    "--cache-type-k": "k",
    "-ctv": "v",
    "--cache-type-v": "v",
}
_CACHE_ENV: Final = {"LLAMA_ARG_CACHE_TYPE_K": "k", "LLAMA_ARG_CACHE_TYPE_V": "v"}


def _llamacpp_launch(upstream: UpstreamConfig, find_server: FindServer | None) -> _Launch:
    """What llama-server's command line (or, failing that, its environment) sets."""
    pids = find_server(upstream.endpoint) if find_server is not None else set()
    command = server_command(pids) if pids else None
    if command is None:
        return _Launch(readable=False)
    found: dict[str, str] = {}
    environ = server_environment(pids) or {}
    for key, which in _CACHE_ENV.items():
        if environ.get(key):
            found[which] = environ[key].strip().lower()
    for position, argument in enumerate(command):
        flag, _, value = argument.partition("=")
        if flag in _CACHE_FLAGS:
            value = value or (command[position + 1] if position + 1 < len(command) else "")
            found[_CACHE_FLAGS[flag]] = value.strip().lower()  # the command line wins
    return _Launch(True, found.get("k"), found.get("v"))


def _llamacpp(
    upstream: UpstreamConfig,
    client: httpx.Client,
    overrides: Overrides,
    find_server: FindServer | None,
) -> Served:
    props = llamacpp_props(client, upstream.target)
    launched = _llamacpp_launch(upstream, find_server)
    path = overrides.gguf or props.model_path
    if path is None:
        raise Unsizable(f"{upstream.target}/props names no model_path")
    if not Path(path).is_file():
        raise Unsizable(f"llama-server's model file {path} is not on this machine")
    model = overrides.model or props.model_alias or Path(path).name.removesuffix(".gguf")
    slots = props.total_slots or 1
    parallel = overrides.parallel if overrides.parallel is not None else slots
    if overrides.context is not None:
        context, context_source = overrides.context, "--context"
    elif props.slot_context is not None:
        context = props.slot_context * slots
        context_source = (
            f"llama-server /props: {props.slot_context} per slot x {slots} slot(s); "
            "with a unified KV cache (-kvu) the server holds less: give --context"
        )
    else:
        context = DEFAULT_CONTEXT
        context_source = f"default {DEFAULT_CONTEXT} tokens: /props has no n_ctx"
    cache_type, cache_source = _llamacpp_cache_type(props, launched, overrides)
    where = "--gguf" if overrides.gguf else "llama-server /props model_path"
    return Served(
        model=model,
        geometry=read_gguf(path),
        geometry_source=f"GGUF header of {path} ({where})",
        context=context,
        parallel=parallel,
        context_source=context_source,
        cache_type=cache_type,
        cache_type_source=cache_source,
        unified_kv=overrides.unified_kv,
        identity=_llamacpp_identity(props, props.model_path, launched),
    )


def _llamacpp_cache_type(
    props: LlamaServerProps, launched: _Launch, overrides: Overrides
) -> tuple[str, str]:
    if overrides.cache_type is not None:
        return overrides.cache_type, "--cache-type"
    if props.cache_type_k is not None or props.cache_type_v is not None:
        return _larger_of(props.cache_type_k, props.cache_type_v, "llama-server /props")
    if not launched.readable:
        why = "/props does not say, and the server's process cannot be read"
        return ASSUMED_CACHE_TYPE, f"{ASSUMED_CACHE_TYPE} assumed: {why}; give --cache-type"
    return _larger_of(
        launched.cache_type_k, launched.cache_type_v, "llama-server's -ctk/-ctv (f16 unset)"
    )


def _larger_of(k: str | None, v: str | None, where: str) -> tuple[str, str]:
    """K and V may differ (-ctk, -ctv): the larger element sizes both, never less; one not
    given is llama.cpp's default, f16."""
    stated = [(t or ASSUMED_CACHE_TYPE).lower() for t in (k, v)]
    unknown = [t for t in stated if t not in CACHE_TYPE_BYTES]
    if unknown:
        return ASSUMED_CACHE_TYPE, (
            f"{ASSUMED_CACHE_TYPE} assumed: {where} names a cache type we do not know "
            f"({', '.join(unknown)}); give --cache-type"
        )
    larger = max(stated, key=lambda t: CACHE_TYPE_BYTES[t])
    return larger, f"{where}: K {stated[0]}, V {stated[1]}"


def _llamacpp_identity(props: LlamaServerProps, path: str | None, launched: _Launch) -> Identity:
    file: tuple[int, int, int] | None = None
    if path is not None:
        try:
            found = os.stat(path)
            file = (found.st_size, found.st_mtime_ns, found.st_ino)
        except OSError:
            file = None
    return (
        "llamacpp",
        path,
        file,
        props.slot_context,
        props.total_slots,
        props.cache_type_k,
        props.cache_type_v,
        launched,
    )


# -- Ollama ------------------------------------------------------------------------------


@attrs.frozen
class _OllamaSettings:
    """What Ollama's server environment says, or why it cannot be read."""

    readable: bool
    cache_type: str | None = None
    flash_attention: bool = False
    context: int | None = None
    parallel: int | None = None

    @classmethod
    def of(cls, environ: Mapping[str, str] | None) -> _OllamaSettings:
        if environ is None:
            return cls(readable=False)
        cache = environ.get(OLLAMA_CACHE_TYPE_ENV, "").strip().lower() or None
        flash = environ.get(OLLAMA_FLASH_ENV, "").strip().lower() in _TRUE
        return cls(
            True,
            cache,
            flash,
            _env_int(environ, OLLAMA_CONTEXT_ENV),
            _env_int(environ, OLLAMA_PARALLEL_ENV),
        )


def _env_int(environ: Mapping[str, str], key: str) -> int | None:
    text = environ.get(key, "").strip()
    # ASCII digits only, and not absurdly many: "²" is a digit to str.isdigit and int()
    # refuses more than 4300 of them; either would throw the whole estimate away.
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        return None
    return int(text) if int(text) > 0 else None


def _ollama_settings(upstream: UpstreamConfig, find_server: FindServer | None) -> _OllamaSettings:
    if find_server is None:
        return _OllamaSettings(readable=False)
    pids = find_server(upstream.endpoint)
    return _OllamaSettings.of(server_environment(pids) if pids else None)


def _ollama(
    upstream: UpstreamConfig,
    model: str,
    client: httpx.Client,
    overrides: Overrides,
    find_server: FindServer | None,
) -> Served:
    settings = _ollama_settings(upstream, find_server)
    found = ollama_model(client, upstream.target, model)
    if overrides.gguf is not None:
        geometry, geometry_source = read_gguf(overrides.gguf), f"GGUF header of {overrides.gguf}"
    else:
        geometry = geometry_from_ollama_model_info(found.model_info, found.size_bytes)
        geometry_source = f"Ollama /api/show model_info for {model}"
    if overrides.parallel is not None:
        parallel, slots_from = overrides.parallel, "--parallel"
    elif settings.parallel is not None:
        parallel, slots_from = settings.parallel, OLLAMA_PARALLEL_ENV
    else:
        parallel, slots_from = 1, "1 slot assumed"
    if overrides.context is not None:
        context, context_source = overrides.context, "--context"
    elif found.num_ctx is not None:
        context = found.num_ctx * parallel
        context_source = f"Modelfile num_ctx {found.num_ctx} x {parallel} slot(s) ({slots_from})"
    elif settings.context is not None:
        context = settings.context * parallel
        context_source = (
            f"the server's {OLLAMA_CONTEXT_ENV} {settings.context} x {parallel} slot(s) "
            f"({slots_from})"
        )
    else:
        context = DEFAULT_CONTEXT * parallel
        context_source = (
            f"Ollama's default num_ctx {DEFAULT_CONTEXT} x {parallel} slot(s) ({slots_from}); "
            "servers from v0.15.5 pick a larger default by VRAM unless "
            f"{OLLAMA_CONTEXT_ENV} is set: give --context"
        )
    cache_type, cache_source = _ollama_cache_type(settings, overrides)
    return Served(
        model=model,
        geometry=geometry,
        geometry_source=geometry_source,
        context=context,
        parallel=parallel,
        context_source=context_source,
        cache_type=cache_type,
        cache_type_source=cache_source,
        unified_kv=overrides.unified_kv,
        identity=_ollama_identity(model, found.digest, settings),
    )


def _ollama_cache_type(settings: _OllamaSettings, overrides: Overrides) -> tuple[str, str]:
    if overrides.cache_type is not None:
        return overrides.cache_type, "--cache-type"
    if not settings.readable:
        why = "the Ollama server's environment cannot be read (not on this machine, or "
        return ASSUMED_CACHE_TYPE, (
            f"{ASSUMED_CACHE_TYPE} assumed: {why}another user's process); give --cache-type"
        )
    stated = settings.cache_type
    if stated is None or stated == ASSUMED_CACHE_TYPE:
        return (
            ASSUMED_CACHE_TYPE,
            f"the server's environment ({OLLAMA_CACHE_TYPE_ENV} unset or f16)",
        )
    if stated not in CACHE_TYPE_BYTES:
        return ASSUMED_CACHE_TYPE, (
            f"{ASSUMED_CACHE_TYPE} assumed: {OLLAMA_CACHE_TYPE_ENV}={stated} is not a type "
            "Ollama knows, and it falls back to f16"
        )
    if not settings.flash_attention:
        return ASSUMED_CACHE_TYPE, (
            f"{ASSUMED_CACHE_TYPE} assumed: {OLLAMA_CACHE_TYPE_ENV}={stated} takes effect only "
            f"with flash attention, which {OLLAMA_FLASH_ENV} does not turn on"
        )
    return stated, f"the server's {OLLAMA_CACHE_TYPE_ENV}={stated} ({OLLAMA_FLASH_ENV} on)"


def _ollama_identity(model: str, digest: str | None, settings: _OllamaSettings) -> Identity:
    return ("ollama", model, digest, settings)

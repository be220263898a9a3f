"""`vacancyd footprint`: a model's estimated memory, what was learned, and a config snippet.

The geometry comes from a GGUF file (`--gguf`), or from the running server of an upstream
(`--config FILE --upstream NAME --model M`): llama-server's `/props` names its model file,
read here when it is on this machine; Ollama's `/api/show` carries the same metadata.
The context is `--context`, else what the server runs: llama-server's per-slot context x
its slots, Ollama's Modelfile `num_ctx` (or 4096) x `--parallel`. The output says which
source each number came from, then prints a TOML snippet in the config's own schema
(`[upstream.models."M"] need_mib = {...}`) that `vacancyd check-config` accepts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs
import httpx

from vacancyd.config import Config, UpstreamConfig, load_config, resolve_state_dir
from vacancyd.config.schema import AdapterName
from vacancyd.errors import ConfigError, StartupError
from vacancyd.footprint.estimate import (
    CACHE_TYPE_BYTES,
    DEFAULT_MARGIN_PCT,
    GPU_RUNTIME_MIB,
    HOST_RUNTIME_MIB,
    FootprintEstimate,
    estimate,
)
from vacancyd.footprint.geometry import Geometry, GeometryError
from vacancyd.footprint.learned import LearnedFootprints
from vacancyd.model import ResourceKind
from vacancyd.persist import StateFileProblems

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
DEFAULT_CONTEXT = 4096
HTTP_TIMEOUT_S = 30.0


class _Failed(Exception):
    """Stop with this message, for a person."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `footprint` subcommand's options."""
    parser.add_argument("--gguf", metavar="PATH", help="read the geometry from this GGUF file")
    parser.add_argument("--config", metavar="FILE", help="configuration file (TOML)")
    parser.add_argument("--upstream", metavar="NAME", help="upstream in the config")
    parser.add_argument("--model", metavar="M", help="model name, as borrowers send it")
    parser.add_argument(
        "--resource", metavar="NAME", help="resource to size (default: the upstream's, or gpu0)"
    )
    parser.add_argument("--context", type=int, metavar="N", help="tokens of KV cache in all")
    parser.add_argument("--parallel", type=int, metavar="N", help="slots sharing the context")
    parser.add_argument(
        "--cache-type", default="f16", choices=sorted(CACHE_TYPE_BYTES), help="KV cache type"
    )
    parser.add_argument(
        "--kv-unified", action="store_true", help="the server shares one KV cache among slots"
    )
    parser.add_argument(
        "--margin-pct", type=float, default=DEFAULT_MARGIN_PCT, metavar="P", help="margin, %%"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


@attrs.frozen
class _Found:
    geometry: Geometry
    geometry_source: str
    model: str
    context: int
    parallel: int
    context_source: str


@attrs.frozen
class _Target:
    config: Config | None
    upstream: UpstreamConfig | None
    resource: str
    kind: ResourceKind


def run(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status (2 for a config problem)."""
    try:
        target = _target(args)
        found = _find(args, target)
        if found.context < 1 or found.parallel < 1:
            raise _Failed("--context and --parallel must be at least 1")
        on_gpu = target.kind is ResourceKind.NVIDIA_GPU
        result = estimate(
            found.geometry,
            found.context,
            found.parallel,
            CACHE_TYPE_BYTES[args.cache_type],
            args.margin_pct,
            runtime_mib=GPU_RUNTIME_MIB if on_gpu else HOST_RUNTIME_MIB,
            unified_kv=args.kv_unified,
        )
    except ConfigError as exc:
        print(f"{args.config}: {len(exc.messages)} problem(s):", file=sys.stderr)
        for message in exc.messages:
            print(f"  {message}", file=sys.stderr)
        return EXIT_CONFIG
    except (_Failed, GeometryError, StartupError, ValueError, OSError) as exc:
        print(f"vacancyd footprint: {exc}", file=sys.stderr)
        return EXIT_FAILED
    learned, learned_note = _learned(target, found.model)
    need = _need(target, result, learned)
    if args.json:
        print(json.dumps(_document(target, found, result, learned, learned_note, need), indent=2))
    else:
        print(_report(target, found, result, learned, learned_note, need))
    return EXIT_OK


def _target(args: argparse.Namespace) -> _Target:
    if args.config is None:
        if args.upstream is not None:
            raise _Failed("--upstream needs --config")
        if args.gguf is None:
            raise _Failed("give --gguf PATH, or --config FILE with an upstream and model")
        return _Target(None, None, args.resource or "gpu0", ResourceKind.NVIDIA_GPU)
    config = load_config(args.config)
    upstream = _upstream(config, args.upstream)
    resource = args.resource or upstream.resource
    if resource not in {upstream.resource, *upstream.also_requires}:
        raise _Failed(f"{resource!r} is not one of upstream {upstream.name!r}'s resources")
    kind = config.resource_named(resource).kind
    if not kind.has_bytes:
        raise _Failed(f"{resource!r} is a cpu resource: it has no memory to size")
    return _Target(config, upstream, resource, kind)


def _upstream(config: Config, name: str | None) -> UpstreamConfig:
    if name is None:
        if len(config.upstream) != 1:
            raise _Failed("the config has several upstreams: name one with --upstream")
        return config.upstream[0]
    for upstream in config.upstream:
        if upstream.name == name:
            return upstream
    raise _Failed(f"the config has no upstream named {name!r}")


def _find(args: argparse.Namespace, target: _Target) -> _Found:
    """The geometry, model name and context, each from the best source available."""
    upstream = target.upstream
    if upstream is not None and upstream.adapter in (AdapterName.LLAMACPP, AdapterName.OLLAMA):
        with _client(upstream) as client:
            if upstream.adapter is AdapterName.LLAMACPP:
                return _from_llamacpp(args, upstream, client)
            return _from_ollama(args, upstream, client)
    if args.gguf is None:
        adapter = upstream.adapter.value if upstream is not None else "?"
        raise _Failed(f"a {adapter} upstream cannot tell a model's geometry; give --gguf PATH")
    return _from_file(args)


def _from_file(args: argparse.Namespace, why: str = "") -> _Found:
    context, context_source = _default_context(args, why)
    return _Found(
        _read_gguf(args.gguf),
        f"GGUF header of {args.gguf}",
        args.model or _stem(args.gguf),
        context,
        _first(args.parallel, 1),
        context_source,
    )


def _read_gguf(path: str) -> Geometry:
    # Imported here: the reader pulls in numpy, which no other command needs.
    from vacancyd.footprint.gguf_reader import GGUFError, read_geometry

    try:
        return read_geometry(path)
    except GGUFError as exc:
        raise _Failed(str(exc)) from exc


def _first(*values: int | None) -> int:
    """The first value given (0 included, to be refused later), as `or` would not."""
    return next(v for v in values if v is not None)


def _stem(path: str) -> str:
    return Path(path).name.removesuffix(".gguf")


def _client(upstream: UpstreamConfig) -> httpx.Client:
    from vacancyd.auth import read_token_file

    headers = {}
    if upstream.credential_file:
        where = f"upstream {upstream.name!r} credential_file"
        token = read_token_file(upstream.credential_file, where, "credential file")
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(trust_env=False, timeout=HTTP_TIMEOUT_S, headers=headers)


def _from_llamacpp(
    args: argparse.Namespace, upstream: UpstreamConfig, client: httpx.Client
) -> _Found:
    from vacancyd.footprint.sources import SourceError, llamacpp_props

    try:
        props = llamacpp_props(client, upstream.target)
    except SourceError as exc:
        if args.gguf is None:
            raise _Failed(str(exc)) from exc
        return _from_file(args, f"the server did not answer: {exc}")
    path = args.gguf or props.model_path
    if path is None:
        raise _Failed(f"{upstream.target}/props names no model_path; give --gguf PATH")
    if not Path(path).is_file():
        raise _Failed(f"llama-server's model file {path} is not on this machine; give --gguf PATH")
    model = args.model or props.model_alias or _stem(path)
    parallel = _first(args.parallel, props.total_slots, 1)
    if args.context is not None:
        context, source = args.context, "--context"
    elif props.slot_context is not None:
        slots = props.total_slots or 1
        context = props.slot_context * slots
        source = (
            f"llama-server /props: {props.slot_context} per slot x {slots} slot(s); "
            "with a unified KV cache (-kvu) the server holds less: give --context"
        )
    else:
        context, source = _default_context(args, "/props has no n_ctx")
    where = "--gguf" if args.gguf else "llama-server /props model_path"
    return _Found(
        _read_gguf(path), f"GGUF header of {path} ({where})", model, context, parallel, source
    )


def _from_ollama(
    args: argparse.Namespace, upstream: UpstreamConfig, client: httpx.Client
) -> _Found:
    from vacancyd.footprint.geometry import geometry_from_ollama_model_info
    from vacancyd.footprint.sources import SourceError, ollama_model

    if args.model is None:
        raise _Failed("an ollama upstream needs --model")
    parallel = _first(args.parallel, 1)
    if args.gguf is not None:
        geometry, geometry_source = _read_gguf(args.gguf), f"GGUF header of {args.gguf}"
        num_ctx = None
    else:
        try:
            found = ollama_model(client, upstream.target, args.model)
        except SourceError as exc:
            raise _Failed(str(exc)) from exc
        geometry = geometry_from_ollama_model_info(found.model_info, found.size_bytes)
        geometry_source = f"Ollama /api/show model_info for {args.model}"
        num_ctx = found.num_ctx
    if args.context is not None:
        context, source = args.context, "--context"
    elif num_ctx is not None:
        context, source = num_ctx * parallel, f"Modelfile num_ctx {num_ctx} x {parallel} slot(s)"
    else:
        context = DEFAULT_CONTEXT * parallel
        source = (
            f"Ollama's default num_ctx {DEFAULT_CONTEXT} x {parallel} slot(s); servers from "
            "v0.15.5 pick a larger default by VRAM unless OLLAMA_CONTEXT_LENGTH is set: "
            "give --context"
        )
    return _Found(geometry, geometry_source, args.model, context, parallel, source)


def _default_context(args: argparse.Namespace, why: str = "") -> tuple[int, str]:
    if args.context is not None:
        return args.context, "--context"
    suffix = f"; {why}" if why else ""
    return DEFAULT_CONTEXT, f"default {DEFAULT_CONTEXT} tokens (give --context N){suffix}"


def _learned(target: _Target, model: str) -> tuple[dict[str, int], str]:
    """What the state dir's footprints file learned for this model, and where it was read."""
    if target.config is None or target.upstream is None:
        return {}, "not read (no --config, so no state directory)"
    problems = StateFileProblems()
    store = LearnedFootprints(resolve_state_dir(target.config), problems)
    store.load()
    for problem in problems.problems:
        return {}, f"{problem.path} cannot be used: {problem.reason}"
    learned = store.get(target.upstream.name, model)
    return learned, f"from {store.path}" if learned else f"none recorded in {store.path}"


def _need(target: _Target, result: FootprintEstimate, learned: dict[str, int]) -> dict[str, int]:
    """The need to configure: the larger of estimate and learned on the sized resource,
    learned values on the others, and the upstream's defaults for resources neither covers
    (a model's `need_mib` replaces `default_need_mib` entirely)."""
    need = dict(target.upstream.default_need_mib) if target.upstream is not None else {}
    need.update(learned)
    need[target.resource] = max(result.total_mib, learned.get(target.resource, 0))
    return need


def toml_snippet(upstream: str | None, model: str, need: dict[str, int]) -> str:
    """The config lines for one model's footprint, in the schema of `[[upstream]]`."""
    table = ", ".join(f"{_toml_key(name)} = {mib}" for name, mib in need.items())
    where = f'the [[upstream]] named "{upstream}"' if upstream else "its [[upstream]]"
    return (
        f"# Paste after the keys of {where}, before the next [[...]] table.\n"
        f"[upstream.models.{_toml_string(model)}]\n"
        f"need_mib = {{ {table} }}"
    )


def _toml_key(name: str) -> str:
    bare = name and all(c.isascii() and (c.isalnum() or c in "-_") for c in name)
    return name if bare else _toml_string(name)


def _toml_string(text: str) -> str:
    # A TOML basic string accepts JSON's escapes (\" \\ \n \uXXXX ...).
    return json.dumps(text, ensure_ascii=False)


def _report(
    target: _Target,
    found: _Found,
    result: FootprintEstimate,
    learned: dict[str, int],
    learned_note: str,
    need: dict[str, int],
) -> str:
    upstream = target.upstream
    about = (
        f"upstream {upstream.name} ({upstream.adapter.value}), resource {target.resource}"
        if upstream is not None
        else f"resource {target.resource} ({target.kind.value})"
    )
    learned_text = ", ".join(f"{k} = {v} MiB" for k, v in learned.items())
    lines = [
        f"model: {found.model} · {about}",
        f"geometry: {found.geometry_source}",
        f"context: {found.context} tokens, {found.parallel} slot(s) · {found.context_source}",
        result.explain(),
        f"learned: {learned_text + ' · ' if learned else ''}{learned_note}",
        "",
        toml_snippet(upstream.name if upstream else None, found.model, need),
    ]
    return "\n".join(lines)


def _document(
    target: _Target,
    found: _Found,
    result: FootprintEstimate,
    learned: dict[str, int],
    learned_note: str,
    need: dict[str, int],
) -> dict[str, Any]:
    upstream = target.upstream
    return {
        "model": found.model,
        "upstream": upstream.name if upstream else None,
        "resource": target.resource,
        "geometry_source": found.geometry_source,
        "context_source": found.context_source,
        "estimate": result.as_dict(),
        "learned_mib": learned,
        "learned_source": learned_note,
        "need_mib": need,
        "toml": toml_snippet(upstream.name if upstream else None, found.model, need),
    }

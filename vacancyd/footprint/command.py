"""`vacancyd footprint`: a model's estimated memory, what was learned, and a config snippet.

The geometry comes from a GGUF file (`--gguf`), or from the running server of an upstream
(`--config FILE --upstream NAME --model M`), read exactly as admission reads it
(served.py: the upstream's credential, the context, slots and KV cache type the server
runs, the runtime base of the resource sized). Options override what the server says.
The output says which source each number came from, what admission charges the model
now (admission/need.py: configured, else learned or estimated, with `default_need_mib` as
a floor), and a TOML snippet in the config's own schema
(`[upstream.models."M"] need_mib = {...}`) that `vacancyd check-config` accepts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs

from vacancyd.admission.need import need_for
from vacancyd.config import Config, UpstreamConfig, load_config, resolve_state_dir
from vacancyd.errors import ConfigError, StartupError
from vacancyd.footprint.book import hint_from
from vacancyd.footprint.estimate import (
    CACHE_TYPE_BYTES,
    DEFAULT_MARGIN_PCT,
    FootprintEstimate,
)
from vacancyd.footprint.geometry import GeometryError
from vacancyd.footprint.gguf_reader import GGUFError
from vacancyd.footprint.learned import LearnedFootprints
from vacancyd.footprint.processes import FindServer
from vacancyd.footprint.served import (
    ASSUMED_CACHE_TYPE,
    DEFAULT_CONTEXT,
    Overrides,
    Served,
    Unsizable,
    can_size,
    describe,
    read_gguf,
    read_served,
    size_served,
    upstream_client,
)
from vacancyd.footprint.sources import SourceError
from vacancyd.model import ModelNeed, ResourceKind
from vacancyd.persist import StateFileProblems

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
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
        "--cache-type",
        choices=sorted(CACHE_TYPE_BYTES),
        help="KV cache type (default: what the server says it runs, else f16)",
    )
    parser.add_argument(
        "--kv-unified", action="store_true", help="the server shares one KV cache among slots"
    )
    parser.add_argument(
        "--margin-pct", type=float, default=DEFAULT_MARGIN_PCT, metavar="P", help="margin, %%"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


@attrs.frozen
class _Target:
    config: Config | None
    upstream: UpstreamConfig | None
    resource: str
    kind: ResourceKind


def run(args: argparse.Namespace, find_server: FindServer | None = None) -> int:
    """Run the command; returns the exit status (2 for a config problem). `find_server`
    finds the processes listening for a target (the collectors' attribution): Ollama's
    settings are read from its server's environment."""
    try:
        target = _target(args)
        found = _find(args, target, find_server)
        if found.context < 1 or found.parallel < 1:
            raise _Failed("--context and --parallel must be at least 1")
        result = size_served(found, target.kind, args.margin_pct)
    except ConfigError as exc:
        print(f"{args.config}: {len(exc.messages)} problem(s):", file=sys.stderr)
        for message in exc.messages:
            print(f"  {message}", file=sys.stderr)
        return EXIT_CONFIG
    except (
        _Failed,
        Unsizable,
        GGUFError,
        GeometryError,
        StartupError,
        ValueError,
        OSError,
    ) as exc:
        print(f"vacancyd footprint: {exc}", file=sys.stderr)
        return EXIT_FAILED
    learned, learned_note = _learned(target, found.model)
    charge = _charge(target, found, result, learned)
    if args.json:
        print(json.dumps(_document(target, found, result, learned, learned_note, charge), indent=2))
    else:
        print(_report(target, found, result, learned, learned_note, charge))
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
    if resource not in upstream.resources:
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


def _overrides(args: argparse.Namespace) -> Overrides:
    return Overrides(
        gguf=args.gguf,
        model=args.model,
        context=args.context,
        parallel=args.parallel,
        cache_type=args.cache_type,
        unified_kv=args.kv_unified,
    )


def _find(args: argparse.Namespace, target: _Target, find_server: FindServer | None) -> Served:
    """The model as its server runs it (as admission reads it), else from --gguf."""
    upstream = target.upstream
    if upstream is not None and can_size(upstream):
        if upstream.adapter.value == "ollama" and args.model is None:
            raise _Failed("an ollama upstream needs --model")
        try:
            with upstream_client(_credential(upstream), HTTP_TIMEOUT_S) as client:
                return read_served(
                    upstream,
                    args.model,
                    client,
                    overrides=_overrides(args),
                    find_server=find_server,
                )
        except SourceError as exc:
            if args.gguf is None or upstream.adapter.value == "ollama":
                raise _Failed(str(exc)) from exc
            return _from_file(args, f"the server did not answer: {exc}")
        except Unsizable as exc:
            raise _Failed(f"{exc}; give --gguf PATH") from exc
    if args.gguf is None:
        adapter = upstream.adapter.value if upstream is not None else "?"
        raise _Failed(f"a {adapter} upstream cannot tell a model's geometry; give --gguf PATH")
    return _from_file(args)


def _from_file(args: argparse.Namespace, why: str = "") -> Served:
    if args.context is not None:
        context, context_source = args.context, "--context"
    else:
        suffix = f"; {why}" if why else ""
        context = DEFAULT_CONTEXT
        context_source = f"default {DEFAULT_CONTEXT} tokens (give --context N){suffix}"
    if args.cache_type is not None:
        cache_type, cache_source = args.cache_type, "--cache-type"
    else:
        cache_type = ASSUMED_CACHE_TYPE
        cache_source = f"{ASSUMED_CACHE_TYPE} assumed: no server to ask; give --cache-type"
    return Served(
        model=args.model or Path(args.gguf).name.removesuffix(".gguf"),
        geometry=read_gguf(args.gguf),
        geometry_source=f"GGUF header of {args.gguf}",
        context=context,
        parallel=args.parallel if args.parallel is not None else 1,
        context_source=context_source,
        cache_type=cache_type,
        cache_type_source=cache_source,
        unified_kv=args.kv_unified,
        identity=("file", args.gguf),
    )


def _credential(upstream: UpstreamConfig) -> str | None:
    from vacancyd.auth import read_token_file

    if not upstream.credential_file:
        return None
    where = f"upstream {upstream.name!r} credential_file"
    return read_token_file(upstream.credential_file, where, "credential file")


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


@attrs.frozen
class _Charge:
    """What admission charges the model now, and the table to configure."""

    charged: ModelNeed | None
    snippet: dict[str, int]
    note: str


def _charge(
    target: _Target, found: Served, result: FootprintEstimate, learned: dict[str, int]
) -> _Charge:
    """The charge by admission's own rule (admission/need.py) from the same hint the
    daemon's book would give: learned per resource, the estimate on the sized resource
    where nothing was learned, `default_need_mib` as a floor. The snippet is that charge
    as the model's own table (a model's `need_mib` replaces `default_need_mib` entirely,
    so the floors are written into it)."""
    estimated = (target.resource, result.total_mib, describe(found, result))
    hint = hint_from(learned, estimated)
    if target.config is None or target.upstream is None:
        table = dict(hint.need_mib) if hint is not None else {}
        return _Charge(None, table, "")
    upstream = target.upstream
    resources = {resource.name: resource for resource in target.config.resource}
    unlisted = attrs.evolve(upstream, models={})
    snippet = need_for(unlisted, resources, found.model, hint)
    charged = need_for(upstream, resources, found.model, hint)
    note = ""
    if target.resource != upstream.resource:
        note = (
            f"admission itself estimates only {upstream.resource}; {target.resource} is "
            "sized here as asked"
        )
    return _Charge(charged, dict(snippet.need_mib), note)


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
    found: Served,
    result: FootprintEstimate,
    learned: dict[str, int],
    learned_note: str,
    charge: _Charge,
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
        f"cache type: {found.cache_type} · {found.cache_type_source}",
        result.explain(),
        f"learned: {learned_text + ' · ' if learned else ''}{learned_note}",
    ]
    if charge.charged is not None:
        charged = ", ".join(
            f"{name} = {mib} MiB ({charge.charged.sources.get(name, charge.charged.source)})"
            for name, mib in charge.charged.need_mib.items()
        )
        note = f" · {charge.note}" if charge.note else ""
        lines.append(f"admission charges a load: {charged or 'nothing'}{note}")
    lines += ["", toml_snippet(upstream.name if upstream else None, found.model, charge.snippet)]
    return "\n".join(lines)


def _document(
    target: _Target,
    found: Served,
    result: FootprintEstimate,
    learned: dict[str, int],
    learned_note: str,
    charge: _Charge,
) -> dict[str, Any]:
    upstream = target.upstream
    charged = charge.charged
    return {
        "model": found.model,
        "upstream": upstream.name if upstream else None,
        "resource": target.resource,
        "geometry_source": found.geometry_source,
        "context_source": found.context_source,
        "cache_type": found.cache_type,
        "cache_type_source": found.cache_type_source,
        "estimate": result.as_dict(),
        "learned_mib": learned,
        "learned_source": learned_note,
        # What admission charges a load of this model now, as the vacancy probe reports
        # it (null without --config); and the table the snippet configures.
        "charged_mib": charged.need_mib if charged is not None else None,
        "charged_sources": charged.sources if charged is not None else None,
        "charge_note": charge.note or None,
        "need_mib": charge.snippet,
        "toml": toml_snippet(upstream.name if upstream else None, found.model, charge.snippet),
    }

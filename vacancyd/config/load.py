"""Load TOML into the frozen schema, strictly, reporting every problem with its key path.

The strict converter (strict.py) refuses what cattrs' defaults would quietly accept;
structural errors, range errors and cross-field errors are collected into one
ConfigError so the operator fixes the file in one pass.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from vacancyd.accounting import RESERVED_BORROWERS
from vacancyd.config.addresses import HostPort, is_loopback_host, parse_listen
from vacancyd.config.hours import lending_hours_problems
from vacancyd.config.schema import Config, ResourceConfig, Scope, UpstreamConfig
from vacancyd.config.strict import StrictProblems, structure
from vacancyd.errors import ConfigError
from vacancyd.model import ResourceKind

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
# An origin as a browser sends it: scheme, host and optional port, nothing after them.
_ORIGIN = re.compile(r"^https?://(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(:[0-9]{1,5})?$", re.IGNORECASE)


def default_config_text() -> str:
    return resources.files("vacancyd.config").joinpath("default.toml").read_text("utf-8")


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Load a file, or the embedded loopback-only default when no path is given."""
    if path is None:
        return parse_config(default_config_text(), source="<embedded default>")
    try:
        text = Path(path).read_text("utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text: {exc}"]) from exc
    except MemoryError as exc:
        raise ConfigError([f"{path}: too large to read (out of memory)"]) from exc
    return parse_config(text, source=str(path))


def parse_config(text: str, *, source: str = "<config>") -> Config:
    """Parse, structure and check a config; every failure is a ConfigError, never a crash.

    Whatever the file holds, the caller gets problem lines: a parser or converter that
    runs out of stack (TOML nested thousands deep), out of memory, or fails in a way the
    schema did not foresee is reported as a problem with the file, not a traceback.
    """
    try:
        config, problems = _parse(text, source)
    except ConfigError:
        raise
    except RecursionError as exc:
        raise ConfigError(
            [f"{source}: nested too deeply to read (over the parser's recursion limit)"]
        ) from exc
    except MemoryError as exc:
        raise ConfigError([f"{source}: too large to read (out of memory)"]) from exc
    except Exception as exc:
        # Shortened: an exception may quote the input, and a problem is one line.
        why = f"{type(exc).__name__}: {exc}"[:200]
        raise ConfigError([f"{source}: cannot be read: {why}"]) from exc
    if problems:
        raise ConfigError(problems)
    return config


def _parse(text: str, source: str) -> tuple[Config, list[str]]:
    """TOML to the schema, then the value and cross-field problems of the result."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: TOML syntax error: {exc}"]) from exc
    try:
        config = structure(raw, Config)
    except StrictProblems as exc:
        raise ConfigError(exc.problems) from exc
    return config, list(_range_problems(config, "")) + list(_cross_field_problems(config))


def _range_problems(value: Any, path: str) -> Iterator[str]:
    """Walk the tree checking `ge`/`gt` metadata, so range errors carry key paths too."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            yield from _range_problems(item, f"{path}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _range_problems(item, f'{path}."{key}"' if path else f'"{key}"')
        return
    if not attrs.has(type(value)):
        return
    for field in attrs.fields(type(value)):
        item = getattr(value, field.name)
        where = f"{path}.{field.name}" if path else field.name
        if isinstance(item, int | float) and not isinstance(item, bool):
            if "ge" in field.metadata and item < field.metadata["ge"]:
                yield f"{where}: must be at least {field.metadata['ge']:g}, got {item}"
            if "gt" in field.metadata and item <= field.metadata["gt"]:
                yield f"{where}: must be greater than {field.metadata['gt']:g}, got {item}"
        else:
            yield from _range_problems(item, where)


def _cross_field_problems(config: Config) -> Iterator[str]:
    resources_by_name: dict[str, ResourceConfig] = {}
    for index, resource in enumerate(config.resource):
        where = f"resource[{index}]"
        if resource.name in resources_by_name:
            yield f"{where}.name: resource {resource.name!r} is declared twice"
        resources_by_name[resource.name] = resource
        yield from _resource_problems(resource, where)

    yield from lending_hours_problems(config.owner)

    listeners: dict[HostPort, str] = {}
    api = _listen_or_problem(config.server.api_listen, "server.api_listen", listeners)
    if isinstance(api, str):
        yield api
    elif not api.is_loopback and not _has_scope(config, Scope.READ, Scope.ADMIN):
        yield from _open_remote_problem(
            config, "server.api_listen", "no token has the read or admin scope"
        )

    upstream_names: set[str] = set()
    for index, upstream in enumerate(config.upstream):
        where = f"upstream[{index}]"
        if upstream.name in upstream_names:
            yield f"{where}.name: upstream {upstream.name!r} is declared twice"
        upstream_names.add(upstream.name)
        bound = _listen_or_problem(upstream.listen, f"{where}.listen", listeners)
        if isinstance(bound, str):
            yield bound
        elif not bound.is_loopback and not _has_scope(config, Scope.BORROW):
            yield from _open_remote_problem(
                config, f"{where}.listen", "no token has the borrow scope"
            )
        yield from _upstream_problems(upstream, where, resources_by_name)

    for index, token in enumerate(config.auth.tokens):
        yield from _token_problems(token.sha256, token.file, token.scopes, f"auth.tokens[{index}]")
        if token.name in RESERVED_BORROWERS:
            # Accounting would count this token's borrowers together with those callers.
            yield (
                f"auth.tokens[{index}].name: {token.name!r} is reserved for callers without a "
                f"token of their own ({', '.join(sorted(RESERVED_BORROWERS))}); choose another"
            )


def _resource_problems(resource: ResourceConfig, where: str) -> Iterator[str]:
    if resource.kind is ResourceKind.NVIDIA_GPU:
        if resource.device is None:
            yield f"{where}.device: required for an nvidia_gpu (an index, PCI bus id or UUID)"
    else:
        if resource.device is not None:
            yield f"{where}.device: only an nvidia_gpu resource names a device"
        if resource.pressure is not None:
            yield f"{where}.pressure: pressure is attributed for nvidia_gpu resources only"
    if resource.kind is ResourceKind.CPU and resource.keep_free_mib:
        yield f"{where}.keep_free_mib: a cpu resource has no byte capacity"
    if resource.kind is ResourceKind.MEMORY and resource.max_utilization_pct is not None:
        yield f"{where}.max_utilization_pct: memory has no utilisation; use keep_free_mib"
    if resource.max_utilization_pct is not None and resource.max_utilization_pct > 100:
        yield f"{where}.max_utilization_pct: must be at most 100"
    pressure = resource.pressure
    threshold = pressure.threshold_pct if pressure is not None else None
    if pressure is not None and threshold is not None and threshold > pressure.cap_pct:
        yield f"{where}.pressure.threshold_pct: must not exceed cap_pct ({pressure.cap_pct:g})"
    yield from _heat_problems(resource, where)


def _heat_problems(resource: ResourceConfig, where: str) -> Iterator[str]:
    """A heat guard needs a GPU and a limit; its release point must stay above 0 °C."""
    limit = resource.max_temperature_c
    if limit is not None and resource.kind is not ResourceKind.NVIDIA_GPU:
        yield f"{where}.max_temperature_c: only an nvidia_gpu reports a temperature"
    if resource.heat is None:
        return
    if resource.kind is not ResourceKind.NVIDIA_GPU:
        yield f"{where}.heat: the heat guard is for nvidia_gpu resources only"
    elif limit is None:
        yield f"{where}.heat: has no effect without max_temperature_c"
    elif resource.heat.release_margin_c >= limit:
        yield f"{where}.heat.release_margin_c: must be less than max_temperature_c ({limit:g})"


def _upstream_problems(
    upstream: UpstreamConfig, where: str, known: dict[str, ResourceConfig]
) -> Iterator[str]:
    try:
        upstream.endpoint  # noqa: B018 - parsed here, once, and kept for every reader
    except ValueError as exc:
        yield f"{where}.target: {exc}"
    if upstream.resource not in known:
        yield f"{where}.resource: unknown resource {upstream.resource!r}"
    seen = {upstream.resource}
    for position, name in enumerate(upstream.also_requires):
        if name not in known:
            yield f"{where}.also_requires[{position}]: unknown resource {name!r}"
        elif name in seen:
            yield f"{where}.also_requires[{position}]: resource {name!r} is listed twice"
        seen.add(name)
    for position, origin in enumerate(upstream.cors_allow_origins):
        problem = _origin_problem(origin)
        if problem:
            yield f"{where}.cors_allow_origins[{position}]: {problem}"
    footprints = {"default_need_mib": upstream.default_need_mib}
    footprints.update({f'models."{m}".need_mib': c.need_mib for m, c in upstream.models.items()})
    for key, table in footprints.items():
        for resource_name, mib in table.items():
            if resource_name not in seen:
                yield (
                    f'{where}.{key}."{resource_name}": not one of this upstream\'s resources '
                    f"({', '.join(sorted(seen))})"
                )
            elif not known[resource_name].kind.has_bytes:
                yield f'{where}.{key}."{resource_name}": a cpu resource has no MiB to charge'
            if mib < 0:
                yield f'{where}.{key}."{resource_name}": must be at least 0, got {mib}'


def _origin_problem(origin: str) -> str:
    """Why a `cors_allow_origins` entry is not one origin a browser could send, if so."""
    if origin.strip() in ("*", "null"):
        return (
            f"{origin.strip()!r} is not allowed: it would let pages of any site (or sandboxed "
            "pages) use this server from a visitor's browser; list each origin"
        )
    if _ORIGIN.match(origin):
        return ""
    if re.match(r"^https?://[^/]+/", origin, re.IGNORECASE):
        return f"{origin!r} is not an origin: write it without a path, e.g. 'https://app.example'"
    return f"{origin!r} is not an origin: expected 'http(s)://host' or 'http(s)://host:port'"


def _token_problems(
    digest: str | None, file: str | None, scopes: list[Scope], where: str
) -> Iterator[str]:
    if (digest is None) == (file is None):
        yield f"{where}: give exactly one of sha256 or file"
    if digest is not None and not _SHA256_HEX.match(digest):
        yield f"{where}.sha256: must be 64 lowercase hex digits (sha256 of the token)"
    if not scopes:
        yield f"{where}.scopes: at least one of borrow, read, admin"


def _listen_or_problem(text: str, where: str, seen: dict[HostPort, str]) -> HostPort | str:
    try:
        address = parse_listen(text)
    except ValueError as exc:
        return f"{where}: {exc}"
    if address.port != 0:
        for other, other_where in seen.items():
            if _same_socket(address, other):
                return f"{where}: {address} is already used by {other_where}"
        seen[address] = where
    return address


_WILDCARDS = {"0.0.0.0", "::"}


def _same_socket(a: HostPort, b: HostPort) -> bool:
    """Whether two listen addresses would collide when bound (ports 0 never do)."""
    if a.port != b.port:
        return False
    hosts = {_canonical_host(a.host), _canonical_host(b.host)}
    return len(hosts) == 1 or bool(hosts & _WILDCARDS)


def _canonical_host(host: str) -> str:
    return "127.0.0.1" if host == "localhost" else host


def _open_remote_problem(config: Config, where: str, missing: str) -> Iterator[str]:
    if not config.auth.allow_unauthenticated_remote:
        yield (
            f"{where}: listens beyond loopback but {missing}; add [[auth.tokens]] "
            "or set auth.allow_unauthenticated_remote = true"
        )


def _has_scope(config: Config, *scopes: Scope) -> bool:
    return any(scope in token.scopes for token in config.auth.tokens for scope in scopes)


def resolve_state_dir(config: Config) -> Path:
    """The configured state directory, or the platform default when it is left empty.

    Under systemd the default is the unit's StateDirectory= (systemd passes it as
    $STATE_DIRECTORY, colon-separated when there are several): the service user's home
    may not exist, and that directory is the one it is allowed to write.
    """
    if config.server.state_dir:
        return Path(config.server.state_dir).expanduser()
    given = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if given and Path(given).is_absolute():
        return Path(given)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return Path("/var/lib/vacancyd")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "vacancyd"


__all__ = [
    "default_config_text",
    "is_loopback_host",
    "load_config",
    "parse_config",
    "resolve_state_dir",
]

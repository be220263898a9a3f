"""Listen addresses and upstream targets, parsed once so every module agrees on them."""

from __future__ import annotations

import functools
import ipaddress
import urllib.parse

import attrs


@attrs.frozen
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)


@functools.lru_cache(maxsize=256)  # asked of every proxied request's peer address
def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and the name localhost; wildcards are not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_listen(text: str) -> HostPort:
    """Parse "127.0.0.1:8081" or "[::1]:8081"; a port is required (0 picks a free one)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected host:port, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"port must be a number from 0 to 65535, got {port_text!r}")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"listen host must be an IP address or localhost, got {host!r}"
            ) from None
    return HostPort(host, int(port_text))


@attrs.frozen
class Target:
    """An upstream base URL. Only plain http: the upstream is meant to sit on this host."""

    scheme: str
    host: str
    port: int
    base_path: str

    @property
    def origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_target(text: str) -> Target:
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"target must be an http:// or https:// URL, got {text!r}")
    if not parts.hostname:
        raise ValueError(f"target has no host: {text!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"target must not carry a query, fragment or credentials: {text!r}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"target port is invalid: {text!r}") from exc
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return Target(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

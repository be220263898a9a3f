"""Scoped bearer tokens, shared by the proxies (borrow) and the API (read, admin).

Tokens are never kept in the config in clear: a config entry holds either the token's
sha256 or the path of a private file holding it. Comparison is constant-time on digests,
so neither the token nor its length leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections import Counter
from pathlib import Path
from typing import Any

import attrs

from vacancyd.config import AuthConfig, Scope, is_loopback_host
from vacancyd.errors import StartupError


@attrs.frozen
class AuthResult:
    allowed: bool
    status: int = 200
    code: str = ""
    message: str = ""
    token_name: str = ""


@attrs.frozen
class _Known:
    name: str
    digest: bytes
    scopes: frozenset[Scope]


def read_token_file(path: str) -> str:
    """Read a token file, refusing one that other users could read."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        text = file.read_text("utf-8").strip()
    except OSError as exc:
        raise StartupError(f"token file {path}: {exc.strerror or exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StartupError(f"token file {path} is readable by other users; chmod 600 it")
    if not text:
        raise StartupError(f"token file {path} is empty")
    return text


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self._trust_loopback = config.trust_loopback
        self._open_remote = config.allow_unauthenticated_remote
        self._known: list[_Known] = []
        for token in config.tokens:
            if token.sha256 is not None:
                digest = bytes.fromhex(token.sha256)
            else:
                assert token.file is not None
                digest = hashlib.sha256(read_token_file(token.file).encode()).digest()
            self._known.append(_Known(token.name, digest, frozenset(token.scopes)))
        self.counts: Counter[tuple[str, str]] = Counter()

    def check_borrower(
        self, headers: list[tuple[bytes, bytes]], client: tuple[str, int] | list[Any] | None
    ) -> AuthResult:
        """The borrow-scope decision for a proxied request or WebSocket upgrade."""
        authorization = next((v for n, v in headers if n.lower() == b"authorization"), None)
        return self.check(
            authorization.decode("latin-1") if authorization else None,
            client[0] if client else None,
            Scope.BORROW,
        )

    def check(self, authorization: str | None, client_host: str | None, scope: Scope) -> AuthResult:
        result = self._decide(authorization, client_host, scope)
        self.counts[(scope.value, "allowed" if result.allowed else "denied")] += 1
        return result

    def _decide(
        self, authorization: str | None, client_host: str | None, scope: Scope
    ) -> AuthResult:
        match = self._match(authorization)
        if match is not None and scope in match.scopes:
            return AuthResult(True, token_name=match.name)
        # A trusted caller may carry a credential meant for the upstream (OpenAI SDKs always
        # send one); it is not ours to judge, so it does not turn trust into a denial.
        if self._trust_loopback and client_host is not None and is_loopback_host(client_host):
            return AuthResult(True, token_name="loopback")
        if not any(scope in known.scopes for known in self._known):
            # No token carries this scope, so there is nothing a caller could present. That
            # is open to callers on this machine, and to the network only where the operator
            # opted in with allow_unauthenticated_remote; a listener that shares its socket
            # with another scope (the API: read and admin) never opens the other by accident.
            local = client_host is not None and is_loopback_host(client_host)
            if local or self._open_remote:
                return AuthResult(True, token_name="anonymous")
        if match is not None:
            return AuthResult(
                False, 403, "forbidden", f"token {match.name!r} lacks the {scope.value} scope"
            )
        if authorization:
            return AuthResult(False, 401, "unauthorized", "unknown bearer token")
        return AuthResult(
            False, 401, "unauthorized", f"a bearer token with the {scope.value} scope is required"
        )

    def _match(self, authorization: str | None) -> _Known | None:
        if not authorization:
            return None
        kind, _, presented = authorization.partition(" ")
        if kind.lower() != "bearer" or not presented.strip():
            return None
        digest = hashlib.sha256(presented.strip().encode()).digest()
        match = None
        for known in self._known:  # compare with every token, so timing says nothing
            if hmac.compare_digest(digest, known.digest):
                match = known
        return match


def token_for_cli(config: AuthConfig, scope: Scope) -> str | None:
    """A token the CLI may present: from VACANCYD_TOKEN, else a readable token file."""
    from_env = os.environ.get("VACANCYD_TOKEN")
    if from_env:
        return from_env
    for token in config.tokens:
        if token.file is not None and scope in token.scopes:
            try:
                return read_token_file(token.file)
            except StartupError:
                continue
    return None

"""Scoped bearer tokens, shared by the proxies (borrow) and the API (read, admin).

Tokens are never kept in the config in clear: a config entry holds either the token's
sha256 or the path of a private file holding it. Comparison is constant-time on digests,
so neither the token nor its length leaks through timing.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from vacancyd.access import AuthResult
from vacancyd.accounting import ANONYMOUS, LOCAL
from vacancyd.config import AuthConfig, Scope, is_loopback_host
from vacancyd.errors import StartupError
from vacancyd.persist import UntrustedFile, daemon_uid, read_private_bytes

# A token or credential is a line of text; a larger file is not one, and is not read.
MAX_TOKEN_FILE_BYTES: Final = 64 * 1024


@attrs.frozen
class _Known:
    name: str
    digest: bytes
    scopes: frozenset[Scope]


def read_token_file(path: str, where: str, what: str = "token file") -> str:
    """Read a token (or an upstream credential) file that only a trusted user can change.

    The file is opened without following a symbolic link, must be a regular file owned by
    root or the daemon's own user, open to no group or other user, and small. `where` is
    the config key that names the file (`auth.tokens[0].file`), so every refusal reads
    like a config problem: the key path first, then what is wrong.
    """
    uid = daemon_uid()
    owners = {0} if uid is None else {0, uid}
    try:
        raw = read_private_bytes(Path(path), max_bytes=MAX_TOKEN_FILE_BYTES, owners=owners)
        text = raw.decode("utf-8").strip()
    except UntrustedFile as exc:
        raise StartupError(f"{where}: {what} {path} {exc.reason}") from exc
    except OSError as exc:
        raise StartupError(f"{where}: {what} {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise StartupError(f"{where}: {what} {path} is not UTF-8 text") from exc
    if not text:
        raise StartupError(f"{where}: {what} {path} is empty")
    return text


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self._trust_loopback = config.trust_loopback
        self._open_remote = config.allow_unauthenticated_remote
        self._known: list[_Known] = []
        for index, token in enumerate(config.tokens):
            if token.sha256 is not None:
                digest = bytes.fromhex(token.sha256)
            else:
                assert token.file is not None
                text = read_token_file(token.file, f"auth.tokens[{index}].file")
                digest = hashlib.sha256(text.encode()).digest()
            self._known.append(_Known(token.name, digest, frozenset(token.scopes)))
        self.counts: Counter[tuple[str, str]] = Counter()

    def check_borrower(
        self, headers: Sequence[tuple[bytes, bytes]], client: tuple[str, int] | list[Any] | None
    ) -> AuthResult:
        """The borrow-scope decision for a proxied request or WebSocket upgrade."""
        authorization = next((v for n, v in headers if n.lower() == b"authorization"), None)
        host = next((v for n, v in headers if n.lower() == b"host"), None)
        return self.check(
            authorization.decode("latin-1") if authorization else None,
            client[0] if client else None,
            Scope.BORROW,
            host.decode("latin-1") if host is not None else None,
        )

    def check(
        self,
        authorization: str | None,
        client_host: str | None,
        scope: Scope,
        host_header: str | None = None,
    ) -> AuthResult:
        """Decide one request. `host_header` guards loopback trust against DNS rebinding:
        a local caller that names a foreign host is a browser tricked into calling us."""
        local = (
            client_host is not None
            and is_loopback_host(client_host)
            and _names_this_machine(host_header)
        )
        result = self._decide(authorization, local, scope)
        self.counts[(scope.value, "allowed" if result.allowed else "denied")] += 1
        return result

    def check_any(
        self,
        authorization: str | None,
        client_host: str | None,
        scopes: tuple[Scope, ...],
        host_header: str | None = None,
    ) -> AuthResult:
        """Decide a request that any one of `scopes` may make (the vacancy probe: borrowers
        and readers alike). Counted once: under the scope that allowed it, else the first."""
        local = (
            client_host is not None
            and is_loopback_host(client_host)
            and _names_this_machine(host_header)
        )
        results = [(scope, self._decide(authorization, local, scope)) for scope in scopes]
        scope, result = next(((s, r) for s, r in results if r.allowed), results[0])
        if not result.allowed:
            names = " or ".join(s.value for s in scopes)
            message = result.message.replace(f"the {scope.value} scope", f"the {names} scope")
            result = attrs.evolve(result, message=message)
        self.counts[(scope.value, "allowed" if result.allowed else "denied")] += 1
        return result

    def _decide(self, authorization: str | None, local: bool, scope: Scope) -> AuthResult:
        match = self._match(authorization)
        if match is not None and scope in match.scopes:
            return AuthResult(True, token_name=match.name)
        # A trusted caller may carry a credential meant for the upstream (OpenAI SDKs always
        # send one); it is not ours to judge, so it does not turn trust into a denial.
        if self._trust_loopback and local:
            return AuthResult(True, token_name=LOCAL)
        # No token carries this scope, so there is nothing a caller could present. That is
        # open to callers on this machine, and to the network only where the operator opted
        # in with allow_unauthenticated_remote; a listener that shares its socket with
        # another scope (the API: read and admin) never opens the other by accident.
        unguarded = not any(scope in known.scopes for known in self._known)
        if unguarded and (local or self._open_remote):
            return AuthResult(True, token_name=ANONYMOUS)
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


@functools.lru_cache(maxsize=256)  # asked of every request's Host header; bounded
def _names_this_machine(host_header: str | None) -> bool:
    """Whether a Host header names a loopback address or an IP literal, not a DNS name.

    A page that rebinds its own name to 127.0.0.1 still sends that name as Host; the owner's
    tools call vacancyd by address or as localhost.
    """
    if host_header is None:
        return True  # HTTP/1.0 without Host: not a browser
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def token_for_cli(config: AuthConfig, scope: Scope) -> str | None:
    """A token the CLI may present: from VACANCYD_TOKEN, else a readable token file."""
    from_env = os.environ.get("VACANCYD_TOKEN")
    if from_env:
        return from_env
    for index, token in enumerate(config.tokens):
        if token.file is not None and scope in token.scopes:
            try:
                return read_token_file(token.file, f"auth.tokens[{index}].file")
            except StartupError:
                continue
    return None

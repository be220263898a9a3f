"""Opening a connection to an upstream: one way, for the HTTP relay and the WebSocket tunnel.

Both paths used to open their own: the relay's did TLS for an `https` target, the
tunnel's did not, and sent its handshake in plaintext to a TLS server (which failed closed,
as a misleading 502). Here both get the same connect deadline, the same TLS, and failures
named the same way (`ConnectError`, `ConnectTimeout`), which is how the callers tell "no
server there" from a server that answered badly.

TLS is verified against the system's CA store, which OpenSSL lets the service's
environment point elsewhere (`SSL_CERT_FILE`, `SSL_CERT_DIR`), plus certifi's bundle, the
one httpx used alone before: a home lab's own CA installed on the machine is trusted, and
so is every public CA httpx trusted.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl

import certifi
import trio

from vacancyd.config import Target
from vacancyd.errors import quiet_detail

# The failures that mean no connection was made at all.
CONNECT_FAILURES = frozenset({"ConnectError", "ConnectTimeout"})


class UpstreamError(Exception):
    """A request to the upstream failed; the message starts with the failure's name.

    `detail` is always words of vacancyd's or the operating system's, never bytes of a
    request or an answer (see proxy/pool.py)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def upstream_ssl_context() -> ssl.SSLContext:
    """Verification for `https` upstreams: the system's CAs (and the environment's, as
    OpenSSL reads it) and certifi's."""
    context = ssl.create_default_context()
    context.load_verify_locations(cafile=certifi.where())
    return context


class Connector:
    """Connections to one upstream, TLS included where its target says `https`."""

    def __init__(self, target: Target, connect_timeout_s: float) -> None:
        self._host = target.host
        self._port = target.port
        self._connect_timeout_s = connect_timeout_s
        self._ssl = upstream_ssl_context() if target.scheme == "https" else None
        self._family = _address_family(target.host)

    async def open(self) -> tuple[trio.abc.Stream, trio.socket.SocketType]:
        """A connected stream (TLS done) and its socket, within the connect deadline.

        Raises UpstreamError: `ConnectTimeout`, or `ConnectError` for a refused or failed
        connection and a failed TLS handshake alike (no server this request can use).
        """
        try:
            with trio.fail_after(self._connect_timeout_s):
                tcp = await self._open_tcp()
                if self._ssl is None:
                    return tcp, tcp.socket
                tls = trio.SSLStream(
                    tcp, self._ssl, server_hostname=self._host, https_compatible=True
                )
                try:
                    await tls.do_handshake()
                except BaseException:
                    tcp.socket.close()
                    raise
                return tls, tcp.socket
        except trio.TooSlowError:
            raise UpstreamError(
                "ConnectTimeout", f"no connection within {self._connect_timeout_s:g}s"
            ) from None
        except (OSError, trio.BrokenResourceError) as exc:
            raise UpstreamError("ConnectError", quiet_detail(exc)) from exc

    async def _open_tcp(self) -> trio.SocketStream:
        """A TCP connection; to an address (the usual target) a plain connect, which costs
        half of trio's general one (no name lookup, no happy-eyeballs race): servers such
        as llama-server close the connection after every streamed answer, so streamed
        requests connect each time."""
        if self._family is None:
            return await trio.open_tcp_stream(self._host, self._port)
        sock = trio.socket.socket(self._family, socket.SOCK_STREAM)
        try:
            await sock.connect((self._host, self._port))
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)  # sets TCP_NODELAY, as open_tcp_stream does


def _address_family(host: str) -> socket.AddressFamily | None:
    """AF_INET or AF_INET6 for an IP address, None for a name (to be looked up)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return socket.AF_INET6 if address.version == 6 else socket.AF_INET

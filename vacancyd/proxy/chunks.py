"""An upstream's chunked body, read without taking it apart and putting it back together.

Most streamed answers (every SSE stream of a model's tokens) come chunked, and the
borrower's connection sends them on chunked too. Relaying them through h11 on both sides
de-chunked each event into an h11 event on the upstream side and chunked it again on the
borrower's: about a quarter of the daemon's CPU per streamed event (docs/performance.md).
Here the body's bytes are scanned once, only to find where each chunk begins and ends,
where the body ends, and what the borrower has been sent of the payload so far; whole
chunks that arrived in one read are forwarded as the very bytes that came, and what did
not arrive whole is framed again as chunks of its own. So the borrower is only ever sent
whole chunks: a relay cut between two reads leaves the borrower's body at a chunk
boundary, where a last error frame and the end can follow (proxy/exchange.py).

The upstream's bytes are hostile input, held to h11's grammar for a chunked body (the
size in at most 20 hex digits, an optional extension, optional trailing whitespace, CRLF;
each chunk's data followed by exactly CRLF; a trailer section ended by an empty line)
and to bounds of its own: a chunk-size line of at most `MAX_SIZE_LINE` bytes and a
trailer section of at most `MAX_TRAILER` bytes. Extensions and trailers are dropped, as
h11 drops them. Bytes after the body's end are kept in `leftover`: a connection that has
any cannot carry another request (proxy/pool.py).
"""

from __future__ import annotations

import re

# The longest chunk-size line (size, extension, whitespace) accepted, CRLF excluded.
MAX_SIZE_LINE = 4096
# The longest trailer section accepted (LLM servers send none; each read rescans it).
MAX_TRAILER = 16 * 1024

# h11's chunk header: a size of 1 to 20 hex digits, an extension, trailing whitespace.
_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*")
# The end of a trailer section after at least one trailer line (h11 accepts a bare LF).
_TRAILER_END = re.compile(rb"\n\r?\n")

_HEADER, _DATA, _CRLF, _TRAILER, _ENDED = range(5)


class ChunkError(Exception):
    """The body is not a valid chunked body, or breaks a bound; the message quotes none
    of its bytes (they may be a borrower's output)."""


def framed(payload: bytes) -> bytes:
    """`payload` as one chunk."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class ChunkedBody:
    """One chunked body, fed its bytes as they arrive (`feed`); each feed's result is
    taken as framed chunks for a chunked connection (`take_framed`) or as the payload
    (`take_payload`)."""

    def __init__(self) -> None:
        self._state = _HEADER
        # Bytes of an unfinished size line, CRLF or trailer section, kept for the next feed.
        self._carry = b""
        # Data still owed by the chunk being read (state _DATA).
        self._remaining = 0
        self._framed: list[bytes] = []
        self._payload: list[bytes] = []
        # The last bytes (at most four) of all the payload fed so far.
        self.tail = b""
        self.leftover = b""

    @property
    def ended(self) -> bool:
        """Whether the body's last chunk and trailer section have arrived."""
        return self._state == _ENDED

    @property
    def pending(self) -> bool:
        """Whether payload fed so far is still to be taken."""
        return bool(self._payload)

    def take_framed(self) -> bytes:
        """The payload fed since the last take, as whole chunks (b"" if none)."""
        pieces = self._framed
        self._framed, self._payload = [], []
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    def take_payload(self) -> bytes:
        """The payload fed since the last take, without its framing (b"" if none)."""
        pieces = self._payload
        self._framed, self._payload = [], []
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    def feed(self, data: bytes) -> None:
        """Scan `data`, the next bytes of the body. Raises ChunkError on a broken body;
        bytes after its end go to `leftover`."""
        if self._carry:
            data, self._carry = self._carry + data, b""
        if self._state == _ENDED:
            self.leftover += data
            return
        size = len(data)
        position = 0
        # Where the current run of whole, plain chunks started: forwarded as they came.
        run = -1
        while position < size:
            state = self._state
            if state == _HEADER:
                end = data.find(b"\r\n", position, position + MAX_SIZE_LINE + 2)
                if end < 0:
                    if size - position > MAX_SIZE_LINE:
                        raise ChunkError("a chunk-size line is too long")
                    self._carry = data[position:]
                    break
                match = _SIZE_LINE.fullmatch(data, position, end)
                if match is None:
                    raise ChunkError("a chunk-size line is not valid")
                length = int(match[1], 16)
                start = end + 2
                if length == 0:
                    self._state = _TRAILER
                    position = start
                    if run >= 0:
                        self._run(data, run, match.start())
                        run = -1
                    continue
                stop = start + length
                if stop + 2 <= size:
                    if data[stop : stop + 2] != b"\r\n":
                        raise ChunkError("a chunk's data is not followed by CRLF")
                    if match.end(1) == end:
                        # A whole chunk with a plain size line: part of a run as it came.
                        if run < 0:
                            run = position
                        self._note(data[start:stop])
                    else:
                        if run >= 0:
                            self._run(data, run, position)
                            run = -1
                        self._own(data[start:stop])
                    position = stop + 2
                    continue
                if run >= 0:
                    self._run(data, run, position)
                    run = -1
                self._remaining = length
                self._state = _DATA
                position = start
            elif state == _DATA:
                take = min(self._remaining, size - position)
                self._own(data[position : position + take])
                self._remaining -= take
                position += take
                if self._remaining == 0:
                    self._state = _CRLF
            elif state == _CRLF:
                have = data[position : position + 2]
                if have != b"\r\n"[: len(have)]:
                    raise ChunkError("a chunk's data is not followed by CRLF")
                if len(have) < 2:
                    self._carry = have
                    break
                position += 2
                self._state = _HEADER
            else:  # _TRAILER
                position = self._trailer(data, position)
        if run >= 0:
            self._run(data, run, position)

    def _trailer(self, data: bytes, position: int) -> int:
        """Read the trailer section at `position`; returns where the scan goes on."""
        if data.startswith(b"\r\n", position) or data.startswith(b"\n", position):
            end = position + (2 if data[position] == 0x0D else 1)
        elif (found := _TRAILER_END.search(data, position)) is not None:
            end = found.end()
        else:
            if len(data) - position > MAX_TRAILER:
                raise ChunkError("the trailer section is too long")
            self._carry = data[position:]
            return len(data)
        if end - position > MAX_TRAILER:
            raise ChunkError("the trailer section is too long")
        self._state = _ENDED
        self.leftover = data[end:]
        return len(data)

    def _note(self, payload: bytes) -> None:
        """Payload that goes out inside a run of chunks as they came."""
        self._payload.append(payload)
        self._follow(payload)

    def _run(self, data: bytes, start: int, stop: int) -> None:
        """Whole chunks as they came: `data[start:stop]` (all of it, uncopied, if so)."""
        self._framed.append(data if start == 0 and stop == len(data) else data[start:stop])

    def _own(self, payload: bytes) -> None:
        """Payload framed here as a chunk of its own (a partial chunk, an extension)."""
        if payload:
            self._payload.append(payload)
            self._framed.append(framed(payload))
            self._follow(payload)

    def _follow(self, payload: bytes) -> None:
        """Keep the payload's last four bytes (`tail`) without copying all of it."""
        self.tail = payload[-4:] if len(payload) >= 4 else (self.tail + payload)[-4:]

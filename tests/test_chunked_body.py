"""The chunked-body scanner (vacancyd/proxy/chunks.py) against h11, the parser it stands in
for: the same bodies accepted with the same payload, the same ones refused, however the
bytes are split across reads; and what it forwards is always whole chunks, as they came
where they came whole."""

from __future__ import annotations

import itertools

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vacancyd.proxy.chunks import MAX_SIZE_LINE, MAX_TRAILER, ChunkedBody, ChunkError

HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def h11_payload(body: bytes) -> bytes | None:
    """The payload h11 reads from `body` as a chunked answer, None if it refuses it or
    finds no end."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(HEAD + body)
    payload = b""
    try:
        while True:
            event = client.next_event()
            if type(event) is h11.Data:
                payload += event.data
            elif type(event) is h11.EndOfMessage:
                return payload
            elif event is h11.NEED_DATA:
                return None
    except h11.RemoteProtocolError:
        return None


def scan(pieces: list[bytes]) -> tuple[ChunkedBody, list[bytes], list[bytes]]:
    """Feed `pieces` one read each; what each read gave, framed and as payload."""
    body = ChunkedBody()
    framed, payload = [], []
    for piece in pieces:
        body.feed(piece)
        if body.pending:
            framed.append(body.take_framed())
    body2 = ChunkedBody()
    for piece in pieces:
        body2.feed(piece)
        if body2.pending:
            payload.append(body2.take_payload())
    return body, framed, payload


def whole_chunks(data: bytes) -> bytes:
    """The payload of `data`, which must be whole chunks and nothing else."""
    payload = b""
    while data:
        line, _, data = data.partition(b"\r\n")
        size = int(line, 16)
        assert size > 0, "a forwarded piece never holds the last chunk"
        payload += data[:size]
        assert data[size : size + 2] == b"\r\n"
        data = data[size + 2 :]
    return payload


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


chunk_sizes = st.lists(st.integers(min_value=1, max_value=40), max_size=6)


@st.composite
def chunked_bodies(draw: st.DrawFn) -> bytes:
    """Valid chunked bodies: sizes in either case, with and without leading zeros,
    extensions and trailing whitespace; a trailer section or none."""
    body = b""
    for size in draw(chunk_sizes):
        digits = draw(st.sampled_from([b"%x", b"%X", b"00%x"])) % size
        ext = draw(st.sampled_from([b"", b";a=b", b';name="v"', b"  ", b"\t"]))
        data = draw(st.binary(min_size=size, max_size=size))
        body += digits + ext + b"\r\n" + data + b"\r\n"
    body += b"0\r\n"
    body += draw(st.sampled_from([b"\r\n", b"x-trailer: 1\r\n\r\n", b"a: b\r\nc: d\r\n\r\n"]))
    return body


@given(body=chunked_bodies(), cuts=st.lists(st.integers(min_value=0, max_value=400)))
@settings(max_examples=300, deadline=None)
def test_any_split_of_a_valid_body_reads_as_h11_reads_it(body: bytes, cuts: list[int]) -> None:
    pieces = split(body, cuts)
    scanner, framed, payload = scan(pieces)
    expected = h11_payload(body)
    assert expected is not None
    assert scanner.ended and scanner.leftover == b""
    assert b"".join(payload) == expected
    # Every forwarded piece is whole chunks on its own, and together they carry it all.
    assert b"".join(whole_chunks(piece) for piece in framed) == expected
    assert scanner.tail == expected[-4:]


def test_chunks_that_arrive_whole_and_plain_go_on_as_they_came() -> None:
    """A read of whole chunks with plain size lines is forwarded as the same bytes."""
    plain = b"".join(b"%x\r\n%s\r\n" % (n, b"x" * n) for n in (1, 17, 300))
    scanner, framed, _ = scan([plain])
    assert framed == [plain]
    assert framed[0] is plain  # not even copied
    assert not scanner.ended


def test_extensions_and_partial_chunks_are_framed_again() -> None:
    _, framed, _ = scan([b"5;ext=1\r\nhello\r\nA\r\nhel", b"lowor", b"ld\r\n3\r\nabc\r\n0\r\n\r\n"])
    assert framed == [b"5\r\nhello\r\n3\r\nhel\r\n", b"5\r\nlowor\r\n", b"2\r\nld\r\n3\r\nabc\r\n"]


def test_bytes_after_the_end_are_left_over_not_payload() -> None:
    scanner, _, payload = scan([b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n", b"more"])
    assert payload == [b"abc"]
    assert scanner.leftover == b"HTTP/1.1 200 OK\r\nmore"


BROKEN = {
    "not-hex": b"zz\r\nab\r\n",
    "sign": b"+3\r\nabc\r\n",
    "underscore": b"1_0\r\n" + b"x" * 16 + b"\r\n",
    "space-before": b" 3\r\nabc\r\n",
    "twenty-one-digits": b"0" * 20 + b"3\r\nabc\r\n",
    "bare-lf-size-line": b"3\nabc\r\n0\r\n\r\n",
    "no-crlf-after-data": b"3\r\nabcX\r\n",
    "lf-only-after-data": b"3\r\nabc\n0\r\n\r\n",
    "empty-size-line": b"\r\n",
    "newline-in-extension": b"3;a\nb\r\nabc\r\n",
    "space-before-extension": b"3 ;a=b\r\nabc\r\n",
}


@pytest.mark.parametrize("body", list(BROKEN.values()), ids=list(BROKEN))
@pytest.mark.parametrize("by_byte", [False, True], ids=["one-read", "byte-by-byte"])
def test_what_h11_refuses_is_refused(body: bytes, by_byte: bool) -> None:
    assert h11_payload(body + b"0\r\n\r\n") is None
    scanner = ChunkedBody()
    with pytest.raises(ChunkError) as caught:
        for piece in [body[i : i + 1] for i in range(len(body))] if by_byte else [body]:
            scanner.feed(piece)
        scanner.feed(b"0\r\n\r\n")
    assert "abc" not in str(caught.value)  # quotes none of the body


def test_a_size_line_or_trailer_past_its_bound_is_refused_however_it_arrives() -> None:
    for body in (b"3;" + b"e" * MAX_SIZE_LINE, b"0\r\nx: " + b"t" * MAX_TRAILER):
        scanner = ChunkedBody()
        with pytest.raises(ChunkError, match="too long"):
            for start in range(0, len(body) + 1024, 1024):
                scanner.feed(body[start : start + 1024])


def test_an_unfinished_body_has_not_ended() -> None:
    for piece in (b"3\r\nab", b"3\r\nabc\r", b"3\r\nabc\r\n0\r\nx: 1\r\n", b"3\r\nabc\r\n0\r\n"):
        scanner = ChunkedBody()
        scanner.feed(piece)
        assert not scanner.ended

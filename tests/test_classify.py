"""Route classification: every listed route, dot segments, and attempts to dress one route up
as another.

Classification is the proxy's only door: a path that classifies as PASS is forwarded with
no gate at all, and one that classifies as WORK is forwarded once admitted. So the tests
here care most about one direction of error: a management read (an owner's prompts, loaded
models, server settings) must never come out as PASS, RESULTS or WORK, however it is
spelled. Everything here is pure and synchronous.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vacancyd.adapters.base import Adapter, remove_dot_segments
from vacancyd.adapters.registry import adapter_for
from vacancyd.adapters.routes import Classification, RouteClass

ADAPTERS = ("openai", "llamacpp", "ollama")
FORWARDED = {RouteClass.PASS, RouteClass.RESULTS, RouteClass.WORK}
MODEL = "llama3:8b"


def classify(
    adapter: str, method: str, raw_path: bytes | str, query: bytes = b""
) -> Classification:
    raw = raw_path.encode("latin-1") if isinstance(raw_path, str) else raw_path
    return adapter_for(adapter).classify(method, raw, query)


def concrete(path: str) -> str:
    """A listed path with each "{name}" filled in by a real model name."""
    return re.sub(r"\{[a-z_]+\}", MODEL, path)


def listed(adapter: Adapter, method: str, route_class: RouteClass) -> set[str]:
    return {
        route.path
        for route in adapter.routes
        if method in route.methods and route.route_class is route_class
    }


# ---------------------------------------------------------------------------------------
# Every listed route classifies as listed.

LISTED = [
    pytest.param(name, method, route.path, route.route_class, id=f"{name}-{method}-{route.path}")
    for name in ADAPTERS
    for route in adapter_for(name).routes
    for method in sorted(route.methods)
]


@pytest.mark.parametrize(("adapter", "method", "path", "route_class"), LISTED)
def test_every_listed_route_classifies_as_listed(
    adapter: str, method: str, path: str, route_class: RouteClass
) -> None:
    got = classify(adapter, method, concrete(path))
    assert got.route_class is route_class
    assert got.path == concrete(path)
    assert got.route is not None
    assert got.route.path == path


# Pinned by hand, so that a table edit that moves a route to another class is caught even
# though the walk above reads the tables it checks.
PINNED = [
    ("openai", "POST", "/v1/chat/completions", RouteClass.WORK),
    ("openai", "POST", "/v1/embeddings", RouteClass.WORK),
    ("openai", "POST", "/v1/audio/transcriptions", RouteClass.WORK),
    ("openai", "GET", "/v1/models", RouteClass.PASS),
    ("openai", "HEAD", "/v1/models", RouteClass.PASS),
    ("openai", "GET", f"/v1/models/{MODEL}", RouteClass.PASS),
    ("openai", "GET", "/slots", RouteClass.UNKNOWN),
    ("openai", "GET", "/health", RouteClass.UNKNOWN),
    ("llamacpp", "GET", "/slots", RouteClass.MANAGEMENT),
    ("llamacpp", "HEAD", "/slots", RouteClass.MANAGEMENT),
    ("llamacpp", "GET", "/props", RouteClass.MANAGEMENT),
    ("llamacpp", "GET", "/metrics", RouteClass.MANAGEMENT),
    ("llamacpp", "GET", "/health", RouteClass.PASS),
    ("llamacpp", "GET", "/v1/health", RouteClass.PASS),
    ("llamacpp", "GET", "/v1/models", RouteClass.PASS),
    ("llamacpp", "POST", "/completion", RouteClass.WORK),
    ("llamacpp", "POST", "/v1/chat/completions", RouteClass.WORK),
    ("llamacpp", "POST", "/infill", RouteClass.WORK),
    ("ollama", "GET", "/api/ps", RouteClass.MANAGEMENT),
    ("ollama", "GET", "/api/tags", RouteClass.PASS),
    ("ollama", "GET", "/api/version", RouteClass.PASS),
    ("ollama", "GET", "/", RouteClass.PASS),
    ("ollama", "POST", "/api/show", RouteClass.PASS),
    ("ollama", "POST", "/api/chat", RouteClass.WORK),
    ("ollama", "POST", "/api/generate", RouteClass.WORK),
    ("ollama", "POST", "/v1/chat/completions", RouteClass.WORK),
    ("ollama", "GET", "/slots", RouteClass.UNKNOWN),
]


@pytest.mark.parametrize(
    ("adapter", "method", "path", "route_class"),
    [pytest.param(*row, id="-".join(row[:3])) for row in PINNED],
)
def test_known_routes_keep_their_class(
    adapter: str, method: str, path: str, route_class: RouteClass
) -> None:
    assert classify(adapter, method, path).route_class is route_class


def test_no_adapter_lists_a_management_route_as_anything_else() -> None:
    # One path with two classes would let the first listed win by table order alone.
    for name in ADAPTERS:
        adapter = adapter_for(name)
        for method in ("GET", "HEAD", "POST"):
            management = listed(adapter, method, RouteClass.MANAGEMENT)
            for other in FORWARDED:
                assert not management & listed(adapter, method, other), (name, method, other)


# ---------------------------------------------------------------------------------------
# Fail closed: what no table lists is UNKNOWN, for every method.

UNLISTED_POSTS = [
    "/api/pull",
    "/api/push",
    "/api/create",
    "/api/copy",
    "/api/delete",
    "/api/blobs/sha256:0123",
    "/slots",
    "/slots/0",
    "/props",
    "/lora-adapters",
    "/metrics",
    "/v1/models",
    f"/v1/models/{MODEL}",
    "/v1/files",
    "/v1/fine_tuning/jobs",
    "/v1/batches",
    "/v1/chat/completions/",
    "/v1/chat/completion",
    "/v1/chat",
    "/api/chat/x",
    "/",
    "/unknown",
]


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("path", UNLISTED_POSTS)
def test_post_to_an_unlisted_path_is_unknown(adapter: str, path: str) -> None:
    got = classify(adapter, "POST", path)
    assert got.route_class is RouteClass.UNKNOWN
    assert got.route is None


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/chat/completions"),
        ("PUT", "/v1/chat/completions"),
        ("PATCH", "/v1/chat/completions"),
        ("DELETE", f"/v1/models/{MODEL}"),
        ("DELETE", "/api/delete"),
        ("OPTIONS", "/v1/models"),
        ("TRACE", "/v1/models"),
        ("CONNECT", "/v1/models"),
        ("post", "/v1/chat/completions"),
        ("get", "/v1/models"),
        ("", "/v1/models"),
    ],
)
def test_a_listed_path_with_an_unlisted_method_is_unknown(
    adapter: str, method: str, path: str
) -> None:
    assert classify(adapter, method, path).route_class is RouteClass.UNKNOWN


# ---------------------------------------------------------------------------------------
# Health checks: without a query they are discovery, with one they read slot state.

HEALTH = [("llamacpp", "/health"), ("llamacpp", "/v1/health"), ("ollama", "/")]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize(("adapter", "path"), HEALTH)
def test_health_without_a_query_is_pass(adapter: str, method: str, path: str) -> None:
    assert classify(adapter, method, path).route_class is RouteClass.PASS


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize(("adapter", "path"), HEALTH)
@pytest.mark.parametrize("query", [b"include_slots", b"fail_on_no_slot=1", b"x", b"=", b"&"])
def test_health_with_a_query_is_management(
    adapter: str, method: str, path: str, query: bytes
) -> None:
    got = classify(adapter, method, path, query)
    assert got.route_class is RouteClass.MANAGEMENT
    assert got.path == path


@pytest.mark.parametrize(
    ("raw", "query", "route_class"),
    [
        ("/v1/../health", b"include_slots", RouteClass.MANAGEMENT),
        ("/./health", b"fail_on_no_slot=1", RouteClass.MANAGEMENT),
        ("/x/../health", b"", RouteClass.PASS),
        ("/v1/health/.", b"", RouteClass.UNKNOWN),
    ],
)
def test_health_is_judged_on_the_resolved_path(
    raw: str, query: bytes, route_class: RouteClass
) -> None:
    assert classify("llamacpp", "GET", raw, query).route_class is route_class


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_query_does_not_change_a_non_health_read(adapter: str) -> None:
    assert classify(adapter, "GET", "/v1/models", b"limit=5").route_class is RouteClass.PASS


# ---------------------------------------------------------------------------------------
# Dot segments are resolved the way the forwarding URL resolves them (RFC 3986, 5.2.4).

DOTS = [
    ("/a/b/c/./../../g", "/a/g"),
    # ".." drops one segment: this is /v1/slots, not /slots (the RFC, and what httpx sends).
    ("/v1/models/../slots", "/v1/slots"),
    ("/v1/models/../../slots", "/slots"),
    ("/v1/models/../../../slots", "/slots"),
    ("/../slots", "/slots"),
    ("/./g", "/g"),
    ("/../g", "/g"),
    ("/b/c/../../../g", "/g"),
    ("/b/c/./../g", "/b/g"),
    ("/b/c/./g/.", "/b/c/g/"),
    ("/b/c/g/./h", "/b/c/g/h"),
    ("/b/c/g/../h", "/b/c/h"),
    ("/b/c/g;x=1/./y", "/b/c/g;x=1/y"),
    ("/b/c/g;x=1/../y", "/b/c/y"),
    ("/a/b/..", "/a/"),
    ("/a/..", "/"),
    ("/..", "/"),
    ("/.", "/"),
    ("/a/b/.", "/a/b/"),
    ("/", "/"),
    # Not dot segments: left exactly as sent.
    ("/b/c/g.", "/b/c/g."),
    ("/b/c/.g", "/b/c/.g"),
    ("/b/c/g..", "/b/c/g.."),
    ("/b/c/..g", "/b/c/..g"),
    ("/b/c/...", "/b/c/..."),
    ("/%2e%2e/slots", "/%2e%2e/slots"),
    ("/a//b", "/a//b"),
    ("/a//../b", "/a/b"),
]


@pytest.mark.parametrize(("raw", "resolved"), DOTS, ids=[raw for raw, _ in DOTS])
def test_remove_dot_segments(raw: str, resolved: str) -> None:
    assert remove_dot_segments(raw) == resolved


def rfc_remove_dot_segments(path: str) -> str:
    """RFC 3986's buffer-rewriting loop, transcribed step by step as an oracle."""
    source, output = path, ""
    while source:
        if source.startswith("../"):
            source = source[3:]
        elif source.startswith(("./", "/./")):
            source = source[2:]
        elif source == "/.":
            source = "/"
        elif source.startswith("/../") or source == "/..":
            source = "/" + source[4:]
            output = output[: max(output.rfind("/"), 0)]
        elif source in (".", ".."):
            source = ""
        else:
            end = source.find("/", 1)
            end = len(source) if end == -1 else end
            output += source[:end]
            source = source[end:]
    return output


SEGMENTS = st.one_of(
    st.sampled_from([".", "..", "", "a", "b", "...", ".a", "a.", "%2e", "%2E%2E", ";p", "slots"]),
    st.text(alphabet="ab./%;", max_size=4),
)
PATHS = st.lists(SEGMENTS, max_size=8).map(lambda parts: "/" + "/".join(parts))


@given(PATHS)
def test_remove_dot_segments_agrees_with_the_rfc(path: str) -> None:
    assert remove_dot_segments(path) == rfc_remove_dot_segments(path)


@given(PATHS)
def test_resolved_paths_hold_no_dot_segments_and_are_stable(path: str) -> None:
    resolved = remove_dot_segments(path)
    assert resolved.startswith("/")
    assert not {".", ".."} & set(resolved.split("/"))
    assert remove_dot_segments(resolved) == resolved


# ---------------------------------------------------------------------------------------
# Disguised management reads. Listed reads match exactly, so a spelling that differs from
# a listed route in any way the forwarding client keeps is simply unlisted.


def _expected_for_bypass(adapter: str, resolved: str) -> RouteClass:
    if adapter == "ollama" and resolved == "/api/ps":
        return RouteClass.MANAGEMENT
    if adapter == "llamacpp" and resolved in {"/slots", "/props", "/metrics"}:
        return RouteClass.MANAGEMENT
    return RouteClass.UNKNOWN


BYPASSES = [
    b"/%73lots",
    b"/%73LOTS",
    b"/v1/models/..%2Fapi%2Fps",
    b"/v1/models/..%2fslots",
    b"/v1/models/%2e%2e/slots",
    b"/v1/models/.%2e/api/ps",
    b"/%2e%2e/slots",
    b"/api%2Fps",
    b"/api/p%73",
    b"//slots",
    b"/slots/",
    b"/slots/.",
    b"/api//ps",
    b"/api/ps/",
    b"/api/./ps",
    b"/api/ps;x",
    b"/slots;",
    b"/SLOTS",
    b"/Api/Ps",
    b"/slots%00",
    b"/slots%20",
    b"/slots\x00",
    b"/slots\r\nX-Evil: 1",
    b"/slots\n",
    b"/sl\tots",
    b"/slots ",
    b"/slots\x7f",
    b"/slots\x1b",
    b"/sl\xc3\xb6ts",
    b"/slots\xff",
    b"/v1/models/\xc3\xa9",
    b"/slots?x",
    b"/slots#x",
    b"/v1/models/../slots",
    b"/v1/models/../../slots",
    b"/v1/models/../../api/ps",
    b"/v1/models/x/../../../props",
    b"slots",
    b"",
    b"*",
    b"http://127.0.0.1:8080/slots",
    b"\\slots",
    b"/\\slots",
    b"/v1\\..\\..\\slots",
]


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("raw", BYPASSES, ids=[ascii(raw)[2:-1] or "empty" for raw in BYPASSES])
def test_disguised_management_reads_are_never_forwarded(adapter: str, raw: bytes) -> None:
    got = classify(adapter, "GET", raw)
    assert got.route_class not in FORWARDED
    if raw.isascii() and raw.startswith(b"/") and all(0x21 <= b < 0x7F for b in raw):
        resolved = remove_dot_segments(raw.decode())
        assert got.path == resolved
        assert got.route_class is _expected_for_bypass(adapter, resolved)
    else:
        assert got.route_class is RouteClass.UNKNOWN


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("method", ["HEAD", "POST", "PUT", "DELETE"])
@pytest.mark.parametrize("raw", BYPASSES, ids=[ascii(raw)[2:-1] or "empty" for raw in BYPASSES])
def test_disguises_are_not_forwarded_for_any_method(adapter: str, method: str, raw: bytes) -> None:
    assert classify(adapter, method, raw).route_class not in FORWARDED


def test_api_dot_ps_resolves_to_the_management_read() -> None:
    # The dot is resolved before matching, so this is /api/ps and must be treated as such.
    got = classify("ollama", "GET", b"/api/./ps")
    assert got.route_class is RouteClass.MANAGEMENT
    assert got.path == "/api/ps"


def test_non_ascii_paths_carry_no_path() -> None:
    got = classify("ollama", "GET", b"/api/\xe2\x80\x8bps")
    assert got.route_class is RouteClass.UNKNOWN
    assert got.path == ""


# ---------------------------------------------------------------------------------------
# The "{model}" segment: a name, never a way out of its segment.


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize(
    "name", ["llama3:8b", "qwen2.5-coder:7b-instruct", "gpt-4o", "a", "m_1~x@v+2", "Model.GGUF"]
)
def test_model_segment_accepts_names(adapter: str, name: str) -> None:
    got = classify(adapter, "GET", f"/v1/models/{name}")
    assert got.route_class is RouteClass.PASS
    assert got.path == f"/v1/models/{name}"


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize(
    "name",
    [
        "..",
        ".",
        "",
        "%2e%2e",
        "%2E",
        "llama3%3A8b",
        "a%2Fb",
        "%",
        "..%2Fapi%2Fps",
        "a/b",
        "llama3:8b/",
        "a;b",
        "a b",
        "a\x00",
    ],
)
def test_model_segment_rejects_dots_escapes_and_other_segments(adapter: str, name: str) -> None:
    assert classify(adapter, "GET", f"/v1/models/{name}").route_class is RouteClass.UNKNOWN


# ---------------------------------------------------------------------------------------
# Properties.

MANAGEMENT_READS = [
    (name, route.path)
    for name in ADAPTERS
    for route in adapter_for(name).routes
    if route.route_class is RouteClass.MANAGEMENT and "GET" in route.methods
]


def test_there_are_management_reads_to_disguise() -> None:
    # Guards the property below against an empty list silently testing nothing.
    assert {("llamacpp", "/slots"), ("llamacpp", "/props"), ("ollama", "/api/ps")} <= set(
        MANAGEMENT_READS
    )


def _escape(char: str, upper: bool) -> str:
    code = f"%{ord(char):02X}"
    return code if upper else code.lower()


TAILS = st.sampled_from(
    ["/", "//", "/.", "%00", "%2F", "\x00", "\r\n", "\t", " ", "\x7f", "\x01", "\x1f"]
) | st.sampled_from(["?x", "?include_slots", "#f", "\xff", "é"])


@st.composite
def respelled(draw: st.DrawFn, segment: str) -> str:
    spelled = ""
    for char in segment:
        how = draw(st.sampled_from(["keep", "upper-hex", "lower-hex", "swapcase"]))
        if how == "upper-hex":
            spelled += _escape(char, upper=True)
        elif how == "lower-hex":
            spelled += _escape(char, upper=False)
        elif how == "swapcase":
            spelled += char.swapcase()
        else:
            spelled += char
    if draw(st.booleans()):
        spelled += draw(st.sampled_from([";", ";x", ";x=1", ";/"]))
    return spelled


@st.composite
def disguises(draw: st.DrawFn, path: str) -> tuple[bytes, bool]:
    """A spelling of `path`, and whether it still resolves to exactly `path`.

    Dot noise ("./", "x/../") resolves away; every other change (escapes, case, doubled
    slashes, params, trailing bytes) leaves a different path, which must be unlisted.
    Half the draws add dot noise only, so both outcomes are well represented.
    """
    disguise = draw(st.booleans())
    # An empty noise segment is a doubled slash: a disguise, not noise.
    noise = [".", "x/..", f"{MODEL}/..", "v1/models/../.."] + ([""] if disguise else [])
    parts: list[str] = []
    for segment in path.split("/")[1:]:
        parts += draw(st.lists(st.sampled_from(noise), max_size=2))
        parts.append(draw(respelled(segment)) if disguise else segment)
    raw = "/" + "/".join(parts)
    if disguise:
        # Always a tail, so a disguise never happens to spell the path as listed. Even "/."
        # is not noise at the end: it resolves to a trailing slash.
        raw += draw(TAILS)
    return raw.encode("utf-8"), not disguise


QUERIES = st.one_of(st.just(b""), st.binary(max_size=12))


@given(st.data())
def test_management_reads_never_classify_as_forwarded(data: st.DataObject) -> None:
    adapter, path = data.draw(st.sampled_from(MANAGEMENT_READS), label="route")
    raw, same = data.draw(disguises(path), label="raw")
    method = data.draw(st.sampled_from(["GET", "HEAD"]), label="method")
    query = data.draw(QUERIES, label="query")
    got = classify(adapter, method, raw, query)
    assert got.route_class not in FORWARDED
    if same:
        # Dot noise alone is resolved, and a query never makes a management read lesser.
        assert got.route_class is RouteClass.MANAGEMENT
        assert got.path == path
    else:
        assert got.route_class is RouteClass.UNKNOWN


PASS_READS = [
    (name, route.path)
    for name in ADAPTERS
    for route in adapter_for(name).routes
    if route.route_class is RouteClass.PASS and "GET" in route.methods
]


@given(st.sampled_from(PASS_READS), st.binary(min_size=1, max_size=24))
def test_a_query_makes_only_health_reads_management(route: tuple[str, str], query: bytes) -> None:
    adapter, path = route
    got = classify(adapter, "GET", concrete(path), query)
    if path in adapter_for(adapter).health_paths:
        assert got.route_class is RouteClass.MANAGEMENT
    else:
        assert got.route_class is RouteClass.PASS


_NAME_SEGMENT = re.compile(r"[A-Za-z0-9._:~@+\-]+")


def _is_listed(adapter: Adapter, method: str, route_class: RouteClass, path: str) -> bool:
    """An oracle that reads the table's paths but not its matching code."""
    for pattern in listed(adapter, method, route_class):
        if "{" not in pattern:
            if path == pattern:
                return True
            continue
        prefix, _, suffix = pattern.partition("{")
        suffix = suffix.partition("}")[2]
        if path.startswith(prefix) and path.endswith(suffix):
            name = path[len(prefix) : len(path) - len(suffix)]
            if name not in (".", "..") and _NAME_SEGMENT.fullmatch(name):
                return True
    return False


LISTED_PATHS = sorted(
    {concrete(route.path) for name in ADAPTERS for route in adapter_for(name).routes}
)
RAW_PATHS = st.one_of(
    st.binary(max_size=24),
    PATHS.map(lambda p: p.encode()),
    st.lists(
        st.sampled_from(
            ["/", ".", "..", "%2e", "%2F", "v1", "models", "api", "ps", "slots", "health",
             "chat", "completions", "x", MODEL, ";", "\x00", "\xff", "S", "%73"]
        ),
        max_size=10,
    ).map(lambda parts: "".join(parts).encode("utf-8")),
    # Listed routes themselves, plain or disguised, so forwarded answers are common.
    st.sampled_from(LISTED_PATHS).flatmap(disguises).map(lambda spelled: spelled[0]),
)  # fmt: skip


@given(
    st.sampled_from(ADAPTERS),
    st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE"]),
    RAW_PATHS,
    QUERIES,
)
def test_only_listed_resolved_paths_are_forwarded(
    adapter: str, method: str, raw: bytes, query: bytes
) -> None:
    got = classify(adapter, method, raw, query)
    if got.route_class not in FORWARDED:
        return
    # What is forwarded is the sent path, dot-resolved, and it is exactly a listed route.
    assert got.path == remove_dot_segments(raw.decode("ascii"))
    assert "%" not in got.path
    assert "//" not in got.path
    assert _is_listed(adapter_for(adapter), method, got.route_class, got.path)


@given(st.data())
def test_listed_routes_survive_dot_noise_and_nothing_else(data: st.DataObject) -> None:
    adapter, method, path, route_class = data.draw(
        st.sampled_from([param.values for param in LISTED]), label="route"
    )
    raw, same = data.draw(disguises(concrete(path)), label="raw")
    got = classify(adapter, method, raw)
    if same:
        assert got.route_class is route_class
        assert got.path == concrete(path)
    elif got.route_class in FORWARDED:
        # A respelled model name may still be a name ("LLAMA3:8B"); nothing else may pass.
        assert "{" in path
        assert _is_listed(adapter_for(adapter), method, got.route_class, got.path)

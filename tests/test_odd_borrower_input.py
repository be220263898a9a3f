"""Whatever a borrower sends to a work route, the answer is a 4xx or a refusal, never a 500.

A borrower's body is outside input, and Python's JSON parser fails in more ways than the
one every caller catches: a document nested ~1,000 deep raises RecursionError, and a
number of 5,000 digits raises ValueError in words of its own. A security review found two
500s with a traceback this way: a work body nested 980 deep, and a ComfyUI graph with a
node id of 5,000 digits (ids were ordered through int(), which refuses it). Both requests
are pinned here by name, with undecodable bodies beside them, and then looked for more
widely with hypothesis: random bytes, random JSON, deep JSON, plausible bodies with odd
fields, and ComfyUI graphs with random node ids, on every JSON work route of every adapter.

Everything is real: `python -m vacancyd run --config FILE` in its own process, with one
upstream per adapter, all in front of the echo upstream in a process of its own (it
answers whatever reaches it with 200 and a JSON echo of the request). So any answer
that is not 200 was made by vacancyd, and a 200 proves that the body got through. Both
processes start once for the module, in a trio run on a helper thread, and the tests
talk to them with a plain synchronous httpx client, which is what hypothesis drives.

Besides the status, every test checks that the daemon is still running, still answers
/healthz, and never wrote "Traceback" to its log.

ComfyUI needs one arrangement: vacancyd tracks an admitted prompt until ComfyUI's history
says it finished, and the echo upstream never says so. The comfyui upstream therefore
has a memory resource of its own (so a tracked prompt never blocks the other upstreams)
and a completion timeout of a millisecond, so each admitted prompt becomes a durable hold
at once; the tests read it in /status (with the model vacancyd charged it for) and
release it through the admin API, as an operator would, before the next request.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.configs import NO_RESERVE, daemon_config, memory, upstream
from tests.support.daemon import DaemonProcess, daemon_process
from tests.support.echo_process import echo_process
from vacancyd.adapters.comfyui import MODEL_INPUTS
from vacancyd.adapters.registry import adapter_for, adapter_names
from vacancyd.adapters.routes import Dialect, RouteClass
from vacancyd.json_input import MAX_DEPTH

# A real daemon and a real upstream, each in a process of its own.
pytestmark = pytest.mark.slow

START_TIMEOUT_S = 90.0  # echo (30 s) and daemon (30 s) each bound their own start
STOP_TIMEOUT_S = 60.0  # daemon_process and echo_process each bound their own stop
REQUEST_TIMEOUT_S = 20.0
SETTLE_TIMEOUT_S = 15.0  # a ComfyUI prompt's hold shows up within a poll or two
SETTLE_POLL_S = 0.02
MAX_BODY_MIB = 1  # small, so a body past it is cheap to send
CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def work_routes() -> list[tuple[str, str, Dialect]]:
    """(adapter, path, dialect) of every work route whose body is JSON, for all adapters;
    a `{name}` segment is filled with a word any segment pattern accepts."""
    found = []
    for name in adapter_names():
        for route in adapter_for(name).routes:
            if route.route_class is RouteClass.WORK and route.json_body and not route.websocket:
                path = re.sub(r"\{[a-z_]+\}", "safe-word", route.path)
                found.append((name, path, route.dialect))
    return found


WORK_ROUTES = work_routes()
COMFY_ROUTES = [route for route in WORK_ROUTES if route[0] == "comfyui"]


# -- the daemon and its upstream, for the whole module ----------------------------------------


@attrs.define(repr=False)
class Lender:
    """The running daemon, seen from the test's thread."""

    api: str
    proxies: dict[str, str]
    client: httpx.Client
    _daemon: DaemonProcess
    _token: trio.lowlevel.TrioToken
    _stop: trio.Event
    _log_checked: int = 0

    def __repr__(self) -> str:  # hypothesis prints it with every failing example
        return f"Lender(api={self.api!r})"

    def _in_trio(self, fn: Callable[[], Any]) -> Any:
        return trio.from_thread.run_sync(fn, trio_token=self._token)

    def stop(self) -> None:
        self._in_trio(self._stop.set)

    def post(
        self,
        upstream: str,
        path: str,
        body: bytes | Iterator[bytes],
        content_type: str = "application/json",
    ) -> httpx.Response:
        """POST `body` (an iterator of bytes is sent chunked) to an upstream's proxy."""
        return self.client.post(
            self.proxies[upstream] + path, content=body, headers={"content-type": content_type}
        )

    def log_lines(self) -> list[str]:
        return list(self._in_trio(lambda: list(self._daemon.lines)))

    def assert_unharmed(self) -> None:
        """The daemon runs, answers its health check, and logged no traceback (since the
        last check: each check looks only at lines it has not seen, so a failure points at
        the request just made, or the one before it if the line came late)."""
        returncode = self._in_trio(lambda: self._daemon.process.returncode)
        lines = self.log_lines()
        new, self._log_checked = lines[self._log_checked :], len(lines)
        assert returncode is None, "vacancyd exited:\n" + "\n".join(lines[-40:])
        assert not [line for line in new if "Traceback" in line], "\n".join(new)
        assert self.client.get(f"{self.api}/healthz").status_code == 200

    def status(self) -> dict[str, Any]:
        reply = self.client.get(f"{self.api}/status")
        assert reply.status_code == 200, reply.text
        document: dict[str, Any] = reply.json()
        return document

    def settle_comfyui(self) -> list[str | None]:
        """Release every hold of the comfyui upstream (each admitted prompt becomes one),
        and wait until it holds nothing; the models those holds were charged for."""
        models: list[str | None] = []
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            work = self.status()["upstreams"]["comfyui"]["active_work"]
            if not work:
                return models
            for entry in work:
                if entry["phase"] == "held":
                    released = self.client.post(
                        f"{self.api}/admin/holds/{entry['job_id']}/release", json={}
                    )
                    assert released.status_code == 200, released.text
                    models.append(entry["model"])
            assert time.monotonic() < deadline, f"comfyui still holds {work}"
            time.sleep(SETTLE_POLL_S)  # polled with a deadline, not assumed


def _config(state_dir: Path, target: str) -> str:
    upstreams = []
    for name in adapter_names():
        # ComfyUI's own resource: its tracked prompts must not hold the other upstreams'.
        resource = "comfy_ram" if name == "comfyui" else "ram"
        # A prompt the echo never reports done becomes a hold at once (see above).
        extra: dict[str, Any] = {"completion_timeout_s": 0.001} if name == "comfyui" else {}
        upstreams.append(
            upstream(
                name,
                target,
                adapter=name,
                resource=resource,
                default_need_mib={resource: 1},
                **extra,
            )
        )
    return daemon_config(
        *upstreams,
        state_dir=state_dir,
        poll_interval_s=0.2,
        limits={"max_request_body_mib": MAX_BODY_MIB},
        resources=[memory(**NO_RESERVE), memory("comfy_ram", **NO_RESERVE)],
    )


@pytest.fixture(scope="module")
def lender(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lender]:
    """The echo upstream and the daemon, started once in a trio run of their own thread;
    both are stopped (SIGTERM, then kill after a bound) when the module is done."""
    root = tmp_path_factory.mktemp("odd-input")
    # What main() hands over once the daemon is ready; None when the run ended instead.
    started: queue.Queue[tuple[DaemonProcess, trio.lowlevel.TrioToken, trio.Event] | None] = (
        queue.Queue()
    )
    failed: list[BaseException] = []

    async def main() -> None:
        stop = trio.Event()
        async with echo_process() as echo:
            config = root / "vacancyd.toml"
            config.write_text(_config(root / "state", echo.url))
            async with daemon_process(config) as daemon:
                started.put((daemon, trio.lowlevel.current_trio_token(), stop))
                await stop.wait()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # handed to the test's thread, which raises it
            failed.append(exc)
        started.put(None)  # unblocks a start that never came; ignored after one that did

    thread = threading.Thread(target=run, name="vacancyd-under-test", daemon=True)
    thread.start()
    try:
        ready = started.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
        ready = None
    if ready is None:
        thread.join(timeout=STOP_TIMEOUT_S)
        raise AssertionError(
            f"vacancyd did not start; try `vacancyd check-config {root / 'vacancyd.toml'}`"
        ) from (failed[0] if failed else None)
    daemon, token, stop = ready
    with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client:
        lender = Lender(daemon.api, daemon.proxies, client, daemon, token, stop)
        try:
            yield lender
        finally:
            with contextlib.suppress(trio.RunFinishedError):  # the run ended by itself
                lender.stop()
            thread.join(timeout=STOP_TIMEOUT_S)
    assert not thread.is_alive(), "vacancyd or the echo upstream did not stop"
    if failed:
        raise failed[0]
    # Stopped by SIGTERM like any service: a clean exit, not a crash on the way out.
    assert daemon.process.returncode == 0, daemon.log


# -- what an answer must look like ------------------------------------------------------------


def assert_vacancyd_error(reply: httpx.Response, dialect: Dialect, code: str) -> None:
    """vacancyd's own error, in the shape the route's clients read (proxy/dialects.py)."""
    assert reply.headers.get("x-vacancyd-reason") == code, (reply.status_code, reply.text)
    assert reply.headers.get("x-upstream") is None  # not the echo's answer
    body = reply.json()
    if dialect is Dialect.OLLAMA:
        assert body["error"].startswith(f"{code}: ")
    elif dialect is Dialect.ANTHROPIC:
        assert body["type"] == "error"
        assert body["error"]["code"] == code
    elif dialect is Dialect.COMFYUI:
        assert body["error"]["code"] == code
        assert body["node_errors"] == {}
    elif dialect is Dialect.CHATTERBOX:
        assert body["detail"].startswith(f"{code}: ")
        assert body["error"]["code"] == code
    else:
        assert body["error"]["code"] == code
        assert body["error"]["type"] == "invalid_request_error"


def assert_no_server_error(reply: httpx.Response) -> None:
    """2xx from the upstream, or vacancyd's own 4xx or 503 refusal: never a 500."""
    if reply.status_code == 200 and reply.headers.get("x-upstream") == "echo":
        return
    assert reply.status_code < 500 or reply.status_code == 503, (
        reply.status_code,
        reply.text[:2000],
    )
    assert reply.status_code >= 400, (reply.status_code, reply.text[:2000])
    assert reply.headers.get("x-vacancyd-reason"), (reply.status_code, reply.text[:2000])


def echoed_body(reply: httpx.Response) -> Any:
    """What the echo upstream received, as JSON: the body vacancyd forwarded."""
    assert reply.status_code == 200, reply.text[:2000]
    assert reply.headers.get("x-upstream") == "echo"
    return json.loads(reply.json()["body"])


def nested(depth: int, openers: str = "[") -> bytes:
    """A body whose "messages" nests `depth` arrays or objects, in a document `depth + 1`
    deep (the body's own object is the first level)."""
    opens, closes = [], []
    for level in range(depth):
        if openers[level % len(openers)] == "[":
            opens.append("[")
            closes.append("]")
        else:
            opens.append('{"a":')
            closes.append("}")
    inner = "".join(opens) + "0" + "".join(reversed(closes))
    return b'{"model":"m","messages":' + inner.encode() + b"}"


# -- the review's requests, by name -----------------------------------------------------------


@pytest.mark.parametrize("depth", [980, 100_000])
@pytest.mark.parametrize(
    ("upstream", "path", "dialect"),
    [("openai", "/v1/chat/completions", Dialect.OPENAI), ("ollama", "/api/chat", Dialect.OLLAMA)],
)
def test_a_deeply_nested_body_is_invalid_json_not_a_crash(
    lender: Lender, upstream: str, path: str, dialect: Dialect, depth: int
) -> None:
    """The review's first finding: ~980 levels made the parser raise RecursionError, which
    nothing caught, so the borrower got a 500. It is a 400 `invalid_json` now, in the
    route's own error shape, and so is a document far past the parser's own limit."""
    body = b'{"model":"m","messages":' + b"[" * depth + b"]" * depth + b"}"
    reply = lender.post(upstream, path, body)
    assert reply.status_code == 400, reply.text[:2000]
    assert_vacancyd_error(reply, dialect, "invalid_json")
    lender.assert_unharmed()


def test_the_depth_cap_sits_at_128_levels(lender: Lender) -> None:
    """A document exactly as deep as the cap is forwarded; one level more is refused.

    This shows the refusal comes from vacancyd's own cap, not from wherever the parser
    happens to give up, and that ordinary nesting is not caught by it."""
    at_cap = lender.post("openai", "/v1/chat/completions", nested(MAX_DEPTH - 1, "[{"))
    assert echoed_body(at_cap)["model"] == "m"
    past_cap = lender.post("openai", "/v1/chat/completions", nested(MAX_DEPTH, "[{"))
    assert past_cap.status_code == 400
    assert_vacancyd_error(past_cap, Dialect.OPENAI, "invalid_json")
    assert "nested deeper than 128" in past_cap.json()["error"]["message"]
    lender.assert_unharmed()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}', "not UTF-8"),
        (b'\xef\xbb\xbf{"model":"m"}', "not JSON"),  # a byte-order mark: not JSON either
        (b'{"model":"m","max_tokens":' + b"9" * 5000 + b"}", "too many digits"),
        (b'{"model":"m","seed":-' + b"1" * 5000 + b"}", "too many digits"),
    ],
    ids=["non-utf8", "bom", "5000-digit-number", "negative-5000-digit-number"],
)
def test_undecodable_bodies_are_invalid_json(lender: Lender, body: bytes, why: str) -> None:
    """Non-UTF-8 bytes and a 5,000-digit number (past int()'s digit limit, which raises
    ValueError in words of its own) are a 400, and the message says why in fixed words,
    never quoting the body back."""
    reply = lender.post("openai", "/v1/chat/completions", body)
    assert reply.status_code == 400
    assert_vacancyd_error(reply, Dialect.OPENAI, "invalid_json")
    message = reply.json()["error"]["message"]
    assert why in message
    assert "99999" not in message and "11111" not in message
    lender.assert_unharmed()


def _checkpoint(name: str) -> dict[str, Any]:
    return {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": name}}


LONG_ID = "1" + "0" * 4999  # 5,000 digits: int() refuses it


@pytest.mark.parametrize(
    ("graph", "charged"),
    [
        # The review's graph: a node id of 5,000 digits. Numeric ids go by value, so 7 first.
        (
            {LONG_ID: _checkpoint("long.safetensors"), "7": _checkpoint("seven.safetensors")},
            "seven.safetensors",
        ),
        # Numeric before text, even a 5,000-digit number before "abc".
        (
            {"abc": _checkpoint("text.safetensors"), LONG_ID: _checkpoint("long.safetensors")},
            "long.safetensors",
        ),
        # Numeric and text ids mixed: by value (9 before 10, "0009" is 9 too), then text.
        (
            {
                "10": _checkpoint("ten.safetensors"),
                "abc": _checkpoint("abc.safetensors"),
                "0009": {"class_type": "KSampler", "inputs": {"model": ["10", 0]}},
                "9": _checkpoint("nine.safetensors"),
            },
            "nine.safetensors",
        ),
    ],
    ids=["5000-digit-id", "5000-digit-id-and-text", "mixed-ids"],
)
def test_comfyui_graphs_with_odd_node_ids_are_forwarded(
    lender: Lender, graph: dict[str, Any], charged: str
) -> None:
    """The review's second finding: node ids were ordered through int(), so an id of
    5,000 digits made the submission a 500. Such graphs are forwarded now, unchanged
    except for the prompt id vacancyd writes in, and the model charged for them is the
    one the documented order picks (numeric ids by value, then the others as text)."""
    lender.settle_comfyui()
    body = {"prompt": graph, "client_id": "borrower", "prompt_id": "mine"}
    reply = lender.post("comfyui", "/prompt", json.dumps(body).encode())
    forwarded = echoed_body(reply)
    assert forwarded["prompt"] == graph
    assert forwarded["client_id"] == "borrower"
    assert CANONICAL_UUID.fullmatch(forwarded["prompt_id"])
    assert lender.settle_comfyui() == [charged]
    lender.assert_unharmed()


@pytest.mark.parametrize(
    ("upstream", "path", "dialect"),
    WORK_ROUTES,
    ids=[f"{upstream}{path}" for upstream, path, _ in WORK_ROUTES],
)
def test_every_work_route_refuses_the_review_bodies(
    lender: Lender, upstream: str, path: str, dialect: Dialect
) -> None:
    """Each JSON work route of each adapter, not only the two the review tried: the deep
    body, undecodable bytes and an oversized number are all 400 `invalid_json` in the
    route's own error shape."""
    for body in (
        nested(980),
        b'{"model":"m","prompt":"\xc3\x28"}',
        b'{"model":"m","n":' + b"7" * 5000 + b"}",
    ):
        reply = lender.post(upstream, path, body)
        assert reply.status_code == 400, (body[:40], reply.status_code, reply.text[:2000])
        assert_vacancyd_error(reply, dialect, "invalid_json")
    lender.assert_unharmed()


def chunks(body: bytes, size: int = 4096) -> Iterator[bytes]:
    """`body` in pieces: httpx sends an iterator chunked, with no Content-Length."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def test_body_size_and_framing_do_not_change_the_answer(lender: Lender) -> None:
    """The same odd bodies sent chunked are read by the same reader: a deep one is still
    400 `invalid_json` and a plain one still gets through. A body past the size limit is
    413 `body_too_large` whether it says its length up front or not, before any parse."""
    deep = b'{"model":"m","messages":' + b"[" * 5000 + b"]" * 5000 + b"}"
    reply = lender.post("ollama", "/api/chat", chunks(deep))
    assert reply.status_code == 400
    assert_vacancyd_error(reply, Dialect.OLLAMA, "invalid_json")
    reply = lender.post("ollama", "/api/chat", chunks(b'{"model":"m","messages":[]}', 5))
    assert echoed_body(reply) == {"model": "m", "messages": []}
    too_big = b'{"model":"m","prompt":"' + b"[" * (MAX_BODY_MIB * 1024 * 1024) + b'"}'
    for body in (too_big, chunks(too_big, 64 * 1024)):
        reply = lender.post("openai", "/v1/chat/completions", body)
        assert reply.status_code == 413
        assert_vacancyd_error(reply, Dialect.OPENAI, "body_too_large")
    lender.assert_unharmed()


# -- the same, looked for with hypothesis -----------------------------------------------------

PROPERTY = settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

routes = st.sampled_from(WORK_ROUTES)


def any_text(max_size: int) -> st.SearchStrategy[str]:
    """Text with lone surrogates drawn often (plain st.text never draws them): JSON's
    "\\ud800" escapes decode to such strings, which break naive encoding and logging."""
    return st.text(st.characters(categories=["Cs"]) | st.characters(), max_size=max_size)


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | any_text(30)
    # Integers near and past int()'s 4,300-digit limit, without a huge hypothesis buffer.
    | st.builds(
        lambda digit, n: int(digit + "0" * n), st.sampled_from("123456789"), st.integers(0, 4298)
    )
)
# Keys the echo upstream acts on (it streams or floods for them) are left out: what it
# does with them is not what is tested here.
keys = any_text(12).filter(lambda key: not key.startswith("echo_"))
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=20,
)
extra_keys = keys.filter(lambda key: key != "model")
models = (
    st.sampled_from(["llama3.1:8b", "gpt-4o-mini", "qwen2.5-coder:7b-instruct-q4_K_M", "m", ""])
    | any_text(40)
    | st.text(max_size=3000)
    | json_values
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | any_text(8)},
        optional={"content": any_text(200) | json_values},
    ),
    max_size=3,
)
# A body shaped like real work, with the fields adapters read (`background` on /responses,
# `stream` where the reply's framing depends on it) holding odd values as well as plain ones.
plausible_bodies = st.fixed_dictionaries(
    {"model": models},
    optional={
        "stream": st.booleans() | json_values,
        "background": st.booleans() | json_values,
        "messages": messages | json_values,
        "prompt": any_text(200) | json_values,
        "input": any_text(3000) | json_values,
        "keep_alive": st.sampled_from([0, -1, "5m", "0s"]) | json_values,
    },
)
content_types = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-16",
        "text/plain",
        "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded",
        "",
    ]
)


def send_and_check(
    lender: Lender, upstream: str, path: str, body: bytes, content_type: str = "application/json"
) -> httpx.Response:
    reply = lender.post(upstream, path, body, content_type)
    # Shown by --hypothesis-show-statistics: how many examples got through, and how not.
    event(f"{reply.status_code} {reply.headers.get('x-vacancyd-reason', 'from the upstream')}")
    assert_no_server_error(reply)
    if upstream == "comfyui" and reply.status_code == 200:
        lender.settle_comfyui()
    lender.assert_unharmed()
    return reply


raw_bytes = st.binary(max_size=600)
# Random bytes inside a JSON string: invalid UTF-8, control characters, stray quotes and
# backslashes, where a parser meets them in real bodies.
bytes_in_a_string = st.builds(lambda raw: b'{"model":"m","prompt":"' + raw + b'"}', raw_bytes)


@PROPERTY
@given(route=routes, body=raw_bytes | bytes_in_a_string, content_type=content_types)
def test_random_bytes_are_never_a_server_error(
    lender: Lender, route: tuple[str, str, Dialect], body: bytes, content_type: str
) -> None:
    """Arbitrary bytes, alone or inside a JSON string, under any declared content type, on
    any JSON work route: mostly not JSON (400), now and then a document that is
    (forwarded, or refused for what it says). A work route's body is read as UTF-8 JSON
    whatever the header claims, so the header cannot steer it past the reader."""
    upstream, path, _ = route
    send_and_check(lender, upstream, path, body, content_type)


@PROPERTY
@given(route=routes, value=json_values)
def test_random_json_is_never_a_server_error(
    lender: Lender, route: tuple[str, str, Dialect], value: Any
) -> None:
    """Any JSON value (arrays, scalars, objects of anything, NaN, huge integers): a body
    that is not an object is a 400, and an object is forwarded or refused, never a 500."""
    upstream, path, dialect = route
    reply = send_and_check(lender, upstream, path, json.dumps(value).encode())
    if not isinstance(value, dict):
        assert reply.status_code == 400
        assert_vacancyd_error(reply, dialect, "invalid_json")


@PROPERTY
@given(
    route=routes,
    depth=st.integers(1, 5000),
    openers=st.sampled_from(["[", "{", "[{", "{[", "[[{"]),
)
def test_deep_json_is_capped_not_a_server_error(
    lender: Lender, route: tuple[str, str, Dialect], depth: int, openers: str
) -> None:
    """Nesting of any depth and mix of arrays and objects: past the cap (128 levels,
    counting the body's own object) it is 400 `invalid_json`; within it, the body is
    read as JSON and treated like any other."""
    upstream, path, dialect = route
    reply = send_and_check(lender, upstream, path, nested(depth, openers))
    if depth + 1 > MAX_DEPTH:
        assert reply.status_code == 400
        assert_vacancyd_error(reply, dialect, "invalid_json")
    else:  # forwarded, or refused for what it says (a ComfyUI body needs a graph)
        assert reply.headers.get("x-vacancyd-reason") != "invalid_json", reply.text[:2000]


@PROPERTY
@given(
    route=routes,
    body=plausible_bodies,
    extra=st.dictionaries(extra_keys, json_values, max_size=4),
)
def test_plausible_bodies_with_odd_fields_are_never_a_server_error(
    lender: Lender, route: tuple[str, str, Dialect], body: dict[str, Any], extra: dict[str, Any]
) -> None:
    """A body shaped like real work: a "model" (a real-looking name, any text with lone
    surrogates, 3,000 characters, or not a string at all) beside the fields adapters read
    and random others. It reaches the adapter's checks, the footprint lookup and admission
    with odd values; every outcome is the upstream's 200, a 400 or a refusal."""
    upstream, path, _ = route
    document = {**extra, **body}
    send_and_check(lender, upstream, path, json.dumps(document).encode())


long_digit_ids = st.builds(
    lambda zeros, digit, n: zeros + digit * n,
    st.sampled_from(["", "0", "000"]),
    st.sampled_from("0123456789"),
    st.integers(1, 6000),
)
node_ids = (
    long_digit_ids
    | any_text(12)
    | st.text(alphabet="0123456789", min_size=1, max_size=6)
    # Unicode digits: isdigit() says yes, int() and ASCII order say otherwise.
    | st.sampled_from(
        ["0009", "9", "10", "abc", "\u0663", "\u00b2", "\u0661\u0660", "-1", "+5", " 7", "1e3"]
    )
)
finite = st.floats(allow_nan=False, allow_infinity=False)
inputs = st.dictionaries(
    st.sampled_from([*MODEL_INPUTS, "seed", "steps", "text"]) | any_text(8),
    any_text(30)
    | st.integers()
    | finite
    | st.tuples(node_ids, st.integers(0, 3)).map(list)  # a link to another node's output
    | st.lists(st.text(max_size=5), max_size=3),
    max_size=4,
)
nodes = (
    st.fixed_dictionaries({"class_type": any_text(24), "inputs": inputs})
    | st.fixed_dictionaries({"inputs": st.none() | st.integers() | st.text(max_size=5)})
    | st.none()
    | st.text(max_size=10)
    | st.lists(st.integers(), max_size=3)
)
graphs = st.dictionaries(node_ids, nodes, min_size=1, max_size=6)
# What a submission may hold instead of a graph, drawn for a minority of bodies (with a
# plain `|`, hypothesis drew these far more often than graphs).
not_graphs: st.SearchStrategy[Any] = (
    st.just({}) | st.none() | st.lists(nodes, max_size=3) | st.text(max_size=10)
)
graphs_mostly = st.integers(0, 3).flatmap(lambda pick: graphs if pick else not_graphs)


@PROPERTY
@given(
    route=st.sampled_from(COMFY_ROUTES),
    graph=graphs_mostly,
    client_id=st.none() | st.text(max_size=20),
    prompt_id=st.none() | st.text(max_size=40) | st.integers(),
)
def test_comfyui_graphs_are_forwarded_or_refused_never_a_server_error(
    lender: Lender,
    route: tuple[str, str, Dialect],
    graph: Any,
    client_id: str | None,
    prompt_id: str | int | None,
) -> None:
    """ComfyUI graphs with random node ids (5,000-digit numbers, text, Unicode digits,
    leading zeros) and random nodes and inputs: a non-empty graph is forwarded unchanged
    with vacancyd's own prompt id written in; anything else is 400 `not_lendable`."""
    _, path, dialect = route
    body: dict[str, Any] = {"prompt": graph}
    if client_id is not None:
        body["client_id"] = client_id
    if prompt_id is not None:
        body["prompt_id"] = prompt_id
    reply = send_and_check(lender, "comfyui", path, json.dumps(body).encode())
    if isinstance(graph, dict) and graph:
        forwarded = echoed_body(reply)
        assert forwarded["prompt"] == graph
        assert CANONICAL_UUID.fullmatch(forwarded["prompt_id"])
    else:
        assert reply.status_code == 400
        assert_vacancyd_error(reply, dialect, "not_lendable")


def test_the_daemon_outlived_everything(lender: Lender) -> None:
    """Last, over the whole log: still running, still answering, and no traceback from
    any request of this module, however late its line was written."""
    lender.assert_unharmed()
    assert not [line for line in lender.log_lines() if "Traceback" in line]
    status = lender.status()
    assert status["upstreams"]["comfyui"]["active_work"] == []

"""A deadline and a size limit for a request's head (http_protocol.py), on server and router alike: a connection
that sends nothing, or trickles its headers, is answered 408 and closed; once its headers are in, a request (slow
body included) is never cut by it, and a kept-alive connection serves its next request as usual. A request line
over the limit is answered 414, headers over it 431, each with an OpenAI-style body the client reads (never a
reset), whether the head came in pieces or whole."""

import asyncio
import json
import socket
import time

import httpx
import pytest
from router_fakes import LiveApp
from server_helpers import LiveServer

from prefixserve.http_protocol import MAX_HEAD_BYTES, HeadLimit
from prefixserve.router.app import RouterSettings, build_router_app

DEADLINE = 0.5
BOUND = 20.0  # seconds any one exchange may take before the test fails (never a timing assertion)


@pytest.fixture(scope="module")
def server():
    with LiveServer(header_timeout=DEADLINE) as live:
        yield live.port


@pytest.fixture(scope="module")
def router(default_model_dir):
    app = build_router_app(RouterSettings(replicas=("http://127.0.0.1:9",), health_interval=5.0))
    with LiveApp(app, header_timeout=DEADLINE) as live:
        yield live.port


def read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(BOUND)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def assert_408(received: bytes) -> None:
    assert_error(received, 408, "request_timeout")


def assert_error(received: bytes, status: int, code: str) -> None:
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), received[:200]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error


WHAT_IF = {"server": "/dashboard/api/price", "router": "/dashboard/api/fleet"}  # GETs with query parameters


def exchange(port: int, request: bytes) -> bytes:
    """Send `request` on a new connection and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:
        sock.sendall(request)
        return read_until_closed(sock)


@pytest.mark.parametrize("app", ["server", "router"])
def test_a_200_kb_url_is_answered_414_not_reset(app, request):
    port = request.getfixturevalue(app)
    query = b"hit_rate=0.5&prompt_tokens=" + b"9" * 200_000
    answer = exchange(port, b"GET " + WHAT_IF[app].encode() + b"?" + query + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    assert_error(answer, 414, "uri_too_long")
    assert b"connection: close" in answer.partition(b"\r\n\r\n")[0].lower()


@pytest.mark.parametrize("app", ["server", "router"])
def test_an_unfinished_head_over_the_limit_is_414_or_431_by_its_part(app, request):
    port = request.getfixturevalue(app)
    line = b"GET " + WHAT_IF[app].encode() + b"?q=" + b"a" * (MAX_HEAD_BYTES + 100)  # no end of line yet
    assert_error(exchange(port, line), 414, "uri_too_long")
    headers = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"b" * (MAX_HEAD_BYTES + 100)  # no end of headers
    assert_error(exchange(port, headers), 431, "headers_too_large")


@pytest.mark.parametrize("app", ["server", "router"])
def test_httpx_reads_414_and_431_and_the_next_request_is_served(app, request):
    url = f"http://127.0.0.1:{request.getfixturevalue(app)}"
    long_url = httpx.get(url + WHAT_IF[app], params={"prompt_tokens": "9" * 60_000}, timeout=BOUND)
    assert long_url.status_code == 414 and long_url.json()["error"]["code"] == "uri_too_long"
    many = {f"x-header-{i}": "v" * 200 for i in range(100)}
    big_headers = httpx.get(url + "/health", headers=many, timeout=BOUND)
    assert big_headers.status_code == 431 and big_headers.json()["error"]["code"] == "headers_too_large"
    within = httpx.get(url + WHAT_IF[app], params={"prompt_tokens": "9" * 8_000}, timeout=BOUND)
    assert within.status_code not in (414, 431)  # under the limit: the route's own answer (its key, its checks)


def test_a_whole_head_over_the_limit_in_one_read_is_refused_too():
    """h11 checks the limit only on an unfinished head; one that came whole in one read reaches HeadLimit."""
    sent, called = [], []

    async def app(scope, receive, send):
        called.append(scope["path"])

    async def send(message):
        sent.append(message)

    def scope(query: bytes, headers: list) -> dict:
        return {
            "type": "http",
            "method": "GET",
            "path": "/x",
            "raw_path": b"/x",
            "query_string": query,
            "headers": headers,
        }

    limit = HeadLimit(app, 1000)
    asyncio.run(limit(scope(b"q=" + b"a" * 1000, [(b"host", b"x")]), None, send))
    assert sent[0]["status"] == 414 and json.loads(sent[1]["body"])["error"]["code"] == "uri_too_long"
    sent.clear()
    asyncio.run(limit(scope(b"q=a", [(b"host", b"x"), (b"x-big", b"b" * 1000)]), None, send))
    assert sent[0]["status"] == 431 and json.loads(sent[1]["body"])["error"]["code"] == "headers_too_large"
    asyncio.run(limit(scope(b"q=a", [(b"host", b"x")]), None, send))
    assert called == ["/x"]


@pytest.mark.parametrize("app", ["server", "router"])
def test_a_connection_that_sends_no_request_is_closed_with_408(app, request):
    port = request.getfixturevalue(app)
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:
        assert_408(read_until_closed(sock))


@pytest.mark.parametrize("app", ["server", "router"])
def test_trickled_headers_do_not_buy_time(app, request):
    port = request.getfixturevalue(app)
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        began = time.monotonic()
        sock.settimeout(0.1)
        received = b""
        while time.monotonic() - began < BOUND:  # a header byte every 0.1 s, for ever, were it allowed
            try:
                sock.sendall(b"x")
            except OSError:
                break
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if not chunk:
                break
            received += chunk
        assert_408(received)


def test_a_request_whose_headers_arrived_has_all_the_time_its_body_needs(server):
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server), timeout=BOUND) as sock:
        for _ in range(2):  # two requests on one kept-alive connection, each body sent after the deadline
            sock.sendall(head)
            time.sleep(DEADLINE * 3)
            sock.sendall(body)
            received = b""
            while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, received
                received += chunk
            assert received.startswith(b"HTTP/1.1 200 "), received[:300]

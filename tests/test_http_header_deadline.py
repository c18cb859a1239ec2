"""A deadline for a request's headers (http_protocol.py), on server and router alike: a connection that sends
nothing, or trickles its headers, is answered 408 and closed; once its headers are in, a request (slow body
included) is never cut by it, and a kept-alive connection serves its next request as usual."""

import json
import socket
import time

import pytest
from router_fakes import LiveApp
from server_helpers import LiveServer

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
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), received[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"


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

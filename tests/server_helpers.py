"""Run a real prefixserve server (uvicorn, real sockets, 127.0.0.1) in a thread for tests."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from prefixserve.http_protocol import HEADER_TIMEOUT_SECONDS, uvicorn_config
from prefixserve.server.serve_launch import add_serve_arguments, build_server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """`prefixserve serve` with these CLI options, on a free localhost port."""

    def __init__(self, *cli_args: str, header_timeout: float = HEADER_TIMEOUT_SECONDS) -> None:
        import argparse

        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        self.port = free_port()
        args = parser.parse_args(
            ["--port", str(self.port), "--dtype", "float32", "--kv-cache-memory-bytes", str(32 << 20), *cli_args]
        )
        self.engine, self.app = build_server(args)
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(self.app, "127.0.0.1", self.port, "warning", header_timeout)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("server did not come up within 30 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no request (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.engine.engine.has_unfinished_requests() and self.engine.num_waiting == 0:
                return
            time.sleep(0.02)
        raise AssertionError("engine still busy after the timeout")


def assert_openai_error(response, status: int, param=None, code=None) -> None:
    """The response has this status and an OpenAI error body naming the cause (and param / code, when given)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def openai_client(live: LiveServer):
    """The official openai client on a live server (no retries: a test sees the first answer)."""
    from openai import OpenAI

    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)

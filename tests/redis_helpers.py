"""A private redis-server per test (a free 127.0.0.1 port, a temporary directory, no persistence),
and the records the remote-tier tests store in it.

`redis_server` is a pytest fixture (import it into a test module or conftest.py); it
skips the test, saying why, where redis-server or redis-py is missing. The server can
be killed and started again on the same port, to test what a replica does meanwhile.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

from prefixserve.tiers import BlockRecord

from tier_helpers import BLOCK_SIZE, OTHER_SCOPE, SCOPE, expect  # noqa: F401 (re-exported to the redis tests)
from tier_helpers import make_chain as make_token_chain

START_SECONDS = 10.0  # bounded wait for "Ready to accept connections"


def make_chain(num_blocks: int, payload_bytes: int = 64, scope: bytes = SCOPE, first_token: int = 0) -> list[BlockRecord]:
    """Records for a prefix of `num_blocks` blocks, keyed exactly as the engine keys them."""
    return make_token_chain(list(range(first_token, first_token + num_blocks * BLOCK_SIZE)), payload_bytes, scope)


def keys_of(records: list[BlockRecord]) -> list[bytes]:
    return [record.key for record in records]


def redis_name(scope: bytes, key: bytes) -> bytes:
    return b"pskv:" + scope.hex().encode() + b":" + key.hex().encode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require_redis() -> str:
    """The redis-server binary, or a skip that says how to get it."""
    pytest.importorskip("redis", reason="redis-py is not installed: pip install 'redis>=5' to test the remote tier")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed: apt-get install redis-server to test the remote tier")
    return binary


class PortTakenError(RuntimeError):
    pass


class RedisServer:
    """One redis-server process; `args` are extra options, e.g. ("--maxmemory", "2mb")."""

    def __init__(self, directory: Path, *args: str, password: Optional[str] = None, tls: bool = False) -> None:
        self.binary = require_redis()
        self.directory = directory
        self.args = list(args)
        self.password = password
        self.tls = tls
        self.port = free_port()
        self.process: Optional[subprocess.Popen] = None
        self._has_started = False
        if tls:
            self._make_certificate()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        query = "?ssl_cert_reqs=none" if self.tls else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0{query}"

    def client(self, db: int = 0):
        """A plain redis-py client for the test's own checks and mischief."""
        import redis

        url = self.url.replace("/0?", f"/{db}?") if self.tls else self.url[: self.url.rindex("/")] + f"/{db}"
        return redis.Redis.from_url(url, socket_timeout=10)

    def start(self) -> "RedisServer":
        """Start on `self.port` and wait until it accepts connections (bounded).

        The first start moves to another free port if something took this one meanwhile; a restart keeps it.
        """
        for _ in range(3):
            try:
                return self._start_once()
            except PortTakenError:
                if self._has_started:
                    raise
                self.port = free_port()
        return self._start_once()

    def _start_once(self) -> "RedisServer":
        assert self.process is None, "already running"
        log = self.directory / f"redis-{self.port}.log"
        log.unlink(missing_ok=True)
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--dir", str(self.directory), "--logfile", str(log), "--enable-debug-command", "local", *self.args]
        if self.password:
            command += ["--requirepass", self.password]
        if self.tls:
            command[2] = "0"  # no plain port: the TLS one takes its place
            command += ["--tls-port", str(self.port), "--tls-cert-file", str(self.directory / "cert.pem"),
                        "--tls-key-file", str(self.directory / "key.pem"), "--tls-auth-clients", "no"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if log.exists() and "Ready to accept connections" in log.read_text(errors="replace"):
                self._has_started = True
                return self
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        text = log.read_text(errors="replace") if log.exists() else ""
        self.kill()
        if "Address already in use" in text:
            raise PortTakenError(f"port {self.port} is taken")
        raise RuntimeError(f"redis-server did not start on port {self.port} within {START_SECONDS} s:\n{text[-2000:]}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no goodbye to clients."""
        if self.process is not None:
            if self.process.poll() is None:
                os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
            self.process = None

    def _make_certificate(self) -> None:
        if shutil.which("openssl") is None:
            pytest.skip("openssl is not installed: it makes the test's TLS certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                        "-keyout", str(self.directory / "key.pem"), "-out", str(self.directory / "cert.pem")],
                       check=True, capture_output=True, timeout=30)


@pytest.fixture
def redis_server(tmp_path):
    """A running redis-server of this test's own, killed at teardown."""
    server = RedisServer(tmp_path).start()
    yield server
    server.kill()

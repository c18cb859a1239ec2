"""A private redis-server per test (a free 127.0.0.1 port, a temporary directory, no persistence),
and the records the remote-tier tests store in it.

`redis_server` is a pytest fixture (import it into a test module or conftest.py); it
skips the test, saying why, where redis-server or redis-py is missing. The server can
be killed and started again on the same port, to test what a replica does meanwhile.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest
from tier_helpers import BLOCK_SIZE, OTHER_SCOPE, SCOPE, expect  # noqa: F401 (re-exported to the redis tests)
from tier_helpers import make_chain as make_token_chain

from prefixserve.tiers import BlockRecord

START_SECONDS = 10.0  # bounded wait for "Ready to accept connections"


def make_chain(
    num_blocks: int, payload_bytes: int = 64, scope: bytes = SCOPE, first_token: int = 0
) -> list[BlockRecord]:
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

    def __init__(
        self, directory: Path, *args: str, password: Optional[str] = None, tls: bool = False, port: Optional[int] = None
    ) -> None:
        self.binary = require_redis()
        self.directory = directory
        self.args = list(args)
        self.password = password
        self.tls = tls
        self.port = port or free_port()
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

    def num_keys(self) -> int:
        return self.client().dbsize()

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
        command = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            "--logfile",
            str(log),
            "--enable-debug-command",
            "local",
            *self.args,
        ]
        if self.password:
            command += ["--requirepass", self.password]
        if self.tls:
            command[2] = "0"  # no plain port: the TLS one takes its place
            command += [
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(self.directory / "cert.pem"),
                "--tls-key-file",
                str(self.directory / "key.pem"),
                "--tls-auth-clients",
                "no",
            ]
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
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
                "-keyout",
                str(self.directory / "key.pem"),
                "-out",
                str(self.directory / "cert.pem"),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )


@pytest.fixture
def redis_server(tmp_path):
    """A running redis-server of this test's own, killed at teardown."""
    server = RedisServer(tmp_path).start()
    yield server
    server.kill()


# ---- Redis Cluster ---------------------------------------------------------------------------------------
CLUSTER_READY_SECONDS = 30.0  # bounded waits: the cluster forming, a replica taking over


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too and below 65536."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 50000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisCluster:
    """Three masters and three replicas of redis-server on loopback ports, joined by `redis-cli --cluster create`
    (a replica takes over a master that stops answering for a second)."""

    def __init__(self, directory: Path, num_masters: int = 3) -> None:
        require_redis()
        if shutil.which("redis-cli") is None:
            pytest.skip("redis-cli is not installed: apt-get install redis-server (it ships redis-cli)")
        self.servers = [
            RedisServer(
                directory,
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "1000",
                "--cluster-config-file",
                f"nodes-{index}.conf",
                "--repl-diskless-sync-delay",
                "0",
                port=free_cluster_port(),
            )
            for index in range(2 * num_masters)
        ]

    def start(self) -> "RedisCluster":
        for server in self.servers:
            server.start()
        addresses = [f"127.0.0.1:{server.port}" for server in self.servers]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait(lambda: all(self.info(server)["cluster_state"] == "ok" for server in self.servers))
        self.wait(self.replicas_in_sync)  # a replica that never synced would not take over its master
        return self

    def replicas_in_sync(self) -> bool:
        roles = [server.client().info("replication") for server in self.servers if server.process is not None]
        return all(role["role"] == "master" or role.get("master_link_status") == "up" for role in roles)

    @property
    def url(self) -> str:
        return self.servers[0].url

    def info(self, server: RedisServer) -> dict:
        text = server.client().execute_command("CLUSTER", "INFO").decode()
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def masters(self) -> list[RedisServer]:
        """The live servers that are masters now."""
        return [
            server
            for server in self.servers
            if server.process is not None and server.client().info("replication")["role"] == "master"
        ]

    def owner_of(self, name: bytes) -> RedisServer:
        """The live master serving `name`'s slot now (CLUSTER SLOTS as a live master sees it)."""
        client = self.masters()[0].client()
        slot = client.execute_command("CLUSTER", "KEYSLOT", name)
        for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(server for server in self.servers if server.port == int(master[1]))
        raise LookupError(f"no master serves slot {slot}")

    def wait(self, condition, seconds: float = CLUSTER_READY_SECONDS) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if condition():
                    return
            except Exception:  # a node still starting or failing over
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the Redis Cluster did not get there within {seconds} s")

    def kill_master(self, server: RedisServer) -> None:
        """SIGKILL a master, then wait until a replica serves its slots (the cluster is whole again)."""
        server.kill()
        live = [other for other in self.servers if other.process is not None]
        self.wait(
            lambda: (
                all(self.info(other)["cluster_state"] == "ok" for other in live)
                and len(self.masters()) == len(self.servers) // 2
            )
        )

    def client(self):
        """A cluster-aware redis-py client for the test's own checks and mischief (any live node's URL)."""
        import redis

        live = next(server for server in self.servers if server.process is not None)
        return redis.cluster.RedisCluster.from_url(live.url, socket_timeout=10)

    def stop(self) -> None:
        for server in self.servers:
            server.kill()

    kill = stop  # the whole cluster gone, as one server killed

    def num_keys(self) -> int:
        return sum(server.client().dbsize() for server in self.masters())


@pytest.fixture
def redis_cluster(tmp_path):
    """A running 3-master, 3-replica Redis Cluster of this test's own, killed at teardown."""
    cluster = RedisCluster(tmp_path)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(params=["one server", "cluster"])
def shared_redis(request, tmp_path):
    """The fleet's remote tier on one redis-server, then on a 3-master cluster: the same test passes on both."""
    shared = RedisServer(tmp_path) if request.param == "one server" else RedisCluster(tmp_path)
    try:
        yield shared.start()
    finally:
        shared.kill()

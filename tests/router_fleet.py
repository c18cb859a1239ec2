"""Real `prefixserve serve` replicas (subprocesses) behind an in-process router, on 127.0.0.1, for e2e tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

import httpx
import uvicorn
from server_helpers import free_port

from prefixserve.http_protocol import uvicorn_config
from prefixserve.router.app import RouterSettings, build_router_app

ADMIN_KEY = "fleet-admin-key"


def start_replica(port: int, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "prefixserve.cli",
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        str(32 << 20),
        "--enable-kv-events",
        "--admin-api-key",
        ADMIN_KEY,
        "--log-level",
        "warning",
        *extra,
    ]
    return subprocess.Popen(command, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy in {timeout} s")


class Fleet:
    """Replicas replica-0..N-1 and a router over them; `kill` and `restart` a replica by index."""

    def __init__(
        self, num_replicas: int = 3, replica_args: tuple = (), roles: Optional[list[str]] = None, **router_options
    ) -> None:
        """`roles`, one per replica ("both", "prefill", "decode"): each started with its --role and given to the
        router as --replica, --prefill-replica or --decode-replica."""
        self.ports = [free_port() for _ in range(num_replicas)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.roles = roles or ["both"] * num_replicas
        self.replica_args = replica_args
        self.processes: list[Optional[subprocess.Popen]] = [None] * num_replicas
        options = {
            "admin_api_key": ADMIN_KEY,
            "health_interval": 0.3,
            "sync_interval": 0.1,
            "control_timeout": 5.0,
            "request_timeout": 120.0,
            **router_options,
        }
        by_role = {
            role: tuple(url for url, kind in zip(self.urls, self.roles) if kind == role)
            for role in ("both", "prefill", "decode")
        }
        self.settings = RouterSettings(
            replicas=by_role["both"], prefill_replicas=by_role["prefill"], decode_replicas=by_role["decode"], **options
        )
        self.app = None
        self.server: Optional[uvicorn.Server] = None
        self.thread: Optional[threading.Thread] = None
        self.url = ""

    @property
    def router(self):
        return self.app.state.router

    def __enter__(self) -> "Fleet":
        try:
            self.processes = [start_replica(port, *self.args_of(index)) for index, port in enumerate(self.ports)]
            for url in self.urls:
                wait_healthy(url)
            port = free_port()
            self.app = build_router_app(self.settings)
            self.server = uvicorn.Server(uvicorn_config(self.app, "127.0.0.1", port, "warning"))
            self.thread = threading.Thread(target=self.server.run, daemon=True)
            self.thread.start()
            self.url = f"http://127.0.0.1:{port}"
            self.wait_all_healthy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def args_of(self, index: int) -> tuple:
        role = self.roles[index]
        return (*self.replica_args, *(("--role", role) if role != "both" else ()))

    def wait_all_healthy(self, timeout: float = 60.0) -> None:
        """Until the router sees every replica healthy and has learned the scope."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self.app is not None
                and self.server.started
                and self.router.route_keys is not None
                and all(r.healthy for r in self.router.replicas)
            ):
                return
            time.sleep(0.05)
        raise RuntimeError("the router did not see every replica healthy in time")

    def kill(self, index: int, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Signal the replica and wait for it to exit (SIGTERM: uvicorn finishes the requests it holds)."""
        os.kill(self.processes[index].pid, sig)
        self.processes[index].wait(timeout=timeout)

    def restart(self, index: int, *extra: str) -> None:
        """Start the replica again on its port (no wait), with these options after the fleet's."""
        self.processes[index] = start_replica(self.ports[index], *self.args_of(index), *extra)

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
        for process in self.processes:
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=10)


def index_of(fleet: Fleet, name: str) -> int:
    return [r.name for r in fleet.router.replicas].index(name)


def down_reasons_since(fleet: Fleet, before: list[int]) -> list[list[str]]:
    """Per replica, the reasons it was marked down after `before` (from `down_counts`)."""
    return [[reason for _, reason in list(r.down_reasons)[count:]] for r, count in zip(fleet.router.replicas, before)]


def down_counts(fleet: Fleet) -> list[int]:
    return [len(r.down_reasons) for r in fleet.router.replicas]

"""Router + 3 real replicas (subprocesses) on localhost: prefix affinity, cached_tokens, failover."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn

from prefixserve.router.app import RouterSettings, build_router_app

from server_helpers import free_port

SYSTEM = "You are the fleet's test assistant; the fleet shares this long instruction block. " * 8


def start_replica(port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "prefixserve.cli", "serve", "--port", str(port), "--dtype", "float32",
               "--kv-cache-memory-bytes", str(32 << 20), "--enable-kv-events", "--log-level", "warning"]
    return subprocess.Popen(command, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy in {timeout} s")


@pytest.fixture(scope="module")
def fleet(default_model_dir):
    ports = [free_port() for _ in range(3)]
    processes = [start_replica(port) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in urls:
            wait_healthy(url)
        port = free_port()
        app = build_router_app(RouterSettings(replicas=tuple(urls), health_interval=0.3, sync_interval=0.1))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        router_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # up, with every replica healthy and the scope learned
            try:
                body = httpx.get(router_url + "/health", timeout=1).json()
                if len(body.get("healthy_replicas", [])) == 3 and app.state.router.scoper is not None:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield {"router": router_url, "replicas": urls, "processes": processes, "app": app}
        server.should_exit = True
        thread.join(timeout=10)
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=10)


def chat(url, question, max_tokens=4):
    response = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "prefixserve-tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
    assert response.status_code == 200, response.text
    return response


def test_requests_sharing_a_prefix_land_where_it_is_cached(fleet):
    first = chat(fleet["router"], "Question zero?")
    home = first.headers["x-prefixserve-replica"]
    for i in range(1, 5):
        response = chat(fleet["router"], f"Question {i}?")
        assert response.headers["x-prefixserve-replica"] == home
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    streamed = httpx.post(fleet["router"] + "/v1/completions", timeout=60, json={
        "prompt": "stream through the router", "max_tokens": 4, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    metrics = httpx.get(fleet["router"] + "/metrics", timeout=10).text
    assert "prefixserve_router:routed_requests_total" in metrics
    assert "prefixserve_router:predicted_hit_tokens_total" in metrics


def test_killing_a_replica_mid_run_loses_no_request(fleet):
    router = fleet["app"].state.router
    prompts = [f"Independent prompt number {i} about something else entirely. " * 3 for i in range(12)]

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            async def one(prompt):
                return await client.post(fleet["router"] + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True})

            tasks = [asyncio.create_task(one(p)) for p in prompts]
            # Kill the replica holding the most in-flight requests once they are under way.
            await asyncio.sleep(1.0)
            busiest = max(range(3), key=lambda i: len(router.replicas[i].outstanding))
            os.kill(fleet["processes"][busiest].pid, signal.SIGKILL)
            return busiest, await asyncio.gather(*tasks)

    busiest, responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 12
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in responses)
    assert not router.replicas[busiest].healthy
    assert router.replicas[busiest].num_failures >= 1

"""prefixserve replicas behind the gateways fleets already run, live on loopback: vllm-router's kv_aware policy
fed by our vLLM-format KV events, and SMG's text-based cache_aware policy (both Rust binaries from PyPI wheels).

Marked `platforms`: the README's test command leaves them out (they start five processes each); .ci/run
runs them after it. Each test: two `prefixserve serve` replicas (processes, so one can be killed), the gateway
in front, shared-prefix traffic, then a replica killed mid-run.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from router_fleet import start_replica, wait_healthy
from server_helpers import free_port

from prefixserve.model.default import default_tokenizer_dir, ensure_default_model

pytestmark = pytest.mark.platforms
MODEL = "tiny"
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "tau")


class Fleet:
    """Two replicas publishing KV events on loopback, then whatever gateway `start_gateway` runs."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.processes: list[subprocess.Popen] = []
        self.replicas: list[str] = []
        self.event_endpoints: list[str] = []
        for _ in range(2):
            port, endpoint = free_port(), f"tcp://127.0.0.1:{free_port()}"
            config = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})
            self.processes.append(start_replica(port, "--served-model-name", MODEL, "--kv-events-config", config))
            self.replicas.append(f"http://127.0.0.1:{port}")
            self.event_endpoints.append(endpoint)
        for url in self.replicas:
            wait_healthy(url)
        self.gateway = None

    def start_gateway(self, name: str, command: list[str], port: int) -> None:
        log = self.directory / f"{name}.log"
        process = subprocess.Popen(
            command, stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.directory
        )
        self.processes.append(process)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # a gateway's /health can answer before its workers are in
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited: {log.read_text()[-2000:]}")
            try:
                if (
                    httpx.post(
                        url + "/v1/completions", json={"model": MODEL, "prompt": "ping", "max_tokens": 1}, timeout=5
                    ).status_code
                    == 200
                ):
                    self.gateway = url
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{name} did not route a request within 60 s: {log.read_text()[-2000:]}")

    def kill_replica(self, index: int) -> None:
        self.processes[index].send_signal(signal.SIGKILL)
        self.processes[index].wait(timeout=10)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture
def fleet(tmp_path):
    ensure_default_model()  # once, before two processes would generate it side by side
    fleet = Fleet(tmp_path)
    yield fleet
    fleet.close()


def document(seed: int) -> str:
    rng = random.Random(seed)
    return f"Document {seed}: " + " ".join(rng.choice(WORDS) for _ in range(150)) + "\n"


def ask(url: str, api: str, prefix: str, question: str, max_tokens: int = 4) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of one request through `url`, by the OpenAI or the Anthropic API."""
    if api == "completions":
        body = {"model": MODEL, "prompt": prefix + question, "max_tokens": max_tokens}
        usage = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    if api == "chat":
        body = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}],
        }
        usage = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "system": prefix,
        "messages": [{"role": "user", "content": question}],
    }
    usage = httpx.post(url + "/v1/messages", json=body, timeout=60).json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    return prompt, usage["cache_read_input_tokens"]


def streamed(url: str, path: str, body: dict) -> str:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        return "\n".join(response.iter_lines())


def check_streams_pass_through(url: str) -> None:
    text = streamed(url, "/v1/completions", {"model": MODEL, "prompt": document(99), "max_tokens": 5})
    assert text.rstrip().endswith("data: [DONE]") and text.count("data: ") >= 5
    text = streamed(
        url,
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": document(98)}]},
    )
    assert '"finish_reason":"length"' in text.replace(" ", "") and text.rstrip().endswith("data: [DONE]")
    text = streamed(
        url, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": document(97)}]}
    )
    assert "event: message_stop" in text
    num_prompt, _ = ask(url, "messages", document(96), "and the Anthropic API, not streamed")
    assert num_prompt > 100


def repeats_that_hit(fleet: Fleet, seeds: range, warm_on_a_replica: bool) -> None:
    """Each prefix first computed (on a replica of our choosing, behind the gateway's back, or through the
    gateway), then asked three times more through the gateway: at least 90% must reach the replica holding
    it, as their usage's cached tokens say."""
    num_hits = num_repeats = 0
    for seed in seeds:
        api, prefix = ("completions", "chat")[seed % 2], document(seed)
        ask(fleet.replicas[seed % 2] if warm_on_a_replica else fleet.gateway, api, prefix, "first", max_tokens=1)
        time.sleep(0.3)  # the events reach the gateway
        for repeat in range(3):
            num_prompt, num_cached = ask(fleet.gateway, api, prefix, f"question {repeat}?")
            num_repeats += 1
            num_hits += num_cached >= 0.5 * num_prompt
    print(f"{num_hits} of {num_repeats} repeats reached the replica holding their prefix")
    assert num_hits >= 0.9 * num_repeats, f"{num_hits} of {num_repeats} repeats reached the replica holding them"


def load_with_a_replica_killed(fleet: Fleet, num_requests: int = 40, kill_after: int = 15) -> list:
    """Requests a thread each, one replica SIGKILLed mid-run; returns the failures."""
    failures, threads = [], []

    def one(index: int) -> None:
        body = {"model": MODEL, "prompt": document(index % 5) + f"question {index}", "max_tokens": 8}
        try:
            response = httpx.post(fleet.gateway + "/v1/completions", json=body, timeout=60)
            if response.status_code != 200 or not response.json()["choices"][0]["text"]:
                failures.append((index, response.status_code, response.text[:200]))
        except httpx.HTTPError as error:
            failures.append((index, repr(error)))

    for index in range(num_requests):
        thread = threading.Thread(target=one, args=(index,))
        thread.start()
        threads.append(thread)
        time.sleep(0.05)
        if index == kill_after:
            fleet.kill_replica(0)
    for thread in threads:
        thread.join(timeout=90)
    return failures


@pytest.mark.skipif(shutil.which("vllm-router") is None, reason="vllm-router is not installed: pip install vllm-router")
def test_vllm_router_kv_aware_routes_by_our_events(fleet):
    port = free_port()
    sources = [
        f"--kv-event-source={replica}={endpoint}" for replica, endpoint in zip(fleet.replicas, fleet.event_endpoints)
    ]
    fleet.start_gateway(
        "vllm-router",
        [
            "vllm-router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *fleet.replicas,
            "--policy",
            "kv_aware",
            *sources,
            "--kv-event-block-size",
            "16",
            "--kv-event-model",
            str(default_tokenizer_dir()),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ],
        port,
    )
    # Only the events can tell the gateway where a prefix computed behind its back is.
    repeats_that_hit(fleet, range(8), warm_on_a_replica=True)
    check_streams_pass_through(fleet.gateway)
    assert load_with_a_replica_killed(fleet) == []


@pytest.mark.skipif(shutil.which("smg") is None, reason="smg is not installed: pip install smg")
def test_smg_cache_aware_keeps_repeats_on_their_replica(fleet):
    port = free_port()
    fleet.start_gateway(
        "smg",
        [
            "smg",
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *fleet.replicas,
            "--policy",
            "cache_aware",
            "--prometheus-port",
            str(free_port()),
        ],
        port,
    )
    repeats_that_hit(fleet, range(100, 106), warm_on_a_replica=False)  # SMG learns a prefix from its text
    check_streams_pass_through(fleet.gateway)
    assert load_with_a_replica_killed(fleet) == []

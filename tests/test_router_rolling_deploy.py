"""A rolling deploy through the router (issue 24) on real replicas: each replica in turn is stopped with SIGTERM
(it finishes what it holds) and started again on a new checkpoint under the same name, while clients keep
sending plain and streamed requests. No request fails, and every answer is the text of exactly one version:
the one its system_fingerprint names (a stream is never continued on the other version)."""

import json
import signal
import threading
import time

import httpx
from router_fleet import Fleet, wait_healthy

from prefixserve.model.weights.versions import write_model_version

PROMPTS = [f"Rolling deploy request {i} asks about" for i in range(4)]
MAX_REQUESTS = 200  # bound on the requests sent while the deploy runs
RUN_TIMEOUT = 240.0


def ask(url: str, prompt: str, stream: bool) -> tuple[str, str]:
    """(system_fingerprint, text) of one greedy request; asserts it succeeded."""
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        return answer["system_fingerprint"], answer["choices"][0]["text"]
    pieces, fingerprints = [], set()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                assert len(fingerprints) == 1, fingerprints
                return fingerprints.pop(), "".join(pieces)
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                fingerprints.add(event["system_fingerprint"])
                pieces.extend(choice["text"] for choice in event["choices"])
    raise AssertionError("the stream ended without [DONE]")


def test_a_rolling_deploy_loses_no_request_and_mixes_no_output(default_model_dir, tmp_path):
    new_model = write_model_version(default_model_dir, tmp_path / "v2", seed=24)
    with Fleet(2) as fleet:
        old = {prompt: ask(fleet.url, prompt, False) for prompt in PROMPTS}
        answers, failures, stop = [], [], threading.Event()

        def client(stream: bool) -> None:
            started = time.monotonic()
            for i in range(MAX_REQUESTS // 2):
                if stop.is_set() or time.monotonic() - started > RUN_TIMEOUT:
                    return
                prompt = PROMPTS[i % len(PROMPTS)]
                try:
                    answers.append((prompt, *ask(fleet.url, prompt, stream)))
                except (AssertionError, httpx.HTTPError) as error:
                    failures.append(repr(error))

        clients = [threading.Thread(target=client, args=(stream,)) for stream in (False, True)]
        for thread in clients:
            thread.start()
        try:
            for index in range(2):
                time.sleep(1.0)  # requests in flight on the replica about to go
                fleet.kill(index, signal.SIGTERM, timeout=60)
                fleet.restart(index, "--model", str(new_model))
                wait_healthy(fleet.urls[index])
                fleet.wait_all_healthy()
            time.sleep(1.0)
        finally:
            stop.set()
            for thread in clients:
                thread.join(RUN_TIMEOUT)
        new = {prompt: ask(fleet.url, prompt, False) for prompt in PROMPTS}
        health = httpx.get(fleet.url + "/health", timeout=10).json()
    assert failures == []
    assert not health["mixed"] and len(answers) >= 8
    old_fp, new_fp = {fp for fp, _ in old.values()}, {fp for fp, _ in new.values()}
    assert len(old_fp) == len(new_fp) == 1 and old_fp != new_fp
    for prompt, fingerprint, text in answers:
        versions = {next(iter(old_fp)): old, next(iter(new_fp)): new}
        assert fingerprint in versions
        assert text == versions[fingerprint][prompt][1], (prompt, fingerprint)
    assert any(fp in old_fp for _, fp, _ in answers) and any(fp in new_fp for _, fp, _ in answers)

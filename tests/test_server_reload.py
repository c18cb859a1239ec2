"""POST /v1/admin/reload under load: zero wrong hits, zero failed requests, the old version's blocks reclaimed."""

import asyncio
import concurrent.futures
import threading

import httpx
import pytest
from reload_helpers import two_versions
from server_helpers import LiveServer, assert_openai_error

ADMIN = "admin-secret"
SYSTEM = "You are the assistant of a test suite. Answer briefly and never mention these instructions. " * 3
PROMPTS = [SYSTEM + f"Question {index}: what comes next?" for index in range(6)]
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
NUM_CLIENTS = 3
NUM_BEFORE = 4  # client 0's requests before the reload is asked for
NUM_AFTER = 3  # each client's requests after the reload answered
MAX_REQUESTS_PER_CLIENT = 300  # the bound on the load, however slow the machine


@pytest.fixture(scope="module")
def versions(default_model_dir, tmp_path_factory):
    """{path: cold greedy token ids per prompt} for two versions with the same KV layout."""
    path_b, cold = two_versions(default_model_dir, tmp_path_factory.mktemp("v2") / "model", 11, PROMPTS, GREEDY)
    return default_model_dir, path_b, cold


def complete(client, url, index):
    return client.post(
        url + "/v1/completions", json={"prompt": PROMPTS[index], "return_token_ids": True, **GREEDY}, timeout=120
    )


def engine_call(server, function):
    return asyncio.run(server.engine.call(function))


def test_a_reload_under_load_never_mixes_versions_and_fails_nothing(versions):
    path_a, path_b, cold = versions
    with LiveServer("--model", str(path_a), "--admin-api-key", ADMIN, "--kv-host-cache-bytes", str(64 << 20)) as server:
        fingerprint_a = engine_call(server, lambda core: core.scope.model_fingerprint)
        old_digest = engine_call(server, lambda core: core.scope.digest)
        results, reload_started, reload_done = [], threading.Event(), threading.Event()

        def client_loop(client_index):
            """Requests until the reload has answered and NUM_AFTER more were sent: the swap lands mid-load."""
            num_after = 0
            with httpx.Client() as client:
                for number in range(MAX_REQUESTS_PER_CLIENT):
                    if number == NUM_BEFORE and client_index == 0:
                        reload_started.set()
                    if reload_done.is_set():
                        if num_after == NUM_AFTER:
                            return
                        num_after += 1
                    index = (client_index + number) % len(PROMPTS)
                    response = complete(client, server.url, index)
                    results.append((index, response.status_code, response.json()))

        with concurrent.futures.ThreadPoolExecutor(NUM_CLIENTS) as pool:
            clients = [pool.submit(client_loop, index) for index in range(NUM_CLIENTS)]
            assert reload_started.wait(timeout=120)
            reload = httpx.post(
                server.url + "/v1/admin/reload",
                json={"model": str(path_b)},
                headers={"Authorization": f"Bearer {ADMIN}"},
                timeout=300,
            )
            reload_done.set()
            for future in clients:
                future.result(timeout=300)
        assert reload.status_code == 200, reload.text
        report = reload.json()
        assert report["previous_fingerprint"] == fingerprint_a != report["model_fingerprint"]
        assert report["reclaimed_blocks"] > 0  # the old version's blocks were freed at the swap

        fingerprints = {"fp_" + fingerprint_a[:16]: path_a, "fp_" + report["model_fingerprint"][:16]: path_b}
        assert len(results) < NUM_CLIENTS * MAX_REQUESTS_PER_CLIENT  # every client saw the reload answer
        served_by = {path_a: 0, path_b: 0}
        for index, status, body in results:
            assert status == 200, body  # zero failed requests
            path = fingerprints[body["system_fingerprint"]]
            served_by[path] += 1
            assert body["choices"][0]["token_ids"] == cold[path][index]  # zero wrong hits
        assert served_by[path_a] > 0 and served_by[path_b] > 0

        # Nothing of the old scope is left: every pooled block chains from the new version's scope.
        def roots(core):
            memo = {}
            return {core.cache._scope_of(block, memo) for block in core.cache._index.values()}, core.scope.digest

        pooled_scopes, new_digest = engine_call(server, roots)
        assert pooled_scopes <= {new_digest} and old_digest not in pooled_scopes
        host = server.engine.engine.tiers["host"]
        from prefixserve.tiers.record import read_header

        assert all(read_header(host.get([key])[0]).scope_digest == new_digest for key in host.keys())
        engine_call(server, lambda core: core.cache.check_integrity())


def test_reload_is_for_the_operator_only_and_names_bad_input(versions, tmp_path):
    path_a, _, _ = versions
    with LiveServer("--model", str(path_a), "--admin-api-key", ADMIN, "--api-key", "tenant-key") as server:
        url = server.url + "/v1/admin/reload"
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert_openai_error(httpx.post(url, timeout=30), 401)
        assert_openai_error(
            httpx.post(url, headers={"Authorization": "Bearer tenant-key"}, timeout=30), 403, code="admin_only"
        )
        assert_openai_error(
            httpx.post(url, headers=admin, json={"model": str(tmp_path / "nope")}, timeout=60),
            400,
            param="model",
            code="invalid_model",
        )
        assert_openai_error(httpx.post(url, headers=admin, json={"model": 3}, timeout=30), 400, param="model")
        assert_openai_error(httpx.post(url, headers=admin, json={"weights": "x"}, timeout=30), 400)
        assert_openai_error(
            httpx.post(url, headers=admin, json={"purge_remote": "yes"}, timeout=30), 400, param="purge_remote"
        )
        assert_openai_error(
            httpx.post(url, headers=admin, json={"purge_remote": True}, timeout=30), 400, param="purge_remote"
        )  # no remote tier here
        assert_openai_error(httpx.post(url, headers=admin, content=b"{not json", timeout=30), 400, code="invalid_json")
        ok = httpx.post(
            server.url + "/v1/completions",
            headers={"Authorization": "Bearer tenant-key"},
            json={"prompt": "still serving", "max_tokens": 2},
            timeout=60,
        )
        assert ok.status_code == 200  # a failed reload changed nothing


def test_reload_is_off_without_an_admin_key(versions):
    path_a, _, _ = versions
    with LiveServer("--model", str(path_a)) as server:
        assert_openai_error(httpx.post(server.url + "/v1/admin/reload", timeout=30), 404, code="admin_disabled")

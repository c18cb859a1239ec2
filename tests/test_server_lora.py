"""LoRA adapters through the server: `--enable-lora --lora-modules name=path`, the adapter's name as a model in
/v1/models and in requests (chat, completions), the same tokens as the offline engine, and vLLM's runtime load and
unload routes behind the admin key, a bad adapter refused while the server keeps serving."""

import httpx
import pytest
from lora_helpers import save_adapter
from server_helpers import LiveServer

from prefixserve import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
ADMIN = "ops-admin-key"
BASE = "prefixserve-tiny"
PROMPT = "Write a short line about the sea, the wind and the gulls that follow the fishing boats home."


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return save_adapter(tmp_path_factory.mktemp("lora") / "sea", 11)


@pytest.fixture(scope="module")
def server(adapter_dir):
    options = ("--enable-lora", "--lora-modules", f"sea={adapter_dir}", "--admin-api-key", ADMIN)
    with LiveServer(*options, "--allow-runtime-lora-updating") as live:
        yield live


def complete(server, model, prompt=PROMPT):
    response = httpx.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_the_adapter_is_a_model_and_serves_what_the_offline_engine_does(server, adapter_dir):
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["prefixserve-tiny", "sea"]
    assert models[1]["parent"] == "prefixserve-tiny" and models[1]["root"] == adapter_dir
    assert httpx.get(server.url + "/v1/models/sea", timeout=30).json()["id"] == "sea"
    adapted, base = complete(server, "sea"), complete(server, "prefixserve-tiny")
    llm = LLM(enable_lora=True, dtype="float32", kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    (offline,) = llm.generate([PROMPT], params, use_tqdm=False, lora_request=LoRARequest("sea", 1, adapter_dir))
    assert adapted["choices"][0]["token_ids"] == offline.token_ids
    assert base["choices"][0]["token_ids"] != offline.token_ids
    again = complete(server, "sea")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the adapter's own blocks hit
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "sea", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == adapted["model"] == "sea" and base["model"] == BASE  # as vLLM names them
    for path, body in (
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}),
        ("/v1/responses", {"max_output_tokens": 4, "input": "Hello"}),
    ):
        answers = [httpx.post(server.url + path, json={"model": m, **body}, timeout=60) for m in ("sea", BASE)]
        assert all(answer.status_code == 200 for answer in answers), (path, answers[0].text)
        written = [str(answer.json().get("content") or answer.json().get("output")) for answer in answers]
        assert written[0] != written[1], path  # the adapter wrote it
        assert [answer.json()["model"] for answer in answers] == ["sea", BASE], path
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'vllm:lora_requests_info{max_lora="4"' in metrics  # vLLM's gauge, with the adapters running and waiting
    unknown = httpx.post(server.url + "/v1/completions", json={"model": "lake", "prompt": "hi"}, timeout=30)
    assert unknown.status_code == 404 and "'sea'" in unknown.json()["error"]["message"]


def test_adapters_load_and_unload_at_run_time_behind_the_admin_key(server, adapter_dir, tmp_path):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    body = {"lora_name": "harbour", "lora_path": adapter_dir}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=30).status_code == 401
    loaded = httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=admin, timeout=60)
    assert loaded.status_code == 200 and "harbour" in loaded.text
    assert complete(server, "harbour")["choices"][0]["token_ids"] == complete(server, "sea")["choices"][0]["token_ids"]
    bad = httpx.post(
        server.url + "/v1/load_lora_adapter",
        json={"lora_name": "broken", "lora_path": str(tmp_path / "nowhere")},
        headers=admin,
        timeout=30,
    )
    assert bad.status_code == 400 and "is neither a directory" in bad.json()["error"]["message"]
    assert complete(server, "sea")  # still serving
    gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "harbour"}, headers=admin, timeout=30)
    assert gone.status_code == 200
    after = httpx.post(server.url + "/v1/completions", json={"model": "harbour", "prompt": "hi"}, timeout=30)
    assert after.status_code == 404


def test_lora_flags_are_checked_before_serving(adapter_dir, tmp_path):
    with pytest.raises(SystemExit, match="need --enable-lora"):
        LiveServer("--lora-modules", f"sea={adapter_dir}")
    with pytest.raises(SystemExit, match="is neither a directory"):
        LiveServer("--enable-lora", "--lora-modules", f"sea={tmp_path / 'nowhere'}")


def test_a_router_keys_an_adapters_request_as_the_replica_does(server, adapter_dir):
    """Adapter affinity: /v1/cache/info names each adapter's fingerprint, so a router's keys for a request naming
    it are the replica's (and differ from the base's): it goes where that adapter's prefix is cached."""
    from prefixserve.router.route_keys import RouteKeys

    info = httpx.get(server.url + "/v1/cache/info", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
    keys = RouteKeys.of(info)
    engine = server.engine.engine
    request = engine.make_request(PROMPT, SamplingParams(max_tokens=1), lora_request=LoRARequest("sea", 1, adapter_dir))
    ours = engine.keyer.keys(request.scope_digest, request.prompt_token_ids, request.private_from)
    routed = keys.route_request(request.prompt_token_ids, None, "sea")
    assert routed.keys == ours and routed.scope_digest == request.scope_digest
    assert keys.route_request(request.prompt_token_ids, None, BASE).keys != ours

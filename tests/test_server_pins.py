"""POST /v1/cache/pin, GET /v1/cache/pins, DELETE /v1/cache/pins/{id}: the operator keeps prefixes resident."""

import json

import httpx
import pytest
from server_helpers import LiveServer, assert_openai_error

ADMIN = "admin-secret"
SYSTEM = "You are the assistant of the pin endpoint tests; keep every answer short and polite. " * 4
POOL = str(48 * 16 * 16384)  # 48 blocks of the built-in model in fp32: a flood evicts what is not pinned


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"key-acme": "acme", "key-beta": "beta"}))
    with LiveServer(
        "--api-keys-file",
        str(keys),
        "--admin-api-key",
        ADMIN,
        "--kv-cache-memory-bytes",
        POOL,
        "--hot-prefix-min-requests",
        "0",
    ) as live:
        yield live


def admin(server, method, path, **kwargs):
    return httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120, **kwargs)


def tenant_chat(server, key, content):
    return httpx.post(
        server.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
            "max_tokens": 2,
            "temperature": 0,
        },
        timeout=120,
    )


def flood(server):
    for index in range(16):
        response = httpx.post(
            server.url + "/v1/completions",
            headers={"Authorization": "Bearer key-beta"},
            json={"prompt": f"one-off {index} " + "lorem ipsum dolor sit " * 12, "max_tokens": 1},
            timeout=120,
        )
        assert response.status_code == 200


def test_a_tenant_system_prompt_pinned_by_the_operator_survives_a_flood(server):
    pin = admin(
        server,
        "POST",
        "/v1/cache/pin",
        json={"messages": [{"role": "system", "content": SYSTEM}], "tenant": "acme", "ttl": 600},
    )
    assert pin.status_code == 200, pin.text
    body = pin.json()
    assert body["object"] == "cache.pin" and body["tenant"] == "acme" and body["num_blocks"] > 0
    assert "token_ids" not in body and body["expires_at"] is not None
    flood(server)
    hit = tenant_chat(server, "key-acme", "What is pinned?")
    assert hit.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (body["num_blocks"] - 1) * 16
    other = tenant_chat(server, "key-beta", "Do I share acme's pin?")  # another tenant's scope: no hit
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    listing = admin(server, "GET", "/v1/cache/pins").json()
    assert [entry["id"] for entry in listing["data"]] == [body["id"]]
    deleted = admin(server, "DELETE", f"/v1/cache/pins/{body['id']}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert admin(server, "GET", "/v1/cache/pins").json()["data"] == []


def test_bad_pins_are_4xx_naming_the_cause(server):
    assert_openai_error(admin(server, "POST", "/v1/cache/pin", json={}), 400, param="prompt")
    assert_openai_error(
        admin(server, "POST", "/v1/cache/pin", json={"prompt": "x", "messages": [{"role": "user", "content": "y"}]}),
        400,
        param="prompt",
    )
    assert_openai_error(admin(server, "POST", "/v1/cache/pin", json={"prompt": SYSTEM, "ttl": 0}), 422, param="ttl")
    assert_openai_error(admin(server, "POST", "/v1/cache/pin", json={"prompt": SYSTEM, "ttl": "60"}), 422, param="ttl")
    assert_openai_error(
        admin(server, "POST", "/v1/cache/pin", json={"prompt": SYSTEM, "tenant": "nobody"}),
        400,
        param="tenant",
        code="unknown_tenant",
    )
    assert_openai_error(admin(server, "POST", "/v1/cache/pin", json={"prompt": "tiny"}), 400, code="pin_failed")
    assert_openai_error(admin(server, "POST", "/v1/cache/pin", json={"prompt": [99999999]}), 400)
    assert_openai_error(admin(server, "POST", "/v1/cache/pin", json={"prompt": []}), 400)
    assert_openai_error(admin(server, "DELETE", "/v1/cache/pins/pin-unknown"), 404, code="pin_not_found")


def test_tenants_and_anonymous_callers_cannot_pin(server):
    for headers, status in (({}, 401), ({"Authorization": "Bearer key-acme"}, 403)):
        assert_openai_error(
            httpx.post(server.url + "/v1/cache/pin", headers=headers, json={"prompt": SYSTEM}, timeout=30), status
        )
        assert_openai_error(httpx.get(server.url + "/v1/cache/pins", headers=headers, timeout=30), status)
        assert_openai_error(httpx.delete(server.url + "/v1/cache/pins/x", headers=headers, timeout=30), status)

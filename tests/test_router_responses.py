"""OpenAI's Responses API through the router: a conversation over previous_response_id stays on the replica that
holds it (and so its cache), stored responses are found there, and a stream is relayed with its owner learnt."""

import json
import time

import httpx
import pytest
from router_fleet import Fleet

MODEL = "prefixserve-tiny"
INSTRUCTIONS = "You are a careful agent. Answer briefly. " * 10


@pytest.fixture(scope="module")
def fleet():
    with Fleet(num_replicas=2) as fleet:
        yield fleet


def turn(fleet, prompt, previous=None, stream=False):
    body = {"model": MODEL, "instructions": INSTRUCTIONS, "input": prompt, "max_output_tokens": 8, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    if not stream:
        response = httpx.post(fleet.url + "/v1/responses", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json(), response.headers["x-prefixserve-replica"]
    with httpx.stream("POST", fleet.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
        replica = response.headers["x-prefixserve-replica"]
    return json.loads(lines[-1][5:])["response"], replica


def test_a_conversation_stays_on_the_replica_that_holds_it(fleet):
    for first_prompt in ("Name a color.", "Name a fruit.", "Name a city."):  # the policy may start anywhere
        answer, home = turn(fleet, first_prompt)
        for question in ("Another one.", "And one more.", "The last one."):
            following, replica = turn(fleet, question, answer["id"])
            assert replica == home
            # everything the last turn computed was read from its replica's cache (all but a partial block)
            assert (
                following["usage"]["input_tokens_details"]["cached_tokens"]
                >= (answer["usage"]["total_tokens"] // 16 - 1) * 16
            )
            answer = following


def test_a_streamed_turn_names_its_owner(fleet):
    answer, home = turn(fleet, "Stream a word.", stream=True)
    assert answer["id"].startswith("resp_")
    following, replica = turn(fleet, "Again.", answer["id"], stream=True)
    assert replica == home and following["previous_response_id"] == answer["id"]


def test_stored_responses_are_found_where_they_live(fleet):
    answer, home = turn(fleet, "Keep this answer.")
    got = httpx.get(f"{fleet.url}/v1/responses/{answer['id']}", timeout=30)
    assert got.status_code == 200 and got.json()["id"] == answer["id"]
    assert got.headers["x-prefixserve-replica"] == home
    items = httpx.get(f"{fleet.url}/v1/responses/{answer['id']}/input_items", timeout=30).json()
    assert items["data"][0]["content"][0]["text"] == "Keep this answer."
    # one made on a replica directly (the router never saw it) is found by asking each replica
    direct = httpx.post(
        fleet.urls[1] + "/v1/responses", json={"model": MODEL, "input": "Directly.", "max_output_tokens": 2}, timeout=60
    ).json()
    found = httpx.get(f"{fleet.url}/v1/responses/{direct['id']}", timeout=30)
    assert found.status_code == 200 and found.headers["x-prefixserve-replica"] == "replica-1"
    assert httpx.delete(f"{fleet.url}/v1/responses/{answer['id']}", timeout=30).json()["deleted"] is True
    gone = httpx.get(f"{fleet.url}/v1/responses/{answer['id']}", timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"


def test_models_retrieve_through_the_router(fleet):
    response = httpx.get(f"{fleet.url}/v1/models/{MODEL}", timeout=30)
    assert response.status_code == 200 and response.json()["id"] == MODEL


def test_a_conversation_survives_its_replica():
    """The replica holding a conversation is killed: the router sends the next turn, the whole conversation as
    input, to the other replica, which answers it (prefilling what it lacks) and holds it from then on."""
    with Fleet(num_replicas=2) as fleet:
        answer, home = turn(fleet, "Name a color.")
        answer, again = turn(fleet, "Another one.", answer["id"])
        assert again == home
        fleet.kill(int(home.rsplit("-", 1)[1]))
        deadline = time.monotonic() + 30
        while any(r.healthy for r in fleet.router.replicas if r.name == home):  # the router notices
            assert time.monotonic() < deadline
            time.sleep(0.1)
        moved, elsewhere = turn(fleet, "And a third.", answer["id"])
        assert elsewhere != home and moved["usage"]["input_tokens"] > answer["usage"]["total_tokens"]
        following, stays = turn(fleet, "And a fourth.", moved["id"])
        assert stays == elsewhere and following["usage"]["input_tokens_details"]["cached_tokens"] > 0

"""The live server through the official openai client: chat, completions, streaming, cached_tokens."""

import pytest
from server_helpers import LiveServer, openai_client

SYSTEM = "You are prefixserve's test assistant. Answer briefly and precisely. " * 8


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def chat(client, question, **kwargs):
    return client.chat.completions.create(
        model="prefixserve-tiny",
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        **kwargs,
    )


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list().data] == ["prefixserve-tiny"]


def test_shared_system_prompt_is_cached_and_text_unchanged(server, client):
    tokenizer = server.engine.engine.tokenizer
    first = chat(client, "What is a prefix cache?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat(client, "What is a prefix cache?")
    assert second.choices[0].message.content == first.choices[0].message.content
    system_ids = tokenizer.encode_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    other = chat(client, "And what is a radix tree?")
    # Everything up to the end of the system turn is shared: its full blocks are reused.
    assert other.usage.prompt_tokens_details.cached_tokens >= len(system_ids) // 16 * 16
    assert second.usage.prompt_tokens_details.cached_tokens == (second.usage.prompt_tokens - 1) // 16 * 16
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens


def test_streaming_chat_matches_non_streaming(client):
    reference = chat(client, "Stream this answer.").choices[0].message.content
    chunks = list(chat(client, "Stream this answer.", stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 12
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_completions_plain_streamed_batched_and_token_ids(client):
    plain = client.completions.create(
        model="prefixserve-tiny", prompt="Paged attention is", max_tokens=8, temperature=0
    )
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 8
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="prefixserve-tiny", prompt="Paged attention is", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == plain.choices[0].text
    batch = client.completions.create(
        model="prefixserve-tiny", prompt=["Paged attention is", "Radix trees are"], max_tokens=4, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert (
        batch.choices[0].text
        == client.completions.create(model="prefixserve-tiny", prompt="Paged attention is", max_tokens=4, temperature=0)
        .choices[0]
        .text
    )
    ids = client.completions.create(model="prefixserve-tiny", prompt=[1, 500, 600, 700], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_n_samples_and_seed(client):
    result = client.completions.create(
        model="prefixserve-tiny", prompt="Sample me", max_tokens=6, temperature=1.0, n=3, seed=11
    )
    assert len(result.choices) == 3
    again = client.completions.create(
        model="prefixserve-tiny", prompt="Sample me", max_tokens=6, temperature=1.0, n=3, seed=11
    )
    assert [c.text for c in result.choices] == [c.text for c in again.choices]
    assert result.usage.completion_tokens == 18

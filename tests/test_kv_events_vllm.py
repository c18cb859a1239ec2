"""vLLM-format KV events over ZMQ (engine/kv_event_publisher.py), read by a decoder written here from vLLM's
published schema (vllm/distributed/kv_events.py, 0.32), not from ours: a batch is an array [ts, events, rank],
each event a map tagged by its class name, fields in vLLM's order."""

from __future__ import annotations

import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from prefixserve import LLM, SamplingParams
from prefixserve.cache.keys import unpack_tokens
from prefixserve.config import EngineConfig, KVEventsConfig
from prefixserve.engine.kv_event_publisher import binds, is_loopback


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(Event):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(Event):
    pass


class VLLMBatch(Batch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=VLLMBatch)
SHARED = "a system prompt that every request of this test shares, long enough for several blocks " * 3


def make_llm(**options) -> LLM:
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", **options.pop("events", {})}
    return LLM(
        kv_events_config=events,
        dtype="float32",
        kv_cache_memory_bytes=options.pop("pool", 8 << 20),
        log_stats=False,
        **options,
    )


def subscribe(endpoint: str, topic: bytes = b"") -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, topic)
    socket.connect(endpoint)
    time.sleep(0.3)  # a SUB socket misses what was sent before it joined
    return socket


def receive_all(socket: zmq.Socket, timeout_ms: int = 500) -> list[tuple[bytes, int, VLLMBatch]]:
    received = []
    while socket.poll(timeout_ms):
        topic, seq, payload = socket.recv_multipart()
        received.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
    socket.close(linger=0)
    return received


def mirror(batches) -> dict[int, BlockStored]:
    """What a subscriber knows the engine's pool holds: hash -> the event that stored it."""
    held: dict[int, BlockStored] = {}
    for _, _, batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium == "GPU":
                parent = event.parent_block_hash
                assert parent is None or parent in held, "a block's parent was announced before it"
                for block_hash in event.block_hashes:
                    held[block_hash] = event
            elif isinstance(event, BlockRemoved) and event.medium == "GPU":
                for block_hash in event.block_hashes:
                    held.pop(block_hash)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
    return held


def low64(key: bytes) -> int:
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def test_a_subscriber_mirrors_the_pool_exactly_through_stores_evictions_and_a_clear():
    llm = make_llm(pool=2 << 20)  # a small pool: the workload evicts
    socket = subscribe(llm.engine.kv_events.endpoint)
    prompts = [f"{i}: " + SHARED + "tail " * (3 * i) for i in range(24)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    llm.engine.kv_events.flush()
    batches = receive_all(socket)
    assert [seq for _, seq, _ in batches] == list(range(len(batches)))  # sequence numbers from 0, no gap
    events = [event for _, _, batch in batches for event in batch.events]
    assert any(isinstance(event, BlockRemoved) for event in events), "the workload should have evicted"
    assert all(batch.data_parallel_rank == 0 and batch.ts > 1e9 for _, _, batch in batches)
    held = mirror(batches)
    cached = {low64(key): llm.engine.cache.get(key) for key in llm.engine.cache.keys()}
    assert set(held) == set(cached)
    for block_hash, event in held.items():
        assert event.block_size == 16 and event.token_ids == list(unpack_tokens(cached[block_hash].token_bytes))
        assert event.lora_id is None and event.lora_name is None and event.locality == "LOCAL"
        assert len(event.extra_keys) == len(event.block_hashes)
    socket = subscribe(llm.engine.kv_events.endpoint)
    llm.engine.cache.clear()
    llm.engine.kv_events.step_done()
    llm.engine.kv_events.flush()
    cleared = receive_all(socket)
    assert any(isinstance(event, AllBlocksCleared) for _, _, batch in cleared for event in batch.events)
    llm.close()


def test_each_tenant_scope_has_its_own_extra_keys_and_hashes():
    llm = make_llm()
    socket = subscribe(llm.engine.kv_events.endpoint)
    engine = llm.engine
    for salt in ("tenant-a", "tenant-b"):
        request = engine.add_request(SHARED, SamplingParams(max_tokens=1), cache_salt=salt)
        engine.run_until_finished([request.request_id])
    engine.kv_events.flush()
    stored = [event for _, _, batch in receive_all(socket) for event in batch.events if isinstance(event, BlockStored)]
    first_blocks = [event for event in stored if event.parent_block_hash is None]
    assert len(first_blocks) == 2 and first_blocks[0].token_ids == first_blocks[1].token_ids
    tags = {event.extra_keys[0] for event in first_blocks}
    assert len(tags) == 2, "two tenants' first blocks must not look alike to a scorer"
    assert first_blocks[0].block_hashes != first_blocks[1].block_hashes
    assert not any("tenant-" in str(event.extra_keys) for event in stored), "a raw salt left the process"
    llm.close()


def test_a_subscriber_that_missed_batches_gets_them_from_the_replay_socket():
    llm = make_llm(events={"replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv@replica-1"})
    publisher = llm.engine.kv_events
    llm.generate([SHARED + "first"], SamplingParams(max_tokens=2), use_tqdm=False)  # nobody listening yet
    publisher.flush()
    late = subscribe(publisher.endpoint, b"kv@")
    llm.generate(["another prompt, after the subscriber joined, " * 8], SamplingParams(max_tokens=2), use_tqdm=False)
    publisher.flush()
    live = receive_all(late)
    assert live and all(topic == b"kv@replica-1" for topic, _, _ in live)
    first_seen = live[0][1]
    assert first_seen > 0, "the subscriber should have missed the first batches"
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while dealer.poll(2000):
        _, topic, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert topic == b"" and payload == b""
            break
        replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    dealer.close(linger=0)
    assert [seq for seq, _ in replayed] == list(range(first_seen + len(live)))
    assert [msgspec.msgpack.encode(batch) for _, batch in replayed[first_seen:]] == [
        msgspec.msgpack.encode(batch) for _, _, batch in live
    ]
    llm.close()


def test_a_lower_tier_publishes_its_blocks_under_its_own_medium():
    llm = make_llm(pool=2 << 20, kv_host_cache_bytes=64 << 20)
    socket = subscribe(llm.engine.kv_events.endpoint)
    prompts = [f"{i}: " + SHARED + "tail " * (3 * i) for i in range(16)]
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    time.sleep(0.2)  # host-tier events come from the tier's side; the publisher wakes on its own
    llm.engine.kv_events.flush()
    media = {
        event.medium for _, _, batch in receive_all(socket) for event in batch.events if isinstance(event, BlockStored)
    }
    assert media == {"GPU", "CPU"}
    llm.close()


def test_the_config_takes_vllms_fields_and_defaults_with_the_endpoint_on_loopback():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert (
        config.publisher,
        config.endpoint,
        config.replay_endpoint,
        config.buffer_steps,
        config.hwm,
        config.max_queue_size,
        config.topic,
    ) == ("zmq", "tcp://127.0.0.1:5557", None, 10_000, 100_000, 100_000, "")
    assert KVEventsConfig.parse({}).publisher == "null"
    assert EngineConfig(kv_events_config={"enable_kv_cache_events": True}).kv_events_config == config
    for bad, names in (
        ("{", "JSON"),
        ('{"endpoint": "http://x:1"}', "endpoint"),
        ('{"hwm": -1}', "hwm"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_step": 5}', "buffer_steps"),
    ):
        with pytest.raises(ValueError, match=names):
            KVEventsConfig.parse(bad)
    llm = LLM(
        kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        log_stats=False,
    )
    assert llm.engine.kv_events.endpoint is None and llm.engine.events is not None  # kept, not sent
    llm.close()


def test_which_endpoints_bind_and_which_are_this_machine_only():
    assert binds("tcp://*:5557") and not is_loopback("tcp://*:5557")
    assert binds("tcp://127.0.0.1:5557") and is_loopback("tcp://127.0.0.1:5557")
    assert binds("tcp://[::1]:5557") and binds("tcp://localhost:5557") and binds("ipc:///tmp/kv")
    assert not binds("tcp://10.1.2.3:5557") and not is_loopback("tcp://10.1.2.3:5557")


def test_a_busy_endpoint_is_named_with_the_fix():
    first = make_llm()
    with pytest.raises(ValueError, match="port 0 picks one"):
        make_llm(events={"endpoint": first.engine.kv_events.endpoint})
    first.close()

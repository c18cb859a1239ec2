"""engine/request_log.py: what the engine's outputs record (keys, lengths, tenant; never tokens), the bound,
thread safety, and the hook in the output processor on a real engine run."""

import threading

import pytest

from prefixserve.engine.request import Request, RequestStatus
from prefixserve.engine.request_log import RequestLog, RequestLogEntry
from prefixserve.engine.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int = 40, tenant=None) -> Request:
    request = Request(request_id, list(range(num_prompt_tokens)), SamplingParams(), scope_digest=b"s", tenant=tenant)
    request.metrics.arrival_time = 7.0
    return request


def admit(request: Request, num_cached_tokens: int = 0) -> None:
    """What the scheduler's first admission of `request` sets."""
    request.metrics.first_scheduled_time = 8.0
    request.num_cached_tokens = num_cached_tokens


def test_first_output_records_the_prompt_keys_and_finish_the_output_keys():
    log = RequestLog()
    request = make_request("r1", tenant="acme")
    log.observe(request)  # not admitted yet: nothing recorded
    assert len(log) == 0
    admit(request, 16)
    request.block_keys = [b"k0", b"k1"]  # the prompt's full blocks, as the scheduler keys them
    log.observe(request)
    request.block_keys += [b"k2"]  # decoding filled another block
    log.observe(request)  # a later output of a running request changes nothing
    assert log.snapshot() == [RequestLogEntry(7.0, "acme", (b"k0", b"k1"), 40)]
    request.block_keys += [b"k3"]
    request.status = RequestStatus.FINISHED
    log.observe(request)
    assert log.snapshot() == [RequestLogEntry(7.0, "acme", (b"k0", b"k1"), 40, (b"k2", b"k3"), finished=True)]


def test_a_request_finished_on_its_first_output_has_no_output_keys():
    log = RequestLog()
    request = make_request("r1")
    admit(request)
    request.block_keys, request.status = [b"k0"], RequestStatus.FINISHED
    log.observe(request)
    assert log.snapshot() == [RequestLogEntry(7.0, None, (b"k0",), 40, (), finished=True)]


def test_the_oldest_entries_go_first_beyond_the_bound():
    log = RequestLog(max_entries=3)
    for i in range(5):
        request = make_request(f"r{i}", num_prompt_tokens=i + 1)
        admit(request)
        log.observe(request)
    assert [entry.num_prompt_tokens for entry in log.snapshot()] == [3, 4, 5]
    with pytest.raises(ValueError, match="at least 1 entry"):
        RequestLog(max_entries=0)


def test_concurrent_recording_and_reading_keep_the_bound():
    log = RequestLog(max_entries=100)

    def record(offset: int) -> None:
        for i in range(500):
            request = make_request(f"{offset}-{i}")
            admit(request)
            request.status = RequestStatus.FINISHED
            log.observe(request)

    threads = [threading.Thread(target=record, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        assert len(log.snapshot()) <= 100
    for thread in threads:
        thread.join()
    assert len(log) == 100


def test_the_engine_logs_each_request_it_serves():
    from prefixserve import LLM
    from prefixserve import SamplingParams as Params

    llm = LLM(dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=16)
    prompt = list(range(1, 50))  # 3 full blocks and a tail of 1
    llm.generate([{"prompt_token_ids": prompt}], Params(max_tokens=20, temperature=0, ignore_eos=True))
    (entry,) = llm.engine.outputs.request_log.snapshot()
    assert entry.num_prompt_tokens == 49 and len(entry.prompt_keys) == 3 and entry.finished
    # 49 + 20 tokens: the 19 computed outputs fill block 3 (from token 48) and most of block 4: one output block.
    assert len(entry.output_keys) == 1
    assert entry.prompt_keys == tuple(llm.engine.keyer.keys(llm.engine.scope.digest, prompt))
    assert entry.tenant is None and not hasattr(entry, "token_ids")

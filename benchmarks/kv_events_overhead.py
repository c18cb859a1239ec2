"""What publishing vLLM-format KV events costs the engine step, on the system-prompt workload.

Two engines in one process, the same model and settings, one with `kv_events_config` publishing over ZMQ on
loopback to a subscriber that decodes every batch (a gateway's side, in a thread), one without. Rounds
alternate between them (this machine's speed drifts); each round is the system-prompt workload (32 requests
sharing a 2,000-token prefix, 50 own tokens, 32 output tokens) on an emptied cache, so every round stores
and announces the same blocks. The figure is the engine's time in `step()`, summed over the round.

    python benchmarks/kv_events_overhead.py [--rounds 6] [--plot kv_events_overhead.png]

The vllm: metrics cost the engine nothing it did not already pay: they are read from the snapshot at scrape
time, and per-request latencies are observed by the server after the request finishes.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from workloads import build_workloads


def step_seconds(llm, turns) -> float:
    """Run one round's turns through the engine; seconds spent in step()."""
    from prefixserve import SamplingParams

    engine = llm.engine
    engine.cache.clear()
    ids = [
        engine.add_request(
            turn.prompt_token_ids, SamplingParams(max_tokens=turn.max_tokens, ignore_eos=True, temperature=0)
        ).request_id
        for turn in turns
    ]
    spent = 0.0
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        engine.step()
        spent += time.perf_counter() - began
    assert ids
    return spent


def drain(endpoint: str, stop: threading.Event, counts: list[int]) -> None:
    """A gateway's side: subscribe and decode every batch."""
    import msgspec
    import zmq

    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    decoder = msgspec.msgpack.Decoder()
    while not stop.is_set():
        if socket.poll(100):
            _, _, payload = socket.recv_multipart()
            counts[0] += len(decoder.decode(payload)[1])
    socket.close(linger=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--plot", default="kv_events_overhead.png")
    args = parser.parse_args()
    from prefixserve import LLM
    from prefixserve.model import kernels

    turns = build_workloads()["system-prompt"].next_round(0, [])
    options = dict(dtype="float32", kv_cache_memory_bytes=256 << 20, log_stats=False)
    quiet = LLM(**options)
    loud = LLM(kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"}, **options)
    stop, counts = threading.Event(), [0]
    subscriber = threading.Thread(target=drain, args=(loud.engine.kv_events.endpoint, stop, counts), daemon=True)
    subscriber.start()
    step_seconds(quiet, turns), step_seconds(loud, turns)  # warm-up: weights packed, pages touched
    off, on = [], []
    for _ in range(args.rounds):
        off.append(step_seconds(quiet, turns))
        on.append(step_seconds(loud, turns))
    loud.engine.kv_events.flush()
    time.sleep(0.3)
    stop.set()
    subscriber.join()
    ratios = [b / a for a, b in zip(off, on)]
    print(f"system-prompt, {len(turns)} requests a round, kernel variant {kernels.variant()}, {args.rounds} rounds")
    print(f"{'round':>5} {'events off (s)':>15} {'events on (s)':>14} {'on / off':>9}")
    for index, (a, b, ratio) in enumerate(zip(off, on, ratios)):
        print(f"{index:>5} {a:>15.3f} {b:>14.3f} {ratio:>9.3f}")
    print(
        f"median on / off: {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
        f"{counts[0]} events decoded by the subscriber, {loud.engine.kv_events.num_batches} batches"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    positions = range(len(off))
    axis.bar([p - 0.2 for p in positions], off, width=0.4, label="events off")
    axis.bar([p + 0.2 for p in positions], on, width=0.4, label="events on (ZMQ, decoded)")
    axis.set_xlabel("round")
    axis.set_ylabel("seconds in engine.step()")
    axis.set_title("system-prompt: KV event publishing, step time")
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.plot)
    print(f"saved {args.plot}")
    quiet.close()
    loud.close()


if __name__ == "__main__":
    main()

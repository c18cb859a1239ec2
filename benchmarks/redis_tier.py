"""The remote tier's primitives against a private local redis-server (or --url), on this machine.

    python benchmarks/redis_tier.py [--url redis://host:port/db] [--blocks 125] [--block-kib 256] [--repeats 20]

contains: one pipelined round trip of EXISTS over `--blocks` present keys; get: `--blocks` records of
`--block-kib` KiB each (32 MiB at the defaults), at GET_BATCH_KEYS keys per round trip and at a few other
batch sizes; put (synchronous) and put_async (queue + writer thread, measured to `flush`): fresh keys every
round. Prints medians; nothing is written to disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

from prefixserve.tiers import BlockRecord
from prefixserve.tiers import redis as redis_module
from prefixserve.tiers.redis import RedisTier

SCOPE = b"\x42" * 32


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            directory,
            "--maxmemory",
            "2gb",
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.02)
    process.kill()
    raise RuntimeError("redis-server did not start")


def make_chain(round_: int, num_blocks: int, payload: bytes) -> list[BlockRecord]:
    records, parent = [], None
    for index in range(num_blocks):
        key = round_.to_bytes(8, "little") + index.to_bytes(8, "little") + b"\x00" * 16
        records.append(BlockRecord(key, parent, SCOPE, tuple(range(16)), "float32", (len(payload) // 4,), payload))
        parent = key
    return records


def median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="an existing Redis (default: start a private one)")
    parser.add_argument("--blocks", type=int, default=125)
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        process, url = (None, args.url) if args.url else start_redis(directory)
        try:
            run(url, args)
        finally:
            if process is not None:
                process.kill()
                process.wait()


def run(url: str, args: argparse.Namespace) -> None:
    payload = os.urandom(args.block_kib << 10)
    num_bytes = args.blocks * len(payload)
    with RedisTier(url, scope_digest=SCOPE) as tier:
        chain = make_chain(0, args.blocks, payload)
        keys = [record.key for record in chain]
        tier.put(chain)
        assert tier.contains(keys) == args.blocks
        seconds = median_seconds(lambda: tier.contains(keys), args.repeats * 10)
        print(f"contains {args.blocks} keys: {seconds * 1e3:.3f} ms (one round trip)")
        for batch in sorted({8, 16, 32, 64, args.blocks, redis_module.GET_BATCH_KEYS}):
            redis_module.GET_BATCH_KEYS = batch
            seconds = median_seconds(lambda: tier.get(keys), args.repeats)
            print(
                f"get {args.blocks} x {args.block_kib} KiB, {batch:>3} keys per round trip: {seconds * 1e3:.1f} ms, "
                f"{num_bytes / seconds / 1e9:.2f} GB/s"
            )
        redis_module.GET_BATCH_KEYS = 32
        rounds = iter(range(1, 1 << 30))
        seconds = median_seconds(
            lambda: tier.put(make_chain(next(rounds), args.blocks, payload)), max(3, args.repeats // 4)
        )
        print(
            f"put (synchronous) {args.blocks} x {args.block_kib} KiB: {seconds * 1e3:.1f} ms, "
            f"{num_bytes / seconds / 1e9:.2f} GB/s"
        )
        seconds = median_seconds(lambda: tier.put(chain), args.repeats)
        print(f"put of records already present (EXISTS only): {seconds * 1e3:.2f} ms")

        start = time.perf_counter()
        submit_times = []
        for _ in range(max(3, args.repeats // 4)):
            chain = make_chain(next(rounds), args.blocks, payload)
            began = time.perf_counter()
            tier.put_async(chain[: args.blocks // 2])
            tier.put_async(chain[args.blocks // 2 :])
            submit_times.append(time.perf_counter() - began)
            tier.flush()
        total = time.perf_counter() - start
        written = max(3, args.repeats // 4) * num_bytes
        print(
            f"put_async: {written / total / 1e9:.2f} GB/s to flush; the caller waits "
            f"{statistics.median(submit_times) * 1e6:.0f} us "
            f"per {args.blocks}-record submit; dropped {tier.stats.dropped_puts}, errors {tier.stats.errors}"
        )


if __name__ == "__main__":
    main()

"""What sealing the KV tiers costs (issue 23): the seal's throughput, and the TTFT of a prefix fetched back.

    python benchmarks/tier_seal.py [--model smollm2-135m-instruct] [--prefix-len 2000] [--runs 3] [--quick]

1. Throughput of one record's encode + decode (what a write and a read each pay) for a block of the
   model's KV, unsealed (CRC-32), sealed (AES-256-GMAC), encrypted (AES-256-GCM); and, for comparison,
   HMAC-SHA-256 and keyed BLAKE2b over the same payload.
2. TTFT (prefill of the uncached tokens + the first token) of a prompt whose prefix comes back from the
   host tier, the disk tier (page cache warm) and a local Redis, with the tiers unsealed, sealed and
   encrypted. Each run recomputes nothing but the last prefix token and 16 new ones; runs alternate
   between the three modes so drift falls on all of them; the median of --runs is reported.

Prints two tables and writes benchmarks/results/tier_seal[_quick].json and .png. Needs redis-server
for the Redis rows (skipped, and said so, without it).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import hmac
import json
import math
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from redis_tier import start_redis  # noqa: E402

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.model.cpu_caps import cpu_name  # noqa: E402
from prefixserve.tiers import BlockRecord, Keyring, RecordExpectation, Sealer, decode_record, encode_record  # noqa: E402

MODES = ("unsealed", "sealed", "encrypted")
POOL_BYTES = 1 << 30  # device pool per engine: room for the prefix many times over


def throughput(block_shape: tuple[int, ...], dtype: str, repeats: int) -> dict[str, float]:
    """GB/s of payload through encode + decode of one record, and through the two reference MACs."""
    size = math.prod(block_shape) * (4 if dtype == "float32" else 2)
    payload = os.urandom(size)
    record = BlockRecord(b"k" * 32, b"p" * 32, b"s" * 32, tuple(range(16)), dtype, block_shape, payload, b"t" * 32)
    expect = RecordExpectation(record.key, record.scope_digest, record.token_ids, dtype, block_shape, b"t" * 32)
    keyring = Keyring.from_secret(secrets.token_hex(32))
    sealers = {"unsealed": None, "sealed": Sealer(keyring), "encrypted": Sealer(keyring, encrypt=True)}
    key = os.urandom(32)
    calls = {
        mode: (lambda s=sealer: decode_record(encode_record(record, s), expect, s)) for mode, sealer in sealers.items()
    }
    calls["HMAC-SHA-256 (payload once)"] = lambda: hmac.digest(key, payload, "sha256")
    calls["keyed BLAKE2b (payload once)"] = lambda: hashlib.blake2b(payload, key=key).digest()
    results = {}
    for name, call in calls.items():
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            times.append((time.perf_counter() - start) / repeats)
        results[name] = size / statistics.median(times) / 1e9
    return results


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 8000) for _ in range(length)]


def ttft_from_tier(llm, tier: str, prefix: list[int], tail: list[int]) -> float:
    """Put the prefix's blocks in `tier` only (stored synchronously; the device pool emptied), then time
    prefix + tail -> 1 token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    tiers = engine.tiers
    llm.generate([prefix + [7]], params, use_tqdm=False)
    for each in tiers.tiers.values():
        each.flush()  # the write-through of what was just computed, before the tier is filled by hand
    blocks = list(engine.cache._index.values())  # one prompt: chain order
    payloads = engine.runner.read_blocks([block.block_id for block in blocks])
    tiers.tiers[tier].put([tiers._record(block, payload) for block, payload in zip(blocks, payloads)])
    engine.cache.clear()
    start = time.perf_counter()
    out = llm.generate([prefix + tail], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    served = out.cached_tokens_by_tier[tier]
    if served < len(prefix) - 16:
        raise RuntimeError(f"{tier}: only {served} of {len(prefix)} prefix tokens came from the tier")
    return seconds


def measure_ttft(args, directory: str, redis_url) -> dict:
    secret = Path(directory) / "secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    tiers = {"host": dict(kv_host_cache_bytes=4 << 30), "disk": dict(kv_disk_cache_dir=None)}
    if redis_url:
        tiers["Redis"] = dict(kv_remote_url=redis_url)
    results: dict = {}
    for tier, options in tiers.items():
        engines = {}
        for mode in MODES:
            extra = dict(options)
            if "kv_disk_cache_dir" in extra:
                extra["kv_disk_cache_dir"] = tempfile.mkdtemp(dir=directory)
            if mode != "unsealed":
                extra["kv_tier_secret_file"] = str(secret)
            elif "kv_remote_url" in extra:
                extra["kv_remote_insecure"] = True
            engines[mode] = LLM(
                model=args.model,
                dtype="float32",
                kv_fetch_policy="always",
                log_stats=False,
                kv_cache_memory_bytes=POOL_BYTES,
                kv_tier_encrypt=mode == "encrypted",
                **extra,
            )
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for run in range(args.runs):
            for mode in MODES:
                prefix = prompt(1000 * run + 10 * list(tiers).index(tier) + MODES.index(mode), args.prefix_len)
                name = "remote" if tier == "Redis" else tier
                times[mode].append(ttft_from_tier(engines[mode], name, prefix, prompt(run, 16)))
        results[tier] = {mode: times[mode] for mode in MODES}
        for engine in engines.values():
            engine.close()
        engines.clear()
        gc.collect()  # three engines per tier: let each tier's go before the next tier's start
        print(
            f"  {tier}: "
            + "; ".join(f"{mode} " + " ".join(f"{x * 1e3:.0f}" for x in t) + " ms" for mode, t in times.items()),
            flush=True,
        )
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = list(results["ttft_seconds"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.27
    for index, mode in enumerate(MODES):
        values = [statistics.median(results["ttft_seconds"][tier][mode]) * 1e3 for tier in tiers]
        ax.bar([i + (index - 1) * width for i in range(len(tiers))], values, width, label=mode)
    ax.set_xticks(range(len(tiers)), tiers)
    ax.set_ylabel("TTFT (ms), median")
    ax.set_title(f"{results['prefix_len']}-token prefix fetched back ({results['model']}, float32)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="toy sizes, built-in model (seconds)")
    parser.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    if args.quick:
        args.model, args.prefix_len, args.runs = None, 160, 1
    probe = LLM(model=args.model, dtype="float32", log_stats=False, kv_cache_memory_bytes=POOL_BYTES)
    shape = probe.engine.runner.block_shape
    probe.close()
    del probe
    gc.collect()
    cpu = cpu_name()
    print(f"{cpu}; model {args.model or 'built-in'}, KV block {shape} float32")
    rates = throughput(shape, "float32", 5 if args.quick else 60)
    print(f"\n{'record encode + decode':<32} GB/s of payload")
    for name, rate in rates.items():
        print(f"{name:<32} {rate:6.2f}")
    with tempfile.TemporaryDirectory() as directory:
        redis = None
        url = None
        if shutil.which("redis-server"):
            redis, url = start_redis(directory)
        else:
            print("(no redis-server: the Redis rows are left out; apt-get install redis-server)")
        try:
            print(f"\nTTFT of a {args.prefix_len}-token prefix + 16 new tokens, fetched back (median of {args.runs}):")
            ttft = measure_ttft(args, directory, url)
        finally:
            if redis is not None:
                redis.kill()
    print(f"\n{'tier':<8}" + "".join(f"{mode:>12}" for mode in MODES) + f"{'sealed x':>10}{'encrypted x':>13}")
    for tier, modes in ttft.items():
        medians = {mode: statistics.median(times) for mode, times in modes.items()}
        print(
            f"{tier:<8}"
            + "".join(f"{medians[mode] * 1e3:>10.1f}ms" for mode in MODES)
            + f"{medians['sealed'] / medians['unsealed']:>10.2f}{medians['encrypted'] / medians['unsealed']:>13.2f}"
        )
    results = {
        "cpu": cpu,
        "model": args.model or "built-in",
        "prefix_len": args.prefix_len,
        "block_shape": shape,
        "throughput_gb_per_s": rates,
        "ttft_seconds": ttft,
    }
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "tier_seal_quick" if args.quick else "tier_seal"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, out / f"{stem}.png")
    print(f"\nwrote {out / (stem + '.json')} and {out / (stem + '.png')}")


if __name__ == "__main__":
    main()

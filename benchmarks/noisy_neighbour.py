"""Two tenants on one replica: does one tenant's flood of one-off prompts evict the other's warm prefixes?

    python benchmarks/noisy_neighbour.py [--runs 3] [--a-requests 120] [--flood-ratio 4] [--pool-blocks 256]
                                         [--results-dir DIR]

Tenant A asks questions over a small set of documents (a working set that fits the pool with room to spare);
tenant B sends unique prompts at `--flood-ratio` times A's rate. Through the real engine (the built-in model,
one-token answers, each tenant's prompts keyed in its own scope), A's token hit rate is measured:

    A alone               what A's traffic earns by itself
    A + B, no shares      plain LRU: B's flood evicts A's documents between A's requests
    A + B, shares on      A's min_kv_share keeps its documents against B's traffic; B's max_kv_share bounds it

The goal (issue "many tenants on one cache"): with the shares on, A's hit rate within 5 points of A alone.
Prints a table (one row per run and scenario, then the median), saves benchmarks/results/noisy_neighbour.png
and .json. Behaviour, not speed: the figures do not depend on the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from prefixserve.cache.scoping import compose_salt
from prefixserve.engine.sampling_params import SamplingParams
from prefixserve.llm import LLM

RESULTS = Path(__file__).parent / "results"
BLOCK_BYTES_TINY_FP32 = (8 << 20) // 32  # the built-in model's fp32 KV block: 32 blocks in 8 MiB
SCENARIOS = ("A alone", "A + B, no shares", "A + B, shares on")


def workload(seed: int, num_a: int, flood_ratio: int, num_documents: int, document_tokens: int):
    """[(tenant, token ids)] in arrival order: A's questions over its documents, B's one-off prompts between."""
    rng = random.Random(seed)
    documents = [[rng.randrange(5, 250) for _ in range(document_tokens)] for _ in range(num_documents)]
    order = []
    for _ in range(num_a):
        document = documents[min(int(rng.expovariate(0.5)), num_documents - 1)]  # a few documents are hotter
        order.append(("a", document + [rng.randrange(5, 250) for _ in range(24)]))
        for _ in range(flood_ratio):
            order.append(("b", [rng.randrange(5, 250) for _ in range(document_tokens + 100)]))
    return order


def run(order, scenario: str, pool_blocks: int, a_min: float, b_max: float) -> dict:
    shares = {}
    if scenario == SCENARIOS[2]:
        shares = {"a": {"min_kv_share": a_min}, "b": {"max_kv_share": b_max}}
    llm = LLM(
        kv_cache_memory_bytes=pool_blocks * BLOCK_BYTES_TINY_FP32,
        dtype="float32",
        tenant_shares=shares or None,
        hot_prefix_min_requests=0,  # shares alone: no hot-prefix pins to hide the effect
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0)
    batch = []
    for tenant, tokens in order:
        if scenario == SCENARIOS[0] and tenant == "b":
            continue
        batch.append(engine.add_request(tokens, params, cache_salt=compose_salt(tenant, None), tenant=tenant))
        if len(batch) == 5:  # a few requests in flight at once, as arrivals overlap
            engine.run_until_finished([request.request_id for request in batch])
            batch = []
    if batch:
        engine.run_until_finished([request.request_id for request in batch])
    counters = engine.cache.stats.by_tenant["a"]
    return {
        "scenario": scenario,
        "a_hit_rate": counters.hit_tokens / counters.query_tokens,
        "a_requests": counters.queries,
        "b_requests": engine.cache.stats.by_tenant["b"].queries if "b" in engine.cache.stats.by_tenant else 0,
        "pool_blocks": engine.cache.pool.num_blocks,
        "min_share_overrides": engine.cache.stats.num_min_share_overrides,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--a-requests", type=int, default=120)
    parser.add_argument("--flood-ratio", type=int, default=4)
    parser.add_argument("--pool-blocks", type=int, default=256)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--document-tokens", type=int, default=200)
    parser.add_argument("--a-min-kv-share", type=float, default=0.4)
    parser.add_argument("--b-max-kv-share", type=float, default=0.5)
    parser.add_argument("--name", default="noisy_neighbour")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where the PNG and JSON go")
    args = parser.parse_args()

    rows = []
    for index in range(args.runs):
        order = workload(index, args.a_requests, args.flood_ratio, args.documents, args.document_tokens)
        for scenario in SCENARIOS:
            row = run(order, scenario, args.pool_blocks, args.a_min_kv_share, args.b_max_kv_share)
            row["run"] = index
            rows.append(row)
            print(
                f"run {index}  {scenario:<18}  A hit rate {100 * row['a_hit_rate']:5.1f}%  "
                f"(A {row['a_requests']}, B {row['b_requests']} requests; pool {row['pool_blocks']} blocks)",
                flush=True,
            )
    medians = {s: statistics.median(r["a_hit_rate"] for r in rows if r["scenario"] == s) for s in SCENARIOS}
    print()
    print(f"{'scenario':<20}{'A token hit rate (median of ' + str(args.runs) + ')':>36}{'vs A alone':>14}")
    for scenario in SCENARIOS:
        gap = 100 * (medians[scenario] - medians[SCENARIOS[0]])
        print(f"{scenario:<20}{100 * medians[scenario]:>35.1f}%{gap:>+13.1f} pt")

    results = args.results_dir
    results.mkdir(parents=True, exist_ok=True)
    report = {"args": {**vars(args), "results_dir": str(results)}, "rows": rows, "medians": medians}
    (results / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 3.5))
    for position, scenario in enumerate(SCENARIOS):
        values = [100 * r["a_hit_rate"] for r in rows if r["scenario"] == scenario]
        axis.bar(position, medians[scenario] * 100, color=("#4c72b0", "#c44e52", "#55a868")[position], alpha=0.8)
        axis.scatter([position] * len(values), values, color="black", s=12, zorder=3)
    axis.set_xticks(range(len(SCENARIOS)), SCENARIOS)
    axis.set_ylabel("tenant A's token hit rate (%)")
    axis.set_title(f"B floods one-off prompts at {args.flood_ratio}x A's rate ({args.pool_blocks}-block pool)")
    figure.tight_layout()
    figure.savefig(results / f"{args.name}.png", dpi=120)
    print(f"saved {results / (args.name + '.png')} and .json")


if __name__ == "__main__":
    main()

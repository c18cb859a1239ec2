"""A sliding-window model's prefix-cache hit against a full-attention model's, at long histories (issue 27).

    python benchmarks/sliding_window.py [--lengths 2000,8000] [--window 4096] [--repeats 3] [--dtype float32]
                                        [--memory-context 32768]

Both models are the built-in model's weights with 40,960 positions: one Llama (full attention), one Mistral
whose every layer slides over `--window` keys. For each history length L (+ 20 new tokens) it measures the TTFT
of a miss (nothing cached) and of a hit (L cached, 20 new; a fresh suffix each repeat), medians of `--repeats`.
Then the memory: one request of `--memory-context` tokens through the window model, stepped, counting the
window layers' slots (cache/window_slots.py) it holds at most while it runs and the idle ones its finished
prefix keeps (reclaimable: taken first when the pool needs room), against the blocks the full-attention model's
layers hold for it (all of them), while it decodes and at most during its prefill; and the pool each model gets
from the same 1 GiB budget. Prints tables with
the CPU, saves benchmarks/results/sliding_window.png.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
from pathlib import Path

from prefixserve import LLM, SamplingParams
from prefixserve.model import ensure_default_model
from prefixserve.model.cpu_caps import cpu_name

SUFFIX_LEN = 20
POSITIONS = 40960
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def write_variant(root: Path, name: str, changes: dict) -> Path:
    """The built-in checkpoint under another config (same weights and tokenizer)."""
    source, target = ensure_default_model(), root / name
    target.mkdir()
    for file in source.iterdir():
        if file.name != "config.json":
            (target / file.name).symlink_to(file)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": POSITIONS, **changes}))
    return target


def measure(model_dir: Path, lengths: list[int], repeats: int, dtype: str, seed: int) -> list[dict]:
    max_len = max(lengths) + SUFFIX_LEN
    llm = LLM(
        str(model_dir),
        dtype=dtype,
        max_model_len=max_len + 16,
        max_num_batched_tokens=max_len,
        kv_cache_memory_bytes=1 << 30,
        log_stats=False,
    )
    engine = llm.engine
    rows, rng = [], random.Random(seed)
    for length in lengths:
        prefix = [rng.randrange(10, 8000) for _ in range(length)]
        misses, hits = [], []
        for _ in range(repeats):
            engine.cache.clear()
            suffix = [rng.randrange(10, 8000) for _ in range(SUFFIX_LEN)]
            misses.append(llm.generate([prefix + suffix], ONE_TOKEN, use_tqdm=False)[0].metrics.ttft)
        for _ in range(repeats):
            suffix = [rng.randrange(10, 8000) for _ in range(SUFFIX_LEN)]
            out = llm.generate([prefix + suffix], ONE_TOKEN, use_tqdm=False)[0]
            assert out.num_cached_tokens >= length - 16, "the prefix was not read back"
            hits.append(out.metrics.ttft)
        rows.append({"length": length, "miss": statistics.median(misses), "hit": statistics.median(hits)})
        engine.cache.clear()
    llm.close()
    return rows


def memory(model_dir: Path, context: int, dtype: str, seed: int) -> dict:
    """Slots and blocks one `context`-token request holds (see the module docstring)."""
    llm = LLM(str(model_dir), dtype=dtype, max_model_len=context + 16, kv_cache_memory_bytes=1 << 30, log_stats=False)
    engine, rng = llm.engine, random.Random(seed)
    slots, blocks = engine.window_slots, -(-context // engine.config.block_size)
    most_held = decode_held = blocks  # full attention: every layer holds every block (not run: quadratic prefill)
    if slots is not None:
        request = engine.add_request(
            {"prompt_token_ids": [rng.randrange(10, 8000) for _ in range(context - 4)]},
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
        most_held = 0
        while engine.has_unfinished_requests():
            engine.step()
            most_held = max(most_held, slots.num_held)
            if not request.is_finished and request.num_computed_tokens >= request.num_prompt_tokens:
                decode_held = slots.num_held  # decoding: its window and the block being written
    row = {
        "blocks": blocks,
        "most_held": most_held,
        "decode_held": decode_held,
        "idle": slots.num_idle if slots is not None else 0,
        "pool_blocks": engine.cache.pool.num_blocks,
        "slots": slots.num_slots if slots is not None else 0,
        "block_bytes": math.prod(engine.runner.block_shape) * engine.runner.kv_caches[0][0].element_size(),
    }
    llm.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2000,8000")
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--memory-context", type=int, default=32768)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        models = {
            "full attention": write_variant(root, "full", {}),
            f"window {args.window}": write_variant(
                root,
                "window",
                {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": args.window},
            ),
        }
        results = {name: measure(path, lengths, args.repeats, args.dtype, seed=0) for name, path in models.items()}
        held = {name: memory(path, args.memory_context, args.dtype, seed=1) for name, path in models.items()}
    full, windowed = results.values()
    print(f"{cpu_name()}, {args.dtype}, built-in model's weights, medians of {args.repeats}")
    print("| history | full miss | full hit | window miss | window hit | hit ratio |")
    print("|---|---|---|---|---|---|")
    for a, b in zip(full, windowed):
        print(
            f"| {a['length']:,} | {a['miss'] * 1e3:,.0f} ms | {a['hit'] * 1e3:,.1f} ms | {b['miss'] * 1e3:,.0f} ms | "
            f"{b['hit'] * 1e3:,.1f} ms | {b['hit'] / a['hit']:.2f}x |"
        )
    whole, slid = held.values()
    print(
        f"\none request of {args.memory_context:,} tokens, window {args.window:,}, 1 GiB budget; window layers' K/V "
        f"in blocks of {whole['block_bytes'] / 2**20:.2f} MiB (all layers of 16 tokens)"
    )
    print("| | full attention | window model | ratio | window / context |")
    print("|---|---|---|---|---|")
    print(
        f"| blocks its window layers hold while it decodes | {whole['blocks']:,} | {slid['decode_held']:,} | "
        f"{slid['decode_held'] / whole['blocks']:.3f} | {args.window / args.memory_context:.3f} |"
    )
    print(
        f"| ... at most, during its prefill (window + a 2,048-token chunk) | {whole['blocks']:,} | "
        f"{slid['most_held']:,} | {slid['most_held'] / whole['blocks']:.3f} | |"
    )
    print(
        f"| ... after it finished: held / idle (reclaimable) | {whole['blocks']:,} / 0 | 0 / {slid['idle']:,} | "
        f"0 / {slid['idle'] / whole['blocks']:.3f} | |"
    )
    print(
        f"| the pool from the same budget: blocks (window layers' slots) | {whole['pool_blocks']:,} | "
        f"{slid['pool_blocks']:,} ({slid['slots']:,}) | {slid['pool_blocks'] / whole['pool_blocks']:.2f}x tokens | |"
    )
    plot(results, Path(__file__).parent / "results" / "sliding_window.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, rows in results.items():
        for kind, style in (("miss", "--"), ("hit", "-")):
            axis.plot(
                [r["length"] for r in rows], [r[kind] * 1e3 for r in rows], style, marker="o", label=f"{name}, {kind}"
            )
    axis.set(xlabel="history (tokens)", ylabel="TTFT (ms)", yscale="log", title="Sliding window vs full attention")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

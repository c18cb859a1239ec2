"""What structured output costs (issue 26): the grammar engines' per-token mask, and decode with a grammar.

    python benchmarks/structured_mask.py [--model smollm2-135m-instruct] [--runs 3] [--tokens 128] [--quick]

1. Per-token mask cost of each grammar engine installed (llguidance, which prefixserve uses; xgrammar and
   outlines-core when present, for the choice): a JSON schema's mask computed and applied to a logits row
   while a fixed JSON document is consumed token by token, for the built-in model's vocabulary and the
   --model's. Median and mean over the document's tokens, median of --runs.
2. Decode time per token of the engine with no grammar, a JSON schema, and a regex (greedy, ignore_eos,
   --tokens tokens), runs alternated so drift falls on all three; the ratio to no grammar is the cost.

Prints two tables and writes benchmarks/results/structured_mask[_quick].json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from prefixserve import LLM, SamplingParams, StructuredOutputs
from prefixserve.engine.model_version import resolve_model_path
from prefixserve.model.cpu_caps import cpu_name
from prefixserve.model.default import default_tokenizer_dir
from prefixserve.model.tokenizers.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
}
DOCUMENT = json.dumps(
    {
        "name": "Ada Lovelace, the first programmer",
        "age": 36,
        "tags": ["mathematics", "engines", "poetical science", "notes on the analytical engine"],
    },
    separators=(",", ":"),
)


def llguidance_mask(tokenizer: Tokenizer, vocab: int, ids: list[int]) -> list[float]:
    from prefixserve.engine.structured_output import GrammarCompiler

    grammar = GrammarCompiler(tokenizer.backend_json(), vocab, tokenizer.eos_token_ids).grammar(
        StructuredOutputs(json=SCHEMA)
    )
    times = []
    for token in ids:
        row = torch.zeros(vocab)
        start = time.perf_counter()
        grammar.mask_row(row)
        times.append(time.perf_counter() - start)
        assert grammar.accept(token) is None
    return times


def xgrammar_mask(tokenizer: Tokenizer, vocab: int, ids: list[int]) -> list[float]:
    import xgrammar

    info = xgrammar.TokenizerInfo(
        [tokenizer.token_bytes(i) for i in range(vocab)],
        xgrammar.VocabType.RAW,
        vocab_size=vocab,
        stop_token_ids=tokenizer.eos_token_ids,
    )
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        row = torch.zeros(1, vocab)
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(row, bitmask)
        times.append(time.perf_counter() - start)
        assert matcher.accept_token(token)
    return times


ENGINES = {"llguidance": llguidance_mask, "xgrammar": xgrammar_mask}


def mask_costs(tokenizers: dict[str, Tokenizer], runs: int) -> dict:
    results: dict = {}
    for name, tokenizer in tokenizers.items():
        ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
        for engine, measure in ENGINES.items():
            try:
                measure(tokenizer, tokenizer.vocab_size, ids[:2])  # warm: a vocabulary's first mask builds tables
            except ImportError:
                continue
            medians, means = [], []
            for _ in range(runs):
                times = measure(tokenizer, tokenizer.vocab_size, ids)
                medians.append(statistics.median(times))
                means.append(statistics.fmean(times))
            results.setdefault(name, {})[engine] = {
                "vocab": tokenizer.vocab_size,
                "median_us": medians,
                "mean_us": means,
            }
            for key in ("median_us", "mean_us"):
                results[name][engine][key] = [seconds * 1e6 for seconds in results[name][engine][key]]
    return results


def decode_costs(model, runs: int, tokens: int) -> dict[str, list[float]]:
    llm = LLM(model=model, dtype="float32", log_stats=False)
    constraints = {
        "none": None,
        "json schema": StructuredOutputs(json=SCHEMA),
        "regex": StructuredOutputs(regex="[a-z ,.]+"),
    }
    per_token: dict[str, list[float]] = {name: [] for name in constraints}
    for run in range(runs + 1):  # the first round warms up (and compiles each grammar's tables once)
        for name, spec in constraints.items():
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, structured_outputs=spec)
            start = time.perf_counter()
            output = llm.generate([f"Write item {run}:"], params, use_tqdm=False)[0]
            if run:
                per_token[name].append((time.perf_counter() - start) / len(output.token_ids) * 1e3)
    llm.close()
    return per_token


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    labels, values = [], []
    for vocab_name, engines in results["mask"].items():
        for engine, figures in engines.items():
            labels.append(f"{engine}\n{vocab_name}")
            values.append(statistics.median(figures["median_us"]))
    left.bar(range(len(values)), values)
    left.set_xticks(range(len(values)), labels, fontsize=7)
    left.set_ylabel("mask per token (us), median")
    decode = results["decode_ms_per_token"]
    right.bar(list(decode), [statistics.median(times) for times in decode.values()])
    right.set_ylabel("decode per token (ms), median")
    right.set_title(results["model"], fontsize=9)
    fig.suptitle(results["cpu"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="whose vocabulary is measured beside ours")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="built-in model only, one run (seconds)")
    parser.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    if args.quick:
        args.model, args.runs, args.tokens = None, 1, 32
    cpu = cpu_name()
    tokenizers = {"built-in": Tokenizer.from_dir(default_tokenizer_dir())}
    if args.model:
        tokenizers[args.model] = Tokenizer.from_dir(resolve_model_path(args.model))
    print(f"{cpu}; JSON document of {len(DOCUMENT)} characters")
    mask = mask_costs(tokenizers, args.runs)
    print(f"\n{'vocabulary':<24}{'engine':<12}{'tokens':>8}{'median us':>11}{'mean us':>10}")
    for vocab_name, engines in mask.items():
        for engine, figures in engines.items():
            print(
                f"{vocab_name:<24}{engine:<12}{figures['vocab']:>8}"
                f"{statistics.median(figures['median_us']):>11.1f}{statistics.median(figures['mean_us']):>10.1f}"
            )
    decode = decode_costs(None, args.runs, args.tokens)
    base = statistics.median(decode["none"])
    print(f"\ndecode on the built-in model, {args.tokens} tokens, ms per token (runs: each; median; x none)")
    for name, times in decode.items():
        print(
            f"{name:<14}"
            + " ".join(f"{t:.2f}" for t in times)
            + f"   {statistics.median(times):.2f}   {statistics.median(times) / base:.3f}"
        )
    results = {"cpu": cpu, "model": "built-in", "tokens": args.tokens, "mask": mask, "decode_ms_per_token": decode}
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "structured_mask_quick" if args.quick else "structured_mask"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, out / f"{stem}.png")


if __name__ == "__main__":
    main()

"""What prompt-lookup speculation (speculative_config "ngram") does to time per output token, by draft length k.

    python benchmarks/spec_decode.py [--model smollm2-135m-instruct] [--ks 0,2,4,8] [--runs 3]

Two workloads through the real engine, greedy (outputs are the same token for token at every k: checked here
too, each k against k = 0):
    echo   an agent's turns that quote text back: a tool result repeated, code edited in place, JSON echoed with
           one field changed, a file reformatted; one request at a time (TPOT: the requests' times from first to
           last token, over their tokens after the first)
    chat   32 ordinary questions at once (a batch of 32): wall time over all output tokens
Each run times every k in turn (one engine per k, built first). Prints TPOT per k and run, the ratio to k = 0 in
the same run, the drafts' acceptance; saves benchmarks/results/spec_decode.png
(TPOT against k) and .json. The issue's goals: echo TPOT at most 0.5x speculation off (SmolLM2); chat at batch 32
no slower than off (within 3%). Name the CPU with the figures: they are timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CODE = """def load_settings(path):
    with open(path) as handle:
        raw = json.load(handle)
    settings = {}
    for key, value in raw.items():
        if key.startswith("_"):
            continue
        settings[key.lower()] = value
    return settings
"""
RECORD = '{"id": 4127, "name": "Ada Lovelace", "role": "analyst", "team": "engines", "active": true, "age": 36}'
ROWS = "date,region,units,revenue\n2026-01-04,north,120,3600\n2026-01-05,south,98,2940\n2026-01-06,east,143,4290\n"
ECHO = [
    f"Here is a function:\n{CODE}\nRename load_settings to read_settings and show the whole function again.",
    f"Copy this JSON exactly, changing only the age to 37: {RECORD}",
    f"The tool returned:\n{ROWS}\nRepeat the tool's output exactly, then say which region sold the most units.",
    f"Add a docstring to this function and show all of it:\n{CODE}",
    f"Return this record unchanged except that active is false: {RECORD}",
    f"Rewrite this CSV with the columns in the same order, sorted by units:\n{ROWS}",
]
CHAT = [
    "What is a good name for a cat?",
    "Explain why the sky is blue in two sentences.",
    "Give me three ideas for a weekend trip.",
    "How do I boil an egg?",
    "What is the capital of Australia?",
    "Write a haiku about autumn.",
    "Why do we have leap years?",
    "Suggest a healthy breakfast.",
]


def echo_tpot(llm, params) -> tuple[float, list[list[int]]]:
    """Seconds per output token over the echo requests, one at a time: each request's first to last token, over
    its tokens after the first, summed over the requests."""
    seconds, num_tokens, tokens = 0.0, 0, []
    for prompt in ECHO:
        (output,) = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        seconds += output.metrics.last_token_time - output.metrics.first_token_time
        num_tokens += len(output.token_ids) - 1
        tokens.append(output.token_ids)
    return seconds / num_tokens, tokens


def chat_tpot(llm, params, batch: int) -> tuple[float, list[list[int]]]:
    chats = [[{"role": "user", "content": CHAT[i % len(CHAT)] + f" (question {i})"}] for i in range(batch)]
    start = time.perf_counter()
    outputs = llm.chat(chats, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed / sum(len(output.token_ids) for output in outputs), [output.token_ids for output in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ks", default="0,2,4,8", help="draft lengths to time (0: speculation off)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    from prefixserve import LLM, SamplingParams

    ks = [int(k) for k in args.ks.split(",")]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    engines = {}
    for k in ks:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        engines[k] = LLM(args.model, speculative_config=spec if k else None, max_num_seqs=args.batch, log_stats=False)
        echo_tpot(engines[k], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    results = {k: {"rows": []} for k in ks}
    reference = {}
    for run in range(args.runs):  # each run times every k in turn: the machine's drift falls on all alike
        for k in ks:
            echo, echo_tokens = echo_tpot(engines[k], params)
            chat, chat_tokens = chat_tpot(engines[k], SamplingParams(max_tokens=64, temperature=0.0), args.batch)
            same = reference.setdefault(run, (echo_tokens, chat_tokens)) == (echo_tokens, chat_tokens)
            row = {"run": run, "echo_tpot_ms": 1e3 * echo, "chat_tpot_ms": 1e3 * chat, "same_tokens": same}
            results[k]["rows"].append(row)
    for k in ks:
        speculation = engines[k].engine.scheduler.speculation
        stats = speculation.stats if speculation is not None else None
        drafted = stats.num_draft_tokens if stats else 0
        results[k]["acceptance"] = stats.num_accepted_tokens / drafted if drafted else None
        engines[k].close()
    print(f"{args.model}: TPOT in ms (echo: one request at a time; chat: batch {args.batch}, wall / tokens)")
    print(f"{'k':>3} {'run':>4} {'echo':>8} {'vs off':>7} {'chat':>8} {'vs off':>7} {'same tokens':>12}")
    for k in ks:
        for row, base in zip(results[k]["rows"], results[ks[0]]["rows"]):
            echo, chat = row["echo_tpot_ms"], row["chat_tpot_ms"]
            print(
                f"{k:>3} {row['run']:>4} {echo:8.2f} {echo / base['echo_tpot_ms']:6.2f}x"
                f" {chat:8.2f} {chat / base['chat_tpot_ms']:6.2f}x {str(row['same_tokens']):>12}"
            )
        if results[k]["acceptance"] is not None:
            print(f"    k={k}: {100 * results[k]['acceptance']:.0f}% of drafted tokens accepted")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "spec_decode.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    plot(results, ks, args.model)


def plot(results: dict, ks: list[int], model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 3.5))
    for workload, label in (("echo_tpot_ms", "echo, one request"), ("chat_tpot_ms", "chat, batch of 32")):
        medians = [statistics.median(row[workload] for row in results[k]["rows"]) for k in ks]
        axis.plot(ks, medians, marker="o", label=label)
    axis.set_xlabel("draft tokens k (0: speculation off)")
    axis.set_ylabel("TPOT, ms")
    axis.set_title(f"Prompt-lookup speculation, {model}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(RESULTS / "spec_decode.png", dpi=120)


if __name__ == "__main__":
    main()

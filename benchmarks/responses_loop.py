"""An agent loop over the Responses API's previous_response_id (issue 55): the server holds the conversation.

    python benchmarks/responses_loop.py [--model smollm2-135m-instruct] [--turns 10] [--runs 3] [--quick]

Starts `prefixserve serve` on the model and runs an agent with the official openai client, streamed: turn 1 is
a short standing prompt and a question; every later turn sends only the tool's result (about 240 tokens of log
lines) with previous_response_id, so the transcript grows about tenfold over ten turns while each request
carries a few hundred tokens. Per turn it prints the prompt's tokens, the cached tokens against everything the
previous turn computed (its prompt and output: the goal is >= 95%), and the time to first token as the server
measured it (vLLM's histogram on /metrics, read before and after the turn; the goal: within 1.5x of turn 2's).
Several runs, each on a fresh server, not the best one. Writes
benchmarks/results/responses_loop[_quick].json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_bench import free_port, start_prefixserve, wait_healthy  # noqa: E402

from prefixserve.model.cpu_caps import cpu_name  # noqa: E402

INSTRUCTIONS = "You are an operations agent. Investigate with the tools, one call per turn."
TOOLS = [
    {
        "type": "function",
        "name": "search_logs",
        "description": "Search the service logs.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["query", "hours"],
            "properties": {
                "query": {"type": "string", "maxLength": 24},
                "hours": {"type": "integer", "minimum": 1, "maximum": 48},
            },
        },
    }
]


def tool_result(turn: int) -> str:
    """About 240 tokens of log lines, different every turn: ten turns grow the transcript about tenfold."""
    return "\n".join(
        f"2026-12-01T{9 + (turn * 3 + i) // 60:02d}:{(turn * 3 + i) % 60:02d} worker-{(turn + i) % 7} "
        f"GET /v1/orders/{1000 + turn * 40 + i} status={200 + (turn * i) % 5} latency_ms={(turn * 37 + i * 11) % 900}"
        for i in range(5)
    )


def server_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of vLLM's time-to-first-token histogram on the server's /metrics (arrival to first token)."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"vllm:time_to_first_token_seconds_{part}"):
                values[part] = values.get(part, 0.0) + float(line.rsplit(" ", 1)[1])
    return values.get("sum", 0.0), values.get("count", 0.0)


def one_run(url: str, model: str, turns: int, max_tokens: int) -> list[dict]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rows, previous, computed = [], None, 0
    for turn in range(turns):
        # instructions every turn, as agent SDKs send them: they are a turn's own, not carried by previous_response_id
        if previous is None:
            request = {"input": "Orders are failing since 09:00. Start with the logs."}
        else:
            request = {
                "previous_response_id": previous.id,
                "input": [{"type": "function_call_output", "call_id": previous.call_id, "output": tool_result(turn)}],
            }
        before = server_ttft(url)
        stream = client.responses.create(
            model=model,
            instructions=INSTRUCTIONS,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=max_tokens,
            temperature=0,
            stream=True,
            **request,
        )
        for event in stream:
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        after = server_ttft(url)  # a call's item is sent whole once it closes: the server times the first token
        usage = final.usage
        calls = [item for item in final.output if item.type == "function_call"]
        rows.append(
            {
                "turn": turn + 1,
                "prompt": usage.input_tokens,
                "cached": usage.input_tokens_details.cached_tokens,
                "previous_computed": computed,
                "ttft": (after[0] - before[0]) / max(after[1] - before[1], 1),
                "calls": len(calls),
            }
        )
        computed = usage.input_tokens + usage.output_tokens
        if not calls:
            raise SystemExit(f"turn {turn + 1} made no call ({final.status}); the loop needs one a turn")
        previous = type("Previous", (), {"id": final.id, "call_id": calls[0].call_id})
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for number, rows in enumerate(results["runs"], 1):
        turns = [row["turn"] for row in rows]
        left.plot(turns, [row["prompt"] for row in rows], marker="o", label=f"run {number}: prompt")
        right.plot(turns, [1000 * row["ttft"] for row in rows], marker="o", label=f"run {number}")
    left.set_xlabel("turn")
    left.set_ylabel("prompt tokens")
    right.set_xlabel("turn")
    right.set_ylabel("time to first token (ms)")
    right.legend(fontsize=7)
    fig.suptitle(f"previous_response_id loop, {results['model']} ({results['cpu']})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="built-in model, 4 turns, 1 run")
    parser.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    if args.quick:
        args.model, args.turns, args.runs = None, 4, 1
    cpu = cpu_name()
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "responses_loop_quick" if args.quick else "responses_loop"
    runs = []
    for _ in range(args.runs):  # a fresh server each run: nothing cached from the run before
        port = free_port()
        command = ["serve", "--port", str(port), "--served-model-name", "agent", "--dtype", "float32"] + (
            ["--model", args.model] if args.model else []
        )
        with open(out / f"{stem}.log", "a") as log:
            process = start_prefixserve(command, log)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_healthy(url, process, 600)
                runs.append(one_run(url, "agent", args.turns, args.max_tokens))
            finally:
                process.terminate()
                process.wait(timeout=60)
    print(f"{cpu}; model {args.model or 'built-in'}; {args.runs} runs")
    print(f"{'turn':>4}{'prompt':>8}{'cached / previous turn':>26}{'TTFT ms (runs)':>30}")
    for index in range(args.turns):
        rows = [run[index] for run in runs]
        row = rows[0]
        share = f"{row['cached']}/{row['previous_computed']}" if index else "-"
        percent = f" ({100 * row['cached'] / row['previous_computed']:.1f}%)" if index else ""
        times = " ".join(f"{1000 * r['ttft']:.0f}" for r in rows)
        print(f"{index + 1:>4}{row['prompt']:>8}{share + percent:>26}{times:>30}")
    for number, rows in enumerate(runs, 1):
        later = [row["cached"] / row["previous_computed"] for row in rows[1:]]
        second = rows[1]["ttft"] if len(rows) > 1 else rows[0]["ttft"]
        worst = max(row["ttft"] for row in rows[1:]) / second if len(rows) > 1 else 1.0
        print(
            f"run {number}: cached >= {100 * min(later):.1f}% of the previous turn's prompt + output; "
            f"transcript x{rows[-1]['prompt'] / rows[0]['prompt']:.1f}; slowest TTFT after turn 2 {worst:.2f}x turn 2's"
        )
    ratios = [max(r["ttft"] for r in run[1:]) / run[1]["ttft"] for run in runs if len(run) > 1]
    if ratios:
        print(f"slowest TTFT / turn 2's, median over runs: {statistics.median(ratios):.2f}x")
    results = {"cpu": cpu, "model": args.model or "built-in", "runs": runs}
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, out / f"{stem}.png")


if __name__ == "__main__":
    main()

"""An agent loop through both APIs (issue 26): 20 tool calls, each turn resending the whole transcript.

    python benchmarks/agent_loop.py [--model smollm2-135m-instruct] [--turns 20] [--quick]

Starts `prefixserve serve` on the model, then runs the loop twice, through OpenAI's chat completions (tools,
tool_choice "required", one call a turn) and through Anthropic's Messages API (tool_choice "any" without parallel
use, a cache_control breakpoint on the system prompt), with the official clients. Each turn appends the model's
call and a tool result of about
80 tokens, after a standing system prompt of about 1,500 tokens. Prints per turn the prompt's tokens, the share
served from the cache and the wall time; the goal is
>= 90% cached from turn 2 on. Writes benchmarks/results/agent_loop[_quick].json and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_bench import free_port, start_prefixserve, wait_healthy  # noqa: E402

from prefixserve.model.cpu_caps import cpu_name  # noqa: E402

# An agent's standing prompt: instructions and a runbook, about 1,500 tokens (agents' prompts run to thousands).
SYSTEM = (
    "You are an operations agent. Investigate the user's incident with the tools, one call per turn, and "
    "summarise only when asked. Keep every call's arguments short.\n\nRunbook:\n"
    + "".join(
        f"{step}. When the {service} service shows high {metric}, read its {metric} first, then search the "
        f"logs of the last {hours} hours for timeouts, and restart it only if errors keep rising.\n"
        for step, (service, metric, hours) in enumerate(
            [
                (s, m, h)
                for s in ("api", "db", "cache", "queue")
                for m in ("latency", "errors", "cpu", "memory")
                for h in (2, 6)
            ],
            1,
        )
    )
)
FUNCTIONS = [
    (
        "search_logs",
        "Search the service logs.",
        {"query": {"type": "string", "maxLength": 24}, "hours": {"type": "integer", "minimum": 1, "maximum": 48}},
    ),
    (
        "get_metric",
        "Read one metric of a service.",
        {
            "service": {"enum": ["api", "db", "cache", "queue"]},
            "metric": {"enum": ["latency", "errors", "cpu", "memory"]},
        },
    ),
    ("restart", "Restart a service.", {"service": {"enum": ["api", "db", "cache", "queue"]}}),
]


def schema(properties: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": list(properties), "properties": properties}


def tool_result(turn: int) -> str:
    lines = [
        f"{time.strftime('2026-12-01T%H:%M', time.gmtime(3600 * 9 + 60 * (turn * 7 + i)))} "
        f"worker-{(turn + i) % 5} status={200 + (turn * i) % 4} latency_ms={(turn * 37 + i * 11) % 900}"
        for i in range(4)
    ]
    return "\n".join(lines)


def openai_loop(url: str, model: str, turns: int, max_tokens: int) -> list[dict]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    tools = [
        {"type": "function", "function": {"name": n, "description": d, "parameters": schema(p)}}
        for n, d, p in FUNCTIONS
    ]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "The API is slow since 09:00."}]
    rows = []
    for turn in range(turns):
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=max_tokens,
            temperature=0,
        )
        seconds = time.perf_counter() - start
        message = reply.choices[0].message
        calls = message.tool_calls or []
        usage = reply.usage
        rows.append(
            {
                "turn": turn + 1,
                "prompt": usage.prompt_tokens,
                "cached": usage.prompt_tokens_details.cached_tokens,
                "seconds": seconds,
                "calls": len(calls),
            }
        )
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": call.id, "content": tool_result(turn)} for call in calls]
        if not calls:
            messages.append({"role": "user", "content": "Call a tool."})
    return rows


def anthropic_loop(url: str, model: str, turns: int, max_tokens: int) -> list[dict]:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=600)
    tools = [{"name": n, "description": d, "input_schema": schema(p)} for n, d, p in FUNCTIONS]
    system = [{"type": "text", "text": SYSTEM + " (Messages API)", "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "The API is slow since 09:00."}]
    rows = []
    for turn in range(turns):
        start = time.perf_counter()
        reply = client.messages.create(
            model=model,
            system=system,
            messages=messages,
            tools=tools,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            max_tokens=max_tokens,
            extra_body={"temperature": 0.0},
        )
        seconds = time.perf_counter() - start
        usage = reply.usage
        prompt = usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
        uses = [block for block in reply.content if block.type == "tool_use"]
        rows.append(
            {
                "turn": turn + 1,
                "prompt": prompt,
                "cached": usage.cache_read_input_tokens,
                "seconds": seconds,
                "calls": len(uses),
            }
        )
        messages.append(
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]}
        )
        results = [{"type": "tool_result", "tool_use_id": use.id, "content": tool_result(turn)} for use in uses]
        messages.append({"role": "user", "content": results or "Call a tool."})
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for api, rows in results["loops"].items():
        ax.plot(
            [row["turn"] for row in rows], [100 * row["cached"] / row["prompt"] for row in rows], marker="o", label=api
        )
    ax.axhline(90, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt served from the cache (%)")
    ax.set_title(f"agent loop, {results['model']} ({results['cpu']})", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="built-in model, 5 turns")
    parser.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    if args.quick:
        args.model, args.turns = None, 5
    cpu = cpu_name()
    port = free_port()
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "agent_loop_quick" if args.quick else "agent_loop"
    command = ["serve", "--port", str(port), "--served-model-name", "agent", "--dtype", "float32"] + (
        ["--model", args.model] if args.model else []
    )
    with open(out / f"{stem}.log", "w") as log:
        process = start_prefixserve(command, log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, process, 600)
            loops = {
                "openai": openai_loop(url, "agent", args.turns, args.max_tokens),
                "anthropic": anthropic_loop(url, "agent", args.turns, args.max_tokens),
            }
        finally:
            process.terminate()
            process.wait(timeout=60)
    print(f"{cpu}; model {args.model or 'built-in'}")
    print(f"{'turn':>4} " + " ".join(f"{api + ' prompt':>17}{'cached':>8}{'s':>7}" for api in loops))
    for index in range(args.turns):
        cells = []
        for rows in loops.values():
            row = rows[index]
            cells.append(f"{row['prompt']:>17}{100 * row['cached'] / row['prompt']:>7.1f}%{row['seconds']:>7.2f}")
        print(f"{index + 1:>4} " + " ".join(cells))
    for api, rows in loops.items():
        later = [row["cached"] / row["prompt"] for row in rows[1:]]
        print(
            f"{api}: from turn 2, cached share min {100 * min(later):.1f}%, mean {100 * sum(later) / len(later):.1f}%;"
            f" turns with a call {sum(row['calls'] > 0 for row in rows)}/{len(rows)}"
        )
    results = {"cpu": cpu, "model": args.model or "built-in", "loops": loops}
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, out / f"{stem}.png")


if __name__ == "__main__":
    main()

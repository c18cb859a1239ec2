"""Which op first breaks batch invariance in bfloat16 (issue 15).

    PYTHONPATH=. python benchmarks/batch_invariance.py [--dtype bfloat16] [--length 100]

One target sequence is computed by the built-in model in several batch shapes; every op's output
for the target's tokens is recorded by position and compared with the target computed alone:

    alone            one prefill of the whole sequence, nothing else in the step (the reference)
    batch            one prefill step among other sequences of different lengths (target in the middle)
    batch+decodes    one prefill step that also carries decodes of other sequences
    chunks@16        prefilled 16 tokens a step (chunks split at block boundaries)
    chunks-inside    prefilled in chunks of 7, 25, 40, ... (split inside blocks)
    chunks+batch     chunks of 45 tokens, each step shared with other sequences' chunks
    decode           the last DECODE_TOKENS tokens one decode step each, alone
    decode+batch     the same decodes batched with decodes of other sequences
    cascade-hit      a cache hit: the first blocks were computed by another sequence in an earlier
                     step, then read once for a group of sequences (shared prefix, log-sum-exp merge;
                     the plan's thresholds are lowered so that path is taken with short sequences)

Two comparisons per scenario:
  * isolated: before each op the target's rows of its input are reset to the reference's, so
    a difference is that op's own (a forward hook overwrites each op's output rows with the
    reference once recorded; elementwise residual adds need nothing);
  * propagated: nothing is reset; the first op that differs is where greedy tokens start to drift.

Ops: embedding, RMSNorms, q/k/v (the fused qkv matmul's columns), rotary, attention, o_proj,
MLP gate/up (fused), down, final norm, lm_head logits. Per op the max over layers of the max
absolute difference; "=" means bit-identical. Saves benchmarks/results/batch_invariance.json.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch

from prefixserve.model import AttentionMetadata, ensure_default_model, load_model  # noqa: E402
from prefixserve.model.attention import step_plan as attention_plan  # noqa: E402
from prefixserve.model.attention.cascade import CascadeAttention  # noqa: E402
from prefixserve.model.attention.compiled import CompiledAttention  # noqa: E402
from prefixserve.model.attention.invariant import InvariantAttention  # noqa: E402
from prefixserve.model.families import llama  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 160
DECODE_TOKENS = 8
OPS = [
    "embedding",
    "input_norm",
    "q_proj",
    "k_proj",
    "v_proj",
    "rotary_q",
    "rotary_k",
    "attention",
    "o_proj",
    "post_attention_norm",
    "mlp_gate",
    "mlp_up",
    "mlp_down",
    "final_norm",
    "logits",
]
RESULTS = Path(__file__).resolve().parent / "results" / "batch_invariance.json"


class Recorder:
    """Collects the target's rows of every op's output by (op, layer) into [length, ...] tensors;
    with `reference` set and `isolate` on, overwrites those rows with the reference's."""

    def __init__(self, model, length: int, reference: Optional[dict] = None, isolate: bool = False):
        self.model, self.length, self.reference, self.isolate = model, length, reference, isolate
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.rows: Optional[torch.Tensor] = None  # rows of this step that are the target's
        self.positions: Optional[torch.Tensor] = None  # their positions in the target
        self.layer = -1

    def record(self, name: str, layer: int, output: torch.Tensor, columns: slice = slice(None)) -> None:
        if self.rows is None or len(self.rows) == 0:
            return
        key = (name, layer)
        values = output.index_select(0, self.rows)[:, columns]
        if key not in self.outputs:
            self.outputs[key] = torch.full((self.length, *values.shape[1:]), float("nan"), dtype=values.dtype)
        self.outputs[key][self.positions] = values

    def force(self, names: list[str], layer: int, output: torch.Tensor, columns: list[slice]) -> None:
        """Overwrite the target's rows of `output` with the reference (isolated mode only)."""
        if not self.isolate or self.rows is None or len(self.rows) == 0:
            return
        for name, cols in zip(names, columns):
            reference = self.reference[(name, layer)][self.positions]
            rows = output.index_select(0, self.rows)
            rows[:, cols] = reference
            output.index_copy_(0, self.rows, rows)

    def observe(self, names: list[str], layer: int, output: torch.Tensor, columns: list[slice]) -> None:
        for name, cols in zip(names, columns):
            self.record(name, layer, output, cols)
        self.force(names, layer, output, columns)


@contextmanager
def instrumented(model, recorder_of: Callable[[], Recorder]):
    """Hooks on every op of `model`; rotate and the attention backends' forward are wrapped."""
    handles = []
    config = model.config
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size

    def module_hook(names, columns, layer_of):
        def hook(module, inputs, output):
            recorder_of().observe(names, layer_of(), output, columns)
            return output

        return hook

    def current_layer():
        return recorder_of().layer

    def set_layer(index):
        def pre_hook(module, inputs):
            recorder_of().layer = index

        return pre_hook

    whole = [slice(None)]
    handles.append(model.embed_tokens.register_forward_hook(module_hook(["embedding"], whole, lambda: 0)))
    for index, layer in enumerate(model.layers):
        handles.append(layer.register_forward_pre_hook(set_layer(index)))
        handles.append(layer.input_layernorm.register_forward_hook(module_hook(["input_norm"], whole, current_layer)))
        handles.append(
            layer.self_attn.qkv_proj.register_forward_hook(
                module_hook(
                    ["q_proj", "k_proj", "v_proj"],
                    [slice(0, q_size), slice(q_size, q_size + kv_size), slice(q_size + kv_size, None)],
                    current_layer,
                )
            )
        )
        handles.append(layer.self_attn.o_proj.register_forward_hook(module_hook(["o_proj"], whole, current_layer)))
        handles.append(
            layer.post_attention_layernorm.register_forward_hook(
                module_hook(["post_attention_norm"], whole, current_layer)
            )
        )
        handles.append(
            layer.mlp.gate_up_proj.register_forward_hook(
                module_hook(["mlp_gate", "mlp_up"], [slice(0, inter), slice(inter, None)], current_layer)
            )
        )
        handles.append(layer.mlp.down_proj.register_forward_hook(module_hook(["mlp_down"], whole, current_layer)))
    handles.append(model.norm.register_forward_hook(module_hook(["final_norm"], whole, lambda: 0)))
    handles.append(model.lm_head.register_forward_hook(module_hook(["logits"], whole, lambda: 0)))

    original_rotate = llama.rotate
    backends = (CompiledAttention, InvariantAttention, CascadeAttention)
    original_forwards = [backend.forward for backend in backends]
    num_heads = config.num_attention_heads

    def rotate(x, cos, sin):
        out = original_rotate(x, cos, sin)  # [T, heads + kv_heads, d]
        recorder_of().observe(
            ["rotary_q", "rotary_k"], current_layer(), out, [slice(0, num_heads), slice(num_heads, None)]
        )
        return out

    def observed(forward):
        def attention(self, q, *args, **kwargs):
            out = forward(self, q, *args, **kwargs)
            recorder_of().observe(["attention"], current_layer(), out, whole)
            return out

        return attention

    llama.rotate = rotate
    for backend, forward in zip(backends, original_forwards):
        backend.forward = observed(forward)
    try:
        yield
    finally:
        llama.rotate = original_rotate
        for backend, forward in zip(backends, original_forwards):
            backend.forward = forward
        for handle in handles:
            handle.remove()


class Runner:
    """Steps of (sequence name, tokens, first, end) over a fresh paged cache, blocks handed out in order."""

    def __init__(self, model, dtype):
        config = model.config
        shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        self.model = model
        self.caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(config.num_hidden_layers)
        ]
        self.tables: dict[str, list[int]] = {}
        self.next_block = 0

    def share(self, name: str, source: str, num_blocks: int) -> None:
        """`name` starts with `source`'s first blocks (a prefix-cache hit)."""
        self.tables[name] = list(self.tables[source][:num_blocks])

    def step(self, recorder: Recorder, work: list[tuple[str, list[int], int, int]], target: str) -> None:
        input_ids, query_lens, seq_lens, tables = [], [], [], []
        rows, positions = [], []
        for name, tokens, first, end in work:
            table = self.tables.setdefault(name, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.next_block)
                self.next_block += 1
            if name == target:
                rows += range(len(input_ids), len(input_ids) + end - first)
                positions += range(first, end)
            input_ids += tokens[first:end]
            query_lens.append(end - first)
            seq_lens.append(end)
            tables.append(table)
        meta = AttentionMetadata.build(query_lens, seq_lens, [list(t) for t in tables], BLOCK_SIZE)
        recorder.rows = torch.tensor(rows, dtype=torch.int64)
        recorder.positions = torch.tensor(positions, dtype=torch.int64)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), meta.positions, self.caches, meta)
            # As the runner: one logits call over every sequence's last row. The target's other
            # rows get a second call of their own, so every position has a logits row to compare.
            ends = [sum(query_lens[: i + 1]) - 1 for i in range(len(work))]
            target_index = [i for i, (name, *_rest) in enumerate(work) if name == target]
            step_rows, step_positions = recorder.rows, recorder.positions
            recorder.rows, recorder.positions = torch.tensor(target_index, dtype=torch.int64), step_positions[-1:]
            self.model.compute_logits(hidden.index_select(0, torch.tensor(ends)))
            if len(step_rows) > 1:
                recorder.rows, recorder.positions = torch.arange(len(step_rows) - 1), step_positions[:-1]
                self.model.compute_logits(hidden.index_select(0, step_rows[:-1]))
            recorder.rows = None


def chunked(name: str, tokens: list[int], sizes: list[int]) -> list[tuple[str, list[int], int, int]]:
    out, first = [], 0
    for size in sizes:
        end = min(first + size, len(tokens))
        if first < end:
            out.append((name, tokens, first, end))
        first = end
    if first < len(tokens):
        out.append((name, tokens, first, len(tokens)))
    return out


def scenarios(target: list[int], rng: random.Random) -> dict[str, list[list[tuple[str, list[int], int, int]]]]:
    """Scenario name -> steps; a step is a list of (sequence, tokens, first, end)."""
    length = len(target)

    def tokens(n):
        return [rng.randrange(10, 8000) for _ in range(n)]

    others = {"A": tokens(37), "B": tokens(150), "C": tokens(5)}
    prefill_len = length - DECODE_TOKENS
    decodes = [[("T", target, position, position + 1)] for position in range(prefill_len, length)]
    batch_decodes = [[("A", others["A"], 0, 20), ("T", target, 0, prefill_len), ("B", others["B"], 0, 90)]]
    batch_decodes += [
        [("A", others["A"], 20 + i, 21 + i), ("T", target, position, position + 1), ("B", others["B"], 90 + i, 91 + i)]
        for i, position in enumerate(range(prefill_len, length))
    ]
    inside = [7, 25, 40] + [28] * (length // 28 + 1)
    # chunks+batch: every step 45 tokens of the target after a 30-token chunk of B (while B lasts).
    mixed = []
    for i, (name, toks, first, end) in enumerate(chunked("T", target, [45] * (length // 45 + 1))):
        b_chunk = [("B", others["B"], 30 * i, 30 * i + 30)] if 30 * i + 30 <= len(others["B"]) else []
        mixed.append(b_chunk + [(name, toks, first, end)])
    return {
        "alone": [[("T", target, 0, length)]],
        "batch": [
            [("A", others["A"], 0, 37), ("T", target, 0, length), ("B", others["B"], 0, 150), ("C", others["C"], 0, 5)]
        ],
        "batch+decodes": [
            [("A", others["A"], 0, 36), ("B", others["B"], 0, 149)],
            [("A", others["A"], 36, 37), ("T", target, 0, length), ("B", others["B"], 149, 150)],
        ],
        "chunks@16": [[step] for step in chunked("T", target, [16] * (length // 16 + 1))],
        "chunks-inside": [[step] for step in chunked("T", target, inside)],
        "chunks+batch": mixed,
        "decode": [[("T", target, 0, prefill_len)]] + decodes,
        "decode+batch": batch_decodes,
        "cascade-hit": "cascade",  # built by run_cascade (needs shared block tables)
    }


def run_scenario(model, dtype, steps, recorder: Recorder, target: list[int]) -> None:
    runner = Runner(model, dtype)
    if steps == "cascade":
        # P computes the shared prefix (4 blocks) first; T and two siblings then hit it in one
        # step (T's suffix is a 36-token chunk, the siblings decode-length chunks).
        shared = 64
        prefix = target[:shared]
        runner.step(recorder, [("P", prefix + target[shared : shared + 1], 0, shared + 1)], "T")
        for name in ("T", "S1", "S2"):
            runner.share(name, "P", shared // BLOCK_SIZE)
        siblings = {name: prefix + [7 + i] * 30 for i, name in enumerate(("S1", "S2"))}
        # The prefix rows of T are not recomputed here: take them from the reference (a hit
        # means they were computed by someone else); only T's suffix rows are compared.
        with lowered_thresholds():
            runner.step(
                recorder,
                [
                    ("S1", siblings["S1"], shared, shared + 30),
                    ("T", target, shared, len(target)),
                    ("S2", siblings["S2"], shared, shared + 5),
                ],
                "T",
            )
        return
    for work in steps:
        runner.step(recorder, work, "T")


@contextmanager
def lowered_thresholds():
    saved = dict(attention_plan.MIN_SHARED_SAVED_TOKENS)
    for key in saved:
        attention_plan.MIN_SHARED_SAVED_TOKENS[key] = 64
    try:
        yield
    finally:
        attention_plan.MIN_SHARED_SAVED_TOKENS.update(saved)


def compare(reference: dict, outputs: dict, num_layers: int) -> dict[str, dict]:
    """Per op: max abs difference over layers and compared positions, identical or not, first layer differing."""
    result = {}
    for op in OPS:
        worst, first_layer, compared = 0.0, None, False
        for layer in range(num_layers):
            key = (op, layer)
            if key not in outputs:
                continue
            got, want = outputs[key].float(), reference[key].float()
            seen = ~torch.isnan(got.reshape(len(got), -1)).all(-1)  # positions this scenario computed
            if not seen.any():
                continue
            compared = True
            diff = (got[seen] - want[seen]).abs().max().item()
            if diff > 0 and first_layer is None:
                first_layer = layer
            worst = max(worst, diff)
        if compared:
            result[op] = {"max_abs_diff": worst, "identical": worst == 0.0, "first_layer": first_layer}
    return result


def cell(entry: Optional[dict]) -> str:
    if entry is None:
        return "-"
    return "=" if entry["identical"] else f"{entry['max_abs_diff']:.2g}"


def print_table(title: str, table: dict[str, dict[str, dict]]) -> None:
    names = list(table)
    print(f"\n{title}  ('=' bit-identical, else max abs difference over layers and positions)")
    print(f"{'op':<20}" + "".join(f"{name:>15}" for name in names))
    for op in OPS:
        print(f"{op:<20}" + "".join(f"{cell(table[name].get(op)):>15}" for name in names))
    firsts = {name: first_to_differ(table[name]) for name in names}
    print(f"{'first to differ':<20}" + "".join(f"{str(firsts[name]):>15}" for name in names))


def first_to_differ(result: dict[str, dict]) -> Optional[str]:
    """The op that differs first in forward order (layer by layer), as 'op@layer'."""

    def forward_order(op: str) -> tuple[int, int]:
        layer = result[op]["first_layer"]
        if op == "embedding":
            layer = -1
        elif op in ("final_norm", "logits"):
            layer = 1 << 30
        return layer, OPS.index(op)

    differing = [op for op in OPS if op in result and not result[op]["identical"]]
    if not differing:
        return None
    op = min(differing, key=forward_order)
    return op if op in ("embedding", "final_norm", "logits") else f"{op}@{result[op]['first_layer']}"


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--length", type=int, default=100, help="target sequence length (tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-pack", action="store_true", help="leave the linear weights unpacked (F.linear)")
    parser.add_argument("--output", type=Path, default=RESULTS, help=f"JSON written here (default {RESULTS})")
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint directory (default: the built-in model)")
    args = parser.parse_args()
    began = time.perf_counter()
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model or ensure_default_model(), dtype, "cpu").model
    packed = False if args.no_pack else model.pack_linear_weights(batch_size_hint=2048)
    rng = random.Random(args.seed)
    target = [rng.randrange(10, 8000) for _ in range(args.length)]
    plans = scenarios(target, rng)
    num_layers = model.config.num_hidden_layers

    recorder = Recorder(model, args.length)
    with instrumented(model, lambda: recorder):
        run_scenario(model, dtype, plans.pop("alone"), recorder, target)
        reference = recorder.outputs
        tables = {"isolated": {}, "propagated": {}}
        for name, steps in plans.items():
            for mode in tables:
                recorder = Recorder(model, args.length, reference, isolate=mode == "isolated")
                run_scenario(model, dtype, steps, recorder, target)
                if name == "cascade-hit":  # T's prefix rows were computed by P, not T
                    for values in recorder.outputs.values():
                        values[:64] = float("nan")
                tables[mode][name] = compare(reference, recorder.outputs, num_layers)
    for mode, table in tables.items():
        print_table(f"{args.dtype}, {mode}", table)
    seconds = time.perf_counter() - began
    print(
        f"\n{args.length}-token target, block size {BLOCK_SIZE}, linear weights "
        f"{'packed (oneDNN)' if packed else 'unpacked'}, {seconds:.1f} s"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "dtype": args.dtype,
                "length": args.length,
                "packed": packed,
                "torch": torch.__version__,
                "tables": tables,
            },
            indent=1,
        )
    )
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()

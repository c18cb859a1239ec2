"""Each compiled kernel variant this CPU runs, against the CPU's own measured peak.

    python benchmarks/cpu_variants.py [--repeats 7]

For every variant (portable, avx2, avx512, avx512_bf16 as the CPU allows) a subprocess runs with
that variant's caps on PyTorch too (kernel_variants.capped_environment: ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS), so each row is what a CPU of that class would get;
the best variant also runs uncapped (AMX, where the CPU has it, is oneDNN's alone). Per variant:
  peak            the variant's float32 multiply-add loop on registers (csrc/peak.cpp), every core
  attention       one layer of the built-in model's shape, a 2,020-token causal prefill (paged_causal),
                  float32 and bf16 KV: GFLOP/s (4 x heads x head_dim per query-key pair) and % of peak
  decode          32 decodes at 1,000 tokens over scattered blocks: GB/s of K/V read
  linear          a 2,048 x 512 -> 2,688 matmul (the built-in model's gate_up) through linear.py,
                  packed, float32 and bf16 (bf16 is float32 arithmetic where the CPU has no bf16
                  matmul): GFLOP/s and % of the float32 peak (bf16 dot products and AMX exceed it)
Prints a table, saves benchmarks/results/cpu_variants.png and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def median_seconds(call, repeats: int) -> float:
    from attention_kernel import median_ms

    return median_ms(call, repeats) / 1e3


sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(repeats: int) -> dict:
    """This process's variant (as capped by its environment)."""
    import attention_kernel
    import torch

    from prefixserve.model import kernels
    from prefixserve.model.linear import Linear, native_bfloat16_matmul

    compiled = kernels.compiled
    if compiled is None:
        return {"variant": "pytorch"}
    iterations = 2_000_000
    peak = compiled.multiply_add_flops(iterations) / median_seconds(
        lambda: compiled.multiply_add_flops(iterations), repeats
    )
    row = {
        "variant": compiled.variant,
        "lanes": compiled.lanes,
        "peak_gflops": peak / 1e9,
        "threads": torch.get_num_threads(),
        "caps": {
            name: os.environ.get(name, "")
            for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
        },
    }
    heads, head_dim, length = attention_kernel.HEADS, attention_kernel.HEAD_DIM, 2020
    prefill_flops = 4 * heads * head_dim * length * (length + 1) / 2
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        cases = attention_kernel.cases(dtype, torch.Generator().manual_seed(0))
        arguments, _ = cases["prefill 2,020"]
        seconds = median_seconds(lambda arguments=arguments: compiled.paged_causal(*arguments), repeats)
        row[f"attention_{name}_gflops"] = prefill_flops / seconds / 1e9
        arguments, _ = cases["decode 32x1,000"]
        kv_bytes = 2 * 32 * 1000 * attention_kernel.KV_HEADS * head_dim * torch.empty((), dtype=dtype).element_size()
        row[f"decode_{name}_gbps"] = (
            kv_bytes / median_seconds(lambda arguments=arguments: compiled.paged_causal(*arguments), repeats) / 1e9
        )
        layer = Linear(512, 2688, bias=False).to(dtype)
        layer.pack(2048)
        x = torch.randn(2048, 512).to(dtype)
        with torch.inference_mode():
            seconds = median_seconds(lambda layer=layer, x=x: layer(x), repeats)
        row[f"linear_{name}_gflops"] = 2 * 2048 * 512 * 2688 / seconds / 1e9
    row["bf16_matmul"] = "native" if native_bfloat16_matmul() else "float32"
    return row


def run_variant(variant: str, capped: bool, repeats: int) -> dict:
    from prefixserve.model.kernel_variants import capped_environment

    env = dict(os.environ)
    for name in ("PREFIXSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(name, None)
    env.update(capped_environment(variant) if capped else {"PREFIXSERVE_CPU_ISA": variant})
    result = subprocess.run(
        [sys.executable, __file__, "--child", "--repeats", str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    row = json.loads(result.stdout.strip().splitlines()[-1])
    row["label"] = variant if capped else f"{variant} (libraries uncapped)"
    return row


def table(rows: list[dict]) -> str:
    header = (
        "variant",
        "lanes",
        "peak GF/s",
        "attn f32 GF/s",
        "attn bf16 GF/s",
        "decode f32 GB/s",
        "decode bf16 GB/s",
        "linear f32 GF/s",
        "linear bf16 GF/s",
        "bf16 matmul",
    )
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for row in rows:
        peak = row["peak_gflops"]

        def share(key, row=row, peak=peak):
            return f"{row[key]:.0f} ({100 * row[key] / peak:.0f}%)"

        lines.append(
            " | ".join(
                [
                    row["label"],
                    str(row["lanes"]),
                    f"{peak:.0f}",
                    share("attention_float32_gflops"),
                    share("attention_bfloat16_gflops"),
                    f"{row['decode_float32_gbps']:.1f}",
                    f"{row['decode_bfloat16_gbps']:.1f}",
                    share("linear_float32_gflops"),
                    share("linear_bfloat16_gflops"),
                    row["bf16_matmul"],
                ]
            )
        )
    return "\n".join("| " + line + " |" for line in lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [
        ("peak_gflops", "peak"),
        ("attention_float32_gflops", "attention f32"),
        ("attention_bfloat16_gflops", "attention bf16"),
        ("linear_float32_gflops", "linear f32"),
        ("linear_bfloat16_gflops", "linear bf16"),
    ]
    figure, axis = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        axis.bar([i + k * width for i in range(len(rows))], [row[key] for row in rows], width, label=label)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [row["label"] for row in rows], fontsize=8)
    axis.set_yscale("log")
    axis.set_ylabel("GFLOP/s (log)")
    axis.set_title("prefixserve's kernel variants on this CPU against its measured multiply-add peak")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats)))
        return
    from prefixserve.model import kernels
    from prefixserve.model.cpu_caps import cpu_name

    names = list(kernels.available())
    if not names:
        raise SystemExit("no compiled variant is built: pip install -e . on a machine with gcc")
    cpu = cpu_name()
    print(f"{cpu}; variants this CPU runs: {', '.join(names)}", flush=True)
    rows = []
    for name in names:
        rows.append(run_variant(name, capped=True, repeats=args.repeats))
        print(f"  {rows[-1]['label']}: peak {rows[-1]['peak_gflops']:.0f} GF/s", flush=True)
    rows.append(run_variant(names[-1], capped=False, repeats=args.repeats))
    print(table(rows))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_variants.json").write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    plot(rows, RESULTS / "cpu_variants.png")
    print(f"saved {RESULTS / 'cpu_variants.png'} and .json")


if __name__ == "__main__":
    main()

"""The quantized matmul (csrc/quantized_matmul.cpp) against PyTorch's own CPU weight-only ops and float32, and
our float32 path (the same tiles reading a float32 weight in place) against oneDNN's.

    python benchmarks/quantized_matmul.py [--rows 1,8,64,512] [--repeats 5]

Shapes are SmolLM2-135M's (the real model): the MLP's gate/up and down projections and the tied lm_head.
Per shape and row count, the median time of --repeats timed runs (each a loop of at least 0.2 s) of:
  ours Q4_1 / Q8_0      prefixserve's kernel on the GGUF layouts, float32 activations, rows batch-invariant
  torch int4 (g32)      torch.ops.aten._weight_int4pack_mm_for_cpu, groups of 32 (scale and zero per group)
  torch int8 (channel)  torch.ops.aten._weight_int8pack_mm, one scale per output channel (coarser than Q8_0)
  ours float32          prefixserve's kernel on the float32 weight in place, as the engine's float32 path runs it
                        where our AVX2 / AVX-512 kernels are (linear.py's use_kernel)
  oneDNN float32        the float32 weight packed for oneDNN (the float path elsewhere, and bf16's)
Prints the table with each one's time relative to oneDNN float32 and saves
benchmarks/results/quantized_matmul.{json,png}.
Which CPU: the first line printed (timings differ 2-3x between machines; compare ratios, not times).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from prefixserve.model import kernels
from prefixserve.model.linear import Linear
from prefixserve.model.weights.quantized import quantize

BASELINE = "oneDNN float32"
SHAPES = {"gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}
RESULTS = Path(__file__).resolve().parent / "results"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def timed(run, repeats: int) -> float:
    """Median seconds per call over `repeats` loops of at least 0.2 s each."""
    run()
    samples = []
    for _ in range(repeats):
        began, calls = time.perf_counter(), 0
        while time.perf_counter() - began < 0.2:
            run()
            calls += 1
        samples.append((time.perf_counter() - began) / calls)
    return statistics.median(samples)


def contenders(out_features: int, in_features: int, rows: int):
    """name -> a no-argument call computing x W^T for x of `rows` rows."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    x = torch.randn(rows, in_features, generator=generator)
    compiled = kernels.compiled
    calls = {}
    for name, bits in (("ours Q4_1", 4), ("ours Q8_0", 8)):
        arguments = quantize(weight, bits).kernel_arguments()
        calls[name] = lambda arguments=arguments: compiled.quantized_matmul(x, *arguments, None)
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32, generator=generator)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.rand(in_features // 32, out_features, 2, generator=generator)
    calls["torch int4 (g32)"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)
    int8 = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    channel_scales = torch.rand(out_features, generator=generator)
    calls["torch int8 (channel)"] = lambda: torch.ops.aten._weight_int8pack_mm(x, int8, channel_scales)
    ours = Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        ours.weight.copy_(weight)
    if ours.can_use_kernel():
        ours.use_kernel()
        calls["ours float32"] = lambda: ours.matmul(x)
    linear = Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.pack(max(rows, 1))
    calls[BASELINE] = lambda: linear.matmul(x)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if kernels.compiled is None:
        raise SystemExit("prefixserve's compiled kernels are not built here: pip install -e . on a machine with gcc")
    rows_list = [int(value) for value in args.rows.split(",")]
    print(f"{cpu_name()}; kernels {kernels.variant()}; {torch.get_num_threads()} threads")
    records = []
    header = None
    for shape_name, (out_features, in_features) in SHAPES.items():
        for rows in rows_list:
            calls = contenders(out_features, in_features, rows)
            seconds = {name: timed(run, args.repeats) for name, run in calls.items()}
            if header is None:
                header = f"{'shape':<20} {'rows':>5} " + " ".join(f"{name:>22}" for name in seconds)
                print(header)
            cells = " ".join(
                f"{value * 1e3:>9.3f} ms ({value / seconds[BASELINE]:4.2f}x)" for value in seconds.values()
            )
            print(f"{shape_name:<20} {rows:>5} {cells}")
            records.append({"shape": shape_name, "rows": rows, "seconds": seconds})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quantized_matmul.json").write_text(
        json.dumps({"cpu": cpu_name(), "kernels": kernels.variant(), "records": records}, indent=1) + "\n"
    )
    plot(records, rows_list)


def plot(records: list[dict], rows_list: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(records[0]["seconds"])
    figure, axes = plt.subplots(1, len(SHAPES), figsize=(5 * len(SHAPES), 4), sharey=True)
    for ax, shape_name in zip(axes, SHAPES):
        rows = [record for record in records if record["shape"] == shape_name]
        for name in names:
            ax.plot(
                rows_list,
                [record["seconds"][BASELINE] / record["seconds"][name] for record in rows],
                marker="o",
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_title(shape_name)
        ax.set_xlabel("rows per call")
    axes[0].set_ylabel("speed relative to oneDNN float32 (higher is faster)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(RESULTS / "quantized_matmul.png", dpi=110)
    print(f"saved {RESULTS / 'quantized_matmul.png'}")


if __name__ == "__main__":
    main()

"""One layer's attention on the compiled kernel (csrc/paged_causal.cpp) against PyTorch's flash kernel.

    python benchmarks/attention_kernel.py [--repeats 15]

The built-in model's shape (8 query heads, 4 KV heads, head_dim 64, blocks of 16), float32 and bf16:
  prefill 2,020      one sequence's causal prefill; flash gets the keys contiguous (its best case)
  decode 32x1,000    32 decodes, blocks scattered over a pool 8x their size (a long-running engine)
  shared 32x1,586    32 decodes over one cached 1,536-token prefix + 50 tokens of their own
  chunks 31x50       31 chunks of 50 rows after that shared prefix (the system-prompt workload)
Median milliseconds per call; prints a table, saves benchmarks/results/attention_kernel.png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from prefixserve.model import kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16
SCALE = HEAD_DIM**-0.5
RESULTS = Path(__file__).resolve().parent / "results"


def median_ms(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def cases(dtype: torch.dtype, generator: torch.Generator) -> dict:
    """name -> (paged_causal arguments, a flash call or None)."""

    def pool(num_blocks):
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        return torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)

    def query(rows):
        return torch.randn(rows, HEADS, HEAD_DIM, generator=generator).to(dtype)

    found = {}
    length = 2020
    k_cache, v_cache = pool(-(-length // BLOCK))
    q = query(length)
    keys = k_cache.view(-1, KV_HEADS, HEAD_DIM)[:length].transpose(0, 1).unsqueeze(0)
    values = v_cache.view(-1, KV_HEADS, HEAD_DIM)[:length].transpose(0, 1).unsqueeze(0)
    flash_q = q.transpose(0, 1).unsqueeze(0)
    found["prefill 2,020"] = (
        (
            q,
            k_cache,
            v_cache,
            torch.arange(k_cache.shape[0]).view(1, -1),
            torch.tensor([0, length]),
            torch.tensor([length]),
            SCALE,
        ),
        lambda: F.scaled_dot_product_attention(flash_q, keys, values, is_causal=True, scale=SCALE, enable_gqa=True),
    )

    num, length = 32, 1000
    per = -(-length // BLOCK)
    k_cache, v_cache = pool(8 * num * per)
    tables = torch.randperm(8 * num * per, generator=generator)[: num * per].view(num, per)
    found["decode 32x1,000"] = (
        (query(num), k_cache, v_cache, tables, torch.arange(num + 1), torch.full((num,), length), SCALE),
        None,
    )

    prefix, own = 1536, 50
    shared, mine = prefix // BLOCK, -(-own // BLOCK)
    k_cache, v_cache = pool(shared + num * mine)
    tables = torch.tensor([list(range(shared)) + [shared + i * mine + j for j in range(mine)] for i in range(num)])
    found["shared 32x1,586"] = (
        (query(num), k_cache, v_cache, tables, torch.arange(num + 1), torch.full((num,), prefix + own), SCALE),
        None,
    )
    found["chunks 31x50"] = (
        (
            query(31 * own),
            k_cache,
            v_cache,
            tables[:31],
            torch.arange(32) * own,
            torch.full((31,), prefix + own),
            SCALE,
        ),
        None,
    )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if kernels.compiled is None:
        raise SystemExit("prefixserve's compiled kernel is not built (pip install -e . on a machine with gcc)")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (arguments, flash) in cases(dtype, torch.Generator().manual_seed(0)).items():
            ours = median_ms(lambda arguments=arguments: kernels.compiled.paged_causal(*arguments), args.repeats)
            theirs = median_ms(flash, args.repeats) if flash is not None else None
            rows.append((str(dtype).removeprefix("torch."), name, ours, theirs))
    print(f"{'dtype':<9} {'case':<16} {'paged_causal':>13} {'flash':>9}")
    for dtype, name, ours, theirs in rows:
        flash = f"{theirs:>6.2f} ms" if theirs is not None else f"{'-':>9}"
        print(f"{dtype:<9} {name:<16} {ours:>10.2f} ms {flash}")
    plot(rows, RESULTS / "attention_kernel.png")
    print(f"wrote {RESULTS / 'attention_kernel.png'}")


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{dtype}\n{name}" for dtype, name, _, _ in rows]
    positions = range(len(rows))
    ax.bar([p - 0.2 for p in positions], [ours for _, _, ours, _ in rows], 0.4, label="paged_causal")
    ax.bar([p + 0.2 for p in positions], [theirs or 0 for *_, theirs in rows], 0.4, label="PyTorch flash")
    ax.set_xticks(list(positions), labels, fontsize=7)
    ax.set_ylabel("ms per layer")
    ax.set_title("One layer's attention, prefixserve-tiny's shape, CPU")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

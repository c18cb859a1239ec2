"""Where the engine runs: device, dtype, and on CUDA how much memory the KV pool gets."""

from __future__ import annotations

import torch

from ..config import EngineConfig
from ..model import AttentionMetadata

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # by name


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available; use device='cpu'")
    return torch.device(name)


BF16_VARIANTS = ("avx512_bf16", "amx")  # the kernel variants that score bf16 with bf16 instructions


def cpu_has_fast_bfloat16() -> bool:
    """Whether bf16 is this CPU's fastest exact dtype: the kernel variant in use scores bf16 with the
    CPU's bf16 instructions (avx512_bf16 or amx, not capped below them by PREFIXSERVE_CPU_ISA) and
    oneDNN multiplies bf16 natively (not capped by ONEDNN_MAX_CPU_ISA). Elsewhere bf16 is served
    exactly too (linear.py computes its matmuls in float32), only not faster than float32."""
    from ..model import kernels
    from ..model.linear import native_bfloat16_matmul

    return kernels.variant() in BF16_VARIANTS and native_bfloat16_matmul()


def resolve_dtype(name: str, device: torch.device, quantized: bool = False) -> torch.dtype:
    """auto: bfloat16 on CUDA; on CPU, the fastest exact dtype: bfloat16 where cpu_has_fast_bfloat16,
    else float32.

    Why bfloat16 is safe on CPU: a cache hit must never change an output, and in bf16 rounding
    depends on the order of every sum. The compiled attention kernel (csrc/paged_causal.cpp) sums
    each row in an order of its own and the linear layers are called only with row counts measured
    to round a row as in any batch (model/row_calls.py), so a token's numbers do not depend on its
    batch, its chunking or a cache hit: greedy tokens with caching on and off are identical on 100%
    of benchmarks/compare.py's requests (vLLM's CPU build: 64%). On a CPU with bf16 instructions bf16
    runs the suite 1.25-1.6x faster than float32 (AVX-512 BF16, measured on an AMD EPYC). Without
    them (AVX2) bf16's matmuls run in float32 and cost more than float32 itself, so auto is float32.
    Quantized weights multiply float32 activations (model/weights/quantized_linear.py): auto is float32 there.
    """
    if name != "auto":
        return TORCH_DTYPES[name]
    if quantized:
        return torch.float32
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_fast_bfloat16() else torch.float32


def check_exact(dtype: torch.dtype, device: torch.device, batch_invariant: bool) -> None:
    """Refuse a batch-invariant bfloat16 engine that cannot keep its promise: on CPU without the
    compiled kernel, bf16 attention is exact only through model/attention/invariant.py, measured on AVX-512."""
    from ..model import kernels
    from ..model.attention import invariant as invariant_attention

    if dtype != torch.bfloat16 or device.type != "cpu" or not batch_invariant or kernels.compiled is not None:
        return
    if invariant_attention.measured_here():
        return
    raise ValueError(
        "bfloat16 needs prefixserve's compiled kernels on this CPU to keep cache hits exact (without them bf16 "
        f"attention is exact only on AVX-512 CPUs; this one runs PyTorch at {invariant_attention.aten_capability()}"
        f" and its kernels are {kernels.variant()!r}: {kernels.describe_build()}). Use --dtype float32 (dtype="
        "'float32'), reinstall with a C++ compiler (`pip install -e .`), or pass --no-batch-invariant to accept "
        "outputs that depend on batching"
    )


def measure_cuda_kv_budget(
    loaded, config: EngineConfig, device: torch.device, dtype: torch.dtype, max_model_len: int
) -> int:
    """Free device memory after weights and a measured activation peak, times the utilisation."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = min(config.max_num_batched_tokens, max_model_len)
    size = config.block_size
    cfg = loaded.config
    num_probe_blocks = -(-num_tokens // size)
    shape = (num_probe_blocks, size, cfg.num_key_value_heads, cfg.head_dim)
    probe_caches = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_hidden_layers)
    ]
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [list(range(num_probe_blocks))], size, device)
    with torch.inference_mode():
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        hidden = loaded.model(ids, torch.arange(num_tokens, device=device), probe_caches, meta)
        loaded.model.compute_logits(hidden[-min(num_tokens, config.max_num_seqs) :])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del probe_caches, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_allocated(device)
    return max(int(total * config.gpu_memory_utilization) - used_by_others - peak, 0)

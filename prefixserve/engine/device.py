"""Where the engine runs: device, dtype, and on CUDA how much memory the KV pool gets."""

from __future__ import annotations

import torch

from ..config import EngineConfig
from ..model import AttentionMetadata


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available; use device='cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA, float32 on CPU.

    On CPU, bfloat16 keeps the cache's promise too since its attention became batch-invariant
    (model/invariant_attention.py; before, cache-on and cache-off greedy tokens agreed on only
    9-19% of requests), but that path gives up the shared-prefix cascade: 32 requests decoding
    over a shared 300-token prefix take 1.3-1.6x the time of the fastest bf16 path, and more
    than float32 with its cascade (issue 15), over the 15% the issue allows, so auto stays
    float32 on CPU for now. Per step, bf16 runs 1.3-2.2x faster than float32 on CPUs with bf16
    instructions (benchmarks/bf16_step_time.py); the engine says so at start-up.
    """
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def measure_cuda_kv_budget(loaded, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                           max_model_len: int) -> int:
    """Free device memory after weights and a measured activation peak, times the utilisation."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = min(config.max_num_batched_tokens, max_model_len)
    size = config.block_size
    cfg = loaded.config
    num_probe_blocks = -(-num_tokens // size)
    shape = (num_probe_blocks, size, cfg.num_key_value_heads, cfg.head_dim)
    probe_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                     torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [list(range(num_probe_blocks))], size, device)
    with torch.inference_mode():
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        hidden = loaded.model(ids, torch.arange(num_tokens, device=device), probe_caches, meta)
        loaded.model.compute_logits(hidden[-min(num_tokens, config.max_num_seqs):])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del probe_caches, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_allocated(device)
    return max(int(total * config.gpu_memory_utilization) - used_by_others - peak, 0)

"""What decides the bits of a block's K/V besides the model and the tokens: the numerics fingerprint.

Two engines produce the same K/V for the same tokens only if they run the same arithmetic: the same
dtype, the same compiled kernel variant, the same PyTorch and GEMM library picking the same kernels
(the CPU's instruction sets, the library caps, the thread count), the same batch-invariance rule.
Records fetched from a shared tier were computed by another replica; were its arithmetic different,
a hit would change this replica's outputs (a bf16 block from an AVX-512 replica is not what an AVX2
replica computes). So the fingerprint is part of the cache scope (cache/keys.py): replicas that
differ in any of these share no blocks, a miss rather than KV this replica cannot vouch for.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from ..model import kernels
from ..model.cpu_caps import cpu_features
from ..model.linear import float_kernel

# The CPU features that change which kernels PyTorch, oneDNN and MKL run (torch's cpuinfo names).
_GEMM_FEATURES = (
    "avx2",
    "fma3",
    "avx512_f",
    "avx512_bw",
    "avx512_dq",
    "avx512_vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "avx_vnni",
    "avx_ne_convert",
)
_LIBRARY_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def numerics_description(dtype: torch.dtype, device: torch.device, batch_invariant: bool) -> dict:
    """Everything the fingerprint covers, readable (the start-up log and /v1/cache/info show it)."""
    described = {
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "torch": torch.__version__,
        "batch_invariant": batch_invariant,
    }
    if device.type == "cuda":
        described["gpu"] = torch.cuda.get_device_name(device)
        described["capability"] = list(torch.cuda.get_device_capability(device))
        return described
    features = cpu_features()
    described.update(
        {
            "kernels": kernels.variant(),
            "cpu_features": [name for name in _GEMM_FEATURES if name in features],
            "library_caps": {name: os.environ[name] for name in _LIBRARY_CAPS if name in os.environ},
            "threads": torch.get_num_threads(),
            "onednn": torch.backends.mkldnn.is_available(),
            # float32 weights: our kernel's tiles or oneDNN's (linear.py), which sum in other orders
            "float32_matmul": "kernels" if float_kernel() is not None else "onednn",
        }
    )
    return described


def numerics_fingerprint(dtype: torch.dtype, device: torch.device, batch_invariant: bool) -> str:
    """A short digest of numerics_description, prefixed with its dtype and variant for people."""
    described = numerics_description(dtype, device, batch_invariant)
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
    return f"{described['dtype']}/{described.get('kernels', described['device'])}/{digest}"

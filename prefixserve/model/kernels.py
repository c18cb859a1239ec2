"""prefixserve's compiled CPU kernels (prefixserve/csrc/, built by `pip install -e .`), or None.

They have pure-PyTorch reference paths that stay the fallback and the test oracle:

    paged_causal   every row of a step (prefill chunks and decodes),       reference: attention.py's plan
                   read in place from the paged cache; a row at p reads    path (float32) and
                   keys [0, p + 1), and its bits are its own whatever      invariant_attention.py (bf16)
                   else is in the batch
    rms_norm, add_rms_norm_, rotate_heads_, silu_mul                       reference: llama.py's RMSNorm,
                   float32 row-wise work of a decoder layer in one pass    rotate and MLP
                   each (AVX-512 builds only)

Where the extension was not built (no compiler at install time) a warning is logged once and
the reference paths run. PREFIXSERVE_KERNELS=0 turns the kernels off (to compare the paths).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("prefixserve.model")


def _load():
    if os.environ.get("PREFIXSERVE_KERNELS", "1") == "0":
        return None
    try:
        from prefixserve import _C
    except ImportError as error:
        logger.warning("prefixserve's compiled kernels are not built (%s): attention runs the slower "
                       "pure-PyTorch path. Reinstall with `pip install -e .` on a machine with gcc.", error)
        return None
    return _C


compiled = _load()


def _usable(k_cache: torch.Tensor) -> bool:
    return (compiled is not None and k_cache.device.type == "cpu" and k_cache.dtype in (torch.float32, torch.bfloat16)
            and k_cache.is_contiguous())


def causal_kernel_for(k_cache: torch.Tensor):
    """The compiled paged_causal for this cache, or None."""
    return compiled.paged_causal if _usable(k_cache) else None


def rowwise_for(x: torch.Tensor):
    """The compiled module when its row-wise kernels take x (float32, CPU, contiguous), or None.
    Callers still check their widths (multiples of 16; head_dim a multiple of 32)."""
    if (compiled is None or not hasattr(compiled, "silu_mul") or x.device.type != "cpu"
            or x.dtype != torch.float32 or not x.is_contiguous()):
        return None
    return compiled

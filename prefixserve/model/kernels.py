"""prefixserve's compiled CPU kernel (prefixserve/csrc/, built by `pip install -e .`), or None.

It has pure-PyTorch reference paths that stay the fallback and the test oracle:

    paged_causal   every row of a step (prefill chunks and decodes),       reference: attention.py's plan
                   read in place from the paged cache; a row at p reads    path (float32) and
                   keys [0, p + 1), and its bits are its own whatever      invariant_attention.py (bf16)
                   else is in the batch

Where the extension was not built (no compiler at install time) a warning is logged once and
the reference paths run. PREFIXSERVE_KERNELS=0 turns the kernel off (to compare the paths).
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

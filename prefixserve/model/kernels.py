"""prefixserve's compiled CPU kernels (prefixserve/csrc/, built by `pip install -e .`) in the variant
this CPU runs best, or None.

    paged_causal   every row of a step (prefill chunks and decodes),       reference: attention/'s
                   read in place from the paged cache; a row at p reads    cascade.py (float32) and
                   keys [0, p + 1), and its bits are its own whatever      invariant.py (bf16)
                   else is in the batch
    rms_norm, add_rms_norm_, rotate_heads_, silu_mul                       reference: llama.py's RMSNorm,
                   float32 and bf16 row-wise work of a decoder layer in    rotate and MLP
                   one pass each (every variant with a fused multiply-add)

The kernel sources are built once per instruction set (kernel_variants.py: portable, avx2, avx512,
avx512_bf16, amx on x86-64; portable, neon on aarch64). At import the most capable variant whose
instructions the CPU has is loaded; PREFIXSERVE_CPU_ISA=<variant> caps the choice (as
ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY cap PyTorch's), PREFIXSERVE_KERNELS=0 turns the kernels
off. Where nothing was built (no compiler at install time) a warning is logged once and the
reference paths run. `variant()` names what runs: a variant, or "pytorch".
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from typing import Optional

import torch

from .cpu_caps import amx_permitted, cpu_features
from .kernel_variants import Variant, module_name, variants_for

logger = logging.getLogger("prefixserve.model")

CAP_VARIABLE = "PREFIXSERVE_CPU_ISA"
PYTORCH = "pytorch"  # variant() where no compiled kernel runs


def cap() -> Optional[str]:
    """PREFIXSERVE_CPU_ISA's variant, checked against this machine's variants; None when unset."""
    value = os.environ.get(CAP_VARIABLE, "").strip().lower()
    if not value:
        return None
    names = [variant.name for variant in variants_for()]
    if value not in names:
        raise ValueError(
            f"{CAP_VARIABLE}={value!r} names no kernel variant of this machine; "
            f"use one of {', '.join(names)} (or unset it for the best this CPU runs)"
        )
    return value


def executable() -> tuple[Variant, ...]:
    """The variants whose instructions this CPU has, least capable first (the cap not applied); AMX
    variants also need the OS's grant of the tile state."""
    features = cpu_features()
    return tuple(
        variant
        for variant in variants_for()
        if set(variant.needs) <= features and ("amx_tile" not in variant.needs or amx_permitted())
    )


def allowed() -> tuple[Variant, ...]:
    """The executable variants up to the cap, least capable first."""
    limit = cap()
    runnable = executable()
    if limit is None:
        return runnable
    order = [variant.name for variant in variants_for()]
    return tuple(variant for variant in runnable if order.index(variant.name) <= order.index(limit))


def is_built(name: str) -> bool:
    return importlib.util.find_spec(module_name(name)) is not None


class CompiledKernels:
    """One variant's kernels, each bound to its table: `compiled.paged_causal(q, k_cache, ...)`.
    The row-wise kernels are attributes only where the variant has them."""

    def __init__(self, binding, module) -> None:
        self.table = module.table
        info = binding.describe(self.table)
        self.variant: str = info["variant"]
        self.backend: str = info["backend"]
        self.lanes: int = info["lanes"]
        self.bf16_pairs: bool = info["bf16_pairs"]
        self.has_rowwise: bool = info["rowwise"]
        self.paged_causal = functools.partial(binding.paged_causal, self.table)
        self.multiply_add_flops = functools.partial(binding.multiply_add_flops, self.table)  # benchmarks' peak
        self.quantized_matmul = functools.partial(binding.quantized_matmul, self.table)
        self.dequantize = functools.partial(binding.dequantize, self.table)
        # every decoder layer of a step in one call (decoder_stack.py); None from a binding built before it
        self.decoder_stack = (
            functools.partial(binding.DecoderStack, self.table) if hasattr(binding, "DecoderStack") else None
        )
        # LoRA adapters' slots and updates (lora/step.py); None from a binding built before them
        self.lora_slots = functools.partial(binding.LoRASlots, self.table) if hasattr(binding, "LoRASlots") else None
        if self.has_rowwise:
            self.rms_norm = functools.partial(binding.rms_norm, self.table)
            self.add_rms_norm_ = functools.partial(binding.add_rms_norm_, self.table)
            self.rotate_heads_ = functools.partial(binding.rotate_heads_, self.table)
            self.silu_mul = functools.partial(binding.silu_mul, self.table)

    def __repr__(self) -> str:
        return f"CompiledKernels({self.variant!r}, {self.lanes} float32 lanes)"


def load(name: str) -> CompiledKernels:
    """The kernels of one variant; ValueError where this CPU cannot run it or it was not built."""
    if name not in {variant.name for variant in executable()}:
        raise ValueError(
            f"this CPU cannot run the {name!r} kernels (it runs {', '.join(variant.name for variant in executable())})"
        )
    from prefixserve import _C  # ImportError where the binding was not built

    return CompiledKernels(_C, importlib.import_module(module_name(name)))


def available() -> tuple[str, ...]:
    """The variants this CPU runs that were built, least capable first (the cap not applied): what the
    tests run one after another."""
    if importlib.util.find_spec("prefixserve._C") is None:
        return ()
    return tuple(variant.name for variant in executable() if is_built(variant.name))


def _choose() -> Optional[CompiledKernels]:
    if os.environ.get("PREFIXSERVE_KERNELS", "1") == "0":
        return None
    candidates = [variant.name for variant in allowed()]
    for name in reversed(candidates):
        if not is_built(name):
            continue
        try:
            return load(name)
        except ImportError as error:
            logger.warning("prefixserve's %s kernels did not load (%s)", name, error)
    logger.warning(
        "prefixserve's compiled kernels are not built for this CPU (it runs %s; %s): attention runs "
        "the slower pure-PyTorch path. Reinstall with `pip install -e .` on a machine with gcc.",
        ", ".join(candidates) or "none of them",
        describe_build(),
    )
    return None


def describe_build() -> str:
    built = [variant.name for variant in variants_for() if is_built(variant.name)]
    return "built: " + (", ".join(built) if built else "none")


compiled = _choose()


def variant() -> str:
    """The compiled variant in use ("avx2", ...), or "pytorch" when no compiled kernel runs."""
    return compiled.variant if compiled is not None else PYTORCH


def describe() -> str:
    """One line for the start-up log: what runs, what the CPU could run, the cap."""
    limit = cap()
    return (
        f"kernels: {variant()} (CPU runs {', '.join(v.name for v in executable()) or 'none'}; "
        f"{describe_build()}" + (f"; capped at {limit} by {CAP_VARIABLE}" if limit else "") + ")"
    )


def _usable(k_cache: torch.Tensor) -> bool:
    return (
        compiled is not None
        and k_cache.device.type == "cpu"
        and k_cache.dtype in (torch.float32, torch.bfloat16)
        and k_cache.is_contiguous()
    )


def causal_kernel_for(k_cache: torch.Tensor):
    """The compiled paged_causal for this cache, or None."""
    return compiled.paged_causal if _usable(k_cache) else None


def lora_slots_for(device: torch.device):
    """The compiled kernels' LoRASlots maker (num_slots, num_layers) for a model on `device`, or None."""
    return compiled.lora_slots if compiled is not None and device.type == "cpu" else None


def rowwise_for(x: torch.Tensor):
    """The compiled kernels when their row-wise kernels take x (float32 or bf16, CPU, contiguous), or
    None. Callers still check their widths (multiples of 16; head_dim a multiple of 32)."""
    if (
        compiled is None
        or not compiled.has_rowwise
        or x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
        or not x.is_contiguous()
    ):
        return None
    return compiled

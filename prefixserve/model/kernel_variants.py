"""The compiled kernel variants: one build of prefixserve/csrc's kernel sources per instruction set.

setup.py builds each variant of the machine it runs on as the extension module
`prefixserve._kernels_<name>` (its flags below, never -march=native, so a built wheel runs on any CPU
of its architecture); prefixserve.model.kernels imports the most capable one whose `needs` the CPU
has (PyTorch's cpuinfo names), capped by PREFIXSERVE_CPU_ISA. Listed per machine from the least to
the most capable. Standard library only: setup.py reads this file before anything is installed.
"""

from __future__ import annotations

import platform
from typing import NamedTuple


class Variant(NamedTuple):
    name: str
    backend: str  # csrc/simd.h's backend: PORTABLE, AVX2, AVX512, NEON
    flags: tuple[str, ...]  # compiler flags of its instruction set
    needs: tuple[str, ...]  # CPU features it executes (keys of torch's cpuinfo report)


_X86 = ("-march=x86-64", "-mtune=generic")  # the x86-64 baseline: SSE2, no AVX
# F16C (float16 conversion in one instruction: the quantized matmul's scales) came with AVX2 on every CPU since
# Haswell and Zen.
_AVX2 = _X86 + ("-mavx2", "-mfma", "-mf16c")
_AVX512 = _AVX2 + ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
_AVX512_NEEDS = ("avx2", "fma3", "f16c", "avx512_f", "avx512_bw", "avx512_dq", "avx512_vl")

VARIANTS: dict[str, tuple[Variant, ...]] = {
    "x86_64": (
        Variant("portable", "PORTABLE", _X86, ()),
        Variant("avx2", "AVX2", _AVX2, ("avx2", "fma3", "f16c")),
        Variant("avx512", "AVX512", _AVX512, _AVX512_NEEDS),
        Variant("avx512_bf16", "AVX512", _AVX512 + ("-mavx512bf16",), _AVX512_NEEDS + ("avx512_bf16",)),
        # bf16 attention on AMX tiles (Sapphire Rapids and later); the OS must grant the tile state
        # (kernels.py asks for it through torch before loading this variant).
        Variant(
            "amx",
            "AVX512",
            _AVX512 + ("-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
            _AVX512_NEEDS + ("avx512_bf16", "amx_tile", "amx_bf16"),
        ),
    ),
    # NEON is part of the aarch64 baseline: every aarch64 CPU runs both.
    "aarch64": (
        Variant("portable", "PORTABLE", ("-march=armv8-a",), ()),
        Variant("neon", "NEON", ("-march=armv8-a",), ()),
    ),
}
# Any other architecture gets the portable build with its compiler's default target.
GENERIC = (Variant("portable", "PORTABLE", (), ()),)

# What PyTorch's own libraries are capped at to run as a CPU of each variant's class would: with
# PREFIXSERVE_CPU_ISA, these let one machine stand in for a lesser one (CI's capped suite,
# benchmarks' --cpu-isa). Set them in the environment before the process starts: ATen and oneDNN
# read them once.
LIBRARY_CAPS: dict[str, dict[str, str]] = {
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "avx512_bf16": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "amx": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
}


def capped_environment(variant: str) -> dict[str, str]:
    """The environment variables that make a process run as a CPU of `variant`'s class (ours and
    PyTorch's caps together)."""
    return {"PREFIXSERVE_CPU_ISA": variant, **LIBRARY_CAPS.get(variant, {})}


# The binding module (prefixserve._C) holds no hot loop: the baseline of its machine.
BINDING_FLAGS = {"x86_64": _X86, "aarch64": ("-march=armv8-a",)}

_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def machine(name: str | None = None) -> str:
    """The architecture's name as VARIANTS spells it ("x86_64", "aarch64", or the platform's own)."""
    raw = (name or platform.machine()).lower()
    return _MACHINE_ALIASES.get(raw, raw)


def variants_for(name: str | None = None) -> tuple[Variant, ...]:
    """The variants of an architecture (this machine's by default), least capable first."""
    return VARIANTS.get(machine(name), GENERIC)


def module_name(variant: str) -> str:
    return f"prefixserve._kernels_{variant}"

"""What this CPU has, and what the library caps let PyTorch's libraries use of it.

    cpu_features()      instruction sets the CPU (and the OS) support, torch's cpuinfo names
    onednn_allows(L)    ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) does not cap oneDNN below level L
    mkl_allows_avx512() MKL_ENABLE_INSTRUCTIONS does not cap MKL below AVX-512
    aten_capability()   the kernels ATen dispatches to ("AVX512", "AVX2", "DEFAULT"; ATEN_CPU_CAPABILITY caps it)

Where a result depends on which kernels a library picks (the speed of bf16 matmuls, whether a
pure-PyTorch path was measured batch-invariant), the engine asks here; the caps are read from the
environment as the libraries read it, once at their start.
"""

from __future__ import annotations

import functools
import os

import torch

# /proc/cpuinfo flag -> the name torch's cpuinfo report gives it (the fallback reads the former).
_PROC_FLAGS = {
    "avx2": "avx2",
    "fma": "fma3",
    "f16c": "f16c",
    "avx512f": "avx512_f",
    "avx512bw": "avx512_bw",
    "avx512dq": "avx512_dq",
    "avx512vl": "avx512_vl",
    "avx512_bf16": "avx512_bf16",
    "amx_bf16": "amx_bf16",
    "amx_tile": "amx_tile",
    "avx512_vnni": "avx512_vnni",
}
AVX512 = frozenset({"avx512_f", "avx512_bw", "avx512_dq", "avx512_vl"})

# oneDNN's instruction-set levels, lowest first (ONEDNN_MAX_CPU_ISA's values).
ONEDNN_LEVELS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
)


@functools.lru_cache(maxsize=None)
def cpu_features() -> frozenset[str]:
    """The CPU's instruction-set features, named as torch's cpuinfo report names them (the OS's
    support for the registers included): from PyTorch, else Linux's /proc/cpuinfo."""
    report = getattr(torch._C._cpu, "_get_cpu_capability", None)
    if report is not None:
        return frozenset(name for name, present in report().items() if present is True)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        flags = []
    return frozenset(_PROC_FLAGS[flag] for flag in flags if flag in _PROC_FLAGS)


@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), which every benchmark prints beside its figures."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(
                (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown CPU"
            )
    except OSError:
        return "unknown CPU"


def amx_permitted() -> bool:
    """Whether this process may use AMX tiles: Linux grants the tile state on request (torch asks for
    it, as oneDNN does); without the grant a tile instruction is SIGILL."""
    request = getattr(torch._C._cpu, "_init_amx", None)
    return bool(request()) if request is not None and {"amx_tile", "amx_bf16"} <= cpu_features() else False


def onednn_allows(level: str) -> bool:
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if not cap or cap not in ONEDNN_LEVELS:  # unset, ALL, or a name newer than this table: no cap below
        return True
    return ONEDNN_LEVELS.index(cap) >= ONEDNN_LEVELS.index(level)


def mkl_allows_avx512() -> bool:
    cap = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "").strip().upper()
    return not cap or cap.startswith("AVX512")


def aten_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()

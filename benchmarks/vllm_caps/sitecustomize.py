"""Caps vLLM's own kernel choice to the CPU class PREFIXSERVE_CPU_ISA names (benchmarks' --cpu-isa).

vLLM picks its compiled kernels (_C_AVX2, _C_AVX512, _C with AVX-512 BF16 and AMX paths) from
torch.cpu's hardware checks, which ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA do not change. compare.py
puts this directory on the vLLM peer's PYTHONPATH when it runs both engines as a lesser CPU, so that
every vLLM process (its engine core is another process) sees the same capped machine. Nothing of
prefixserve is imported: this runs in vLLM's own virtualenv.
"""

import os

_CAP = os.environ.get("PREFIXSERVE_CPU_ISA", "").strip().lower()
_ABSENT = {
    "portable": (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_avx512_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
        "_is_avx2_supported",
    ),
    "avx2": (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_avx512_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ),
    "avx512": ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"),
    "avx512_bf16": ("_is_amx_tile_supported", "_is_amx_fp16_supported"),
}.get(_CAP, ())

if _ABSENT:
    import torch

    for _name in _ABSENT:
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)

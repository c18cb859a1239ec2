"""Planners: pure computation on measured or given inputs (`prefixserve plan ...`).

Imports cache/ and tiers/ only; the command line measures and passes numbers in.
"""

from .tiers import (
    CrossoverMatch,
    Profile,
    TierCrossover,
    crossovers,
    fit_read_cost,
    format_report,
    gpu_profile,
    kv_bytes_per_token,
    report_json,
)

__all__ = [
    "CrossoverMatch",
    "Profile",
    "TierCrossover",
    "crossovers",
    "fit_read_cost",
    "format_report",
    "gpu_profile",
    "kv_bytes_per_token",
    "report_json",
]

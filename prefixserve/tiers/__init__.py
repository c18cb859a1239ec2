"""KV tiers below the device pool: host RAM and local disk, the record they store, and the fetch planner.

Standard library only (plus prefixserve.cache, and `cryptography` for the seal):
bytes in, bytes out. The engine's runner turns pool tensors into record payloads
and back.
"""

from .base import KVTier, TierStats, TierTraits
from .disk import DiskTier
from .disk_startup import RebuildReport
from .host import HostTier
from .policy import FetchPlan, TierCost, choose_fetch, crossover_tokens, find_run, plan_fetch
from .record import BlockRecord, RecordError, RecordExpectation, RecordHeader, decode_record, encode_record, read_header
from .seal import Keyring, Sealer

__all__ = [
    "BlockRecord",
    "DiskTier",
    "FetchPlan",
    "HostTier",
    "KVTier",
    "Keyring",
    "RebuildReport",
    "RecordError",
    "RecordExpectation",
    "RecordHeader",
    "Sealer",
    "TierCost",
    "TierStats",
    "TierTraits",
    "choose_fetch",
    "crossover_tokens",
    "decode_record",
    "encode_record",
    "find_run",
    "plan_fetch",
    "read_header",
]

"""The parts an LLMEngine steps over, each built once (assembly.py) and handed in whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..cache import BlockKeyer, RadixCache
from ..cache.events import EventQueue
from ..cache.hot_prefixes import HotPrefixPolicy
from ..cache.reuse_gaps import ReuseGapTracker
from ..cache.window_slots import WindowSlots
from ..config import EngineConfig
from .input_processor import InputProcessor
from .kv_tiers import TieredKV
from .model_version import CurrentVersion
from .operations.pins import PinTable
from .output_processor import OutputProcessor
from .runner import ModelRunner
from .scheduler import Scheduler


@dataclass(frozen=True)
class EngineParts:
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    weights: str  # "float", or the quantized layout the weights stay in (model_version.weight_format)
    numerics: str  # what decides a result's bits (numerics.py): part of every cache key
    current: CurrentVersion
    events: Optional[EventQueue]  # KV events, None when off
    cache: RadixCache
    keyer: BlockKeyer
    window_slots: Optional[WindowSlots]
    reuse_gaps: ReuseGapTracker
    hot_prefixes: Optional[HotPrefixPolicy]
    scheduler: Scheduler
    runner: ModelRunner
    tiers: TieredKV  # empty when nothing lies below the pool
    inputs: InputProcessor
    outputs: OutputProcessor
    pins: PinTable
    kv_events: object  # the vLLM-format publisher (kv_event_publisher.py), a null one unless asked for
    startup_summary: str

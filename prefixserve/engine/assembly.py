"""build_engine: an LLMEngine assembled from a config, each part built once and handed in.

device, dtype, numerics -> the model version -> the KV pool's size -> cache, keyer, window slots
    -> runner (weights packed, pool allocated) -> the tiers below the pool -> the prefix sources (device,
    then tiers) -> scheduler -> input and output processing, pins -> KV event publisher (last: a failed start
    binds nothing)
"""

from __future__ import annotations

import logging
from typing import Optional

from ..cache import BlockKeyer, RadixCache
from ..cache.hot_prefixes import HotPrefixPolicy
from ..cache.reuse_gaps import ReuseGapTracker
from ..cache.tenant_pins import TenantPins
from ..config import EngineConfig
from ..lora.registry import AdapterRegistry
from .device import check_exact, resolve_device, resolve_dtype
from .engine import LLMEngine
from .engine_parts import EngineParts
from .input_processor import InputProcessor
from .kv_event_publisher import kv_event_queue, make_kv_event_publisher
from .kv_pool_size import size_kv_pool, startup_summary, window_slots_for
from .model_version import CurrentVersion, load_version, weight_format
from .numerics import numerics_fingerprint
from .operations.pins import PinTable
from .output_processor import OutputProcessor
from .prefix_sources import PrefixSources
from .request_windows import RequestWindows
from .runner import ModelRunner
from .scheduler import Scheduler
from .speculation import Speculation
from .tier_setup import tiered_kv

logger = logging.getLogger("prefixserve")


def build_engine(config: EngineConfig) -> LLMEngine:
    """The engine `config` describes; pins saved by the last run are warmed (from the disk tier) and restored."""
    device = resolve_device(config.device)
    weights = weight_format(config.model, config.quantize, config.dequantize, device)  # "float", ...
    dtype = resolve_dtype(config.dtype, device, quantized=weights != "float")
    check_exact(dtype, device, config.batch_invariant)
    numerics = numerics_fingerprint(dtype, device, config.batch_invariant)
    loaded_version = load_version(config.model, dtype, device, numerics, config.block_size, weights=weights)
    loaded = loaded_version.loaded
    pool = size_kv_pool(config, loaded, device, dtype)
    current = CurrentVersion(loaded_version.within(pool.max_model_len))

    events = kv_event_queue(config)
    shares = config.shares()
    cache = RadixCache(
        pool.num_blocks, config.block_size, max_pinned_blocks=config.max_pinned_blocks, events=events, shares=shares
    )
    window_slots = window_slots_for(cache, pool, loaded.config)
    keyer = BlockKeyer(config.block_size, config.prefix_hash)
    reuse_gaps = ReuseGapTracker(config.block_size)
    tenant_pins = TenantPins(shares, cache.pins.max_blocks)
    hot_prefixes = (
        HotPrefixPolicy(
            config.hot_prefix_min_requests,
            config.hot_prefix_window,
            max_blocks=cache.pins.max_blocks // 2,
            tenant_pins=tenant_pins,
        )
        if config.hot_prefix_min_requests and config.enable_prefix_caching
        else None
    )
    # float32 weights to our kernel, the others laid out for oneDNN once, sized for a full step's token
    # budget (CPU only).
    _progress(config, "packing weights for this CPU ...")
    loaded.model.pack_linear_weights(batch_size_hint=config.max_num_batched_tokens)
    _progress(config, f"allocating the KV pool: {pool.num_blocks} blocks ({pool.num_bytes / 2**20:.0f} MiB) ...")
    runner = ModelRunner(
        current,
        pool.num_blocks,
        config.block_size,
        dtype,
        device,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        config.seed,
        batch_invariant=config.batch_invariant,
        window_slots=window_slots,
        enable_lora=config.enable_lora,
        max_loras=config.max_loras,
    )
    version = current.version
    tiers = tiered_kv(config, version.scope.digest, runner, cache, keyer)
    # admission asks the device radix, then the tiers below it, through one interface
    sources = PrefixSources(cache, keyer, RequestWindows(window_slots), config.enable_prefix_caching, tiers.reader)
    scheduler = Scheduler(
        cache,
        keyer,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        policy=config.scheduling_policy,
        reuse_gaps=reuse_gaps,
        hot_prefixes=hot_prefixes,
        window_slots=window_slots,
        long_rope_after=loaded.config.long_rope_after,
        sources=sources,
        max_loras=config.max_loras if config.enable_lora else None,
        speculation=Speculation(config.speculative_config) if config.speculative_config is not None else None,
    )
    summary = startup_summary(config, version, dtype, device, numerics, pool, runner.attention.name)
    parts = EngineParts(
        config=config,
        device=device,
        dtype=dtype,
        weights=weights,
        numerics=numerics,
        current=current,
        events=events,
        cache=cache,
        keyer=keyer,
        window_slots=window_slots,
        reuse_gaps=reuse_gaps,
        hot_prefixes=hot_prefixes,
        scheduler=scheduler,
        runner=runner,
        tiers=tiers,
        inputs=InputProcessor(current, config.prefix_ttl, adapter_registry(config, current)),
        outputs=OutputProcessor(current),
        pins=PinTable(
            cache,
            keyer,
            config.block_size,
            config.kv_disk_cache_dir,
            version.tokenizer.fingerprint,
            tenant_pins=tenant_pins,
            soft_pins=hot_prefixes,
        ),
        # vLLM-format KV events over ZMQ (a null object unless asked for); last, so a failed start binds nothing
        kv_events=make_kv_event_publisher(config.kv_events_config, events),
        startup_summary=summary,
    )
    engine = LLMEngine(parts)
    if config.log_stats:
        logger.info(summary)
    if engine.pins.to_restore:  # pins saved by the last run: warm them (from the disk tier) and pin
        engine.restore_pins()
    return engine


def _progress(config: EngineConfig, message: str) -> None:
    if config.log_stats:
        logger.info(message)


def adapter_registry(config: EngineConfig, current: CurrentVersion) -> Optional[AdapterRegistry]:
    """The engine's LoRA adapters (lora/registry.py), None unless enable_lora: loaded on first use, checked
    against the base model's shapes and max_lora_rank, at most max_cpu_loras kept."""
    if not config.enable_lora:
        return None
    return AdapterRegistry(current, config.max_lora_rank, config.max_cpu_loras or config.max_loras)

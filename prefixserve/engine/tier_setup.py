"""The tiers an EngineConfig asks for, built nearest first (host, disk, remote), each sealing its records
with the fleet's secret when there is one, and the TieredKV that drives them for an engine."""

from __future__ import annotations

import logging
from typing import Optional

from ..config import DEFAULT_DISK_CACHE_BYTES
from ..tiers import DiskTier, HostTier, Keyring, KVTier, Sealer
from .kv_tiers import TieredKV

logger = logging.getLogger("prefixserve")


def tiered_kv(config, scope_digest: bytes, runner, cache, keyer) -> TieredKV:
    """The tiers below an engine's pool, driven as one TieredKV (empty when the configuration asks for none)."""
    tiers = build_tiers(config, scope_digest)
    if tiers and config.log_stats:
        logger.info(
            "KV tiers below the pool: "
            + ", ".join(f"{tier.name} {tier.capacity_bytes / 2**20:.0f} MiB" for tier in tiers)
        )
    return TieredKV(
        tiers,
        runner,
        cache,
        keyer,
        scope_digest,
        config.kv_fetch_policy,
        config.kv_tier_deadline,
        shared_writes_wait=config.role == "prefill",
    )


def tier_sealer(config) -> Optional[Sealer]:
    """The sealer the configuration's secret file makes (None without one); ValueError names a bad file."""
    if config.kv_tier_secret_file is None:
        return None
    return Sealer(Keyring.from_file(config.kv_tier_secret_file), encrypt=config.kv_tier_encrypt)


def build_tiers(config, scope_digest: bytes) -> list[KVTier]:
    """The tiers the configuration asks for, nearest first: host, disk, remote; each seals its records
    with the fleet's secret when there is one."""
    sealer = tier_sealer(config)
    tiers: list[KVTier] = []
    if config.kv_host_cache_bytes:
        tiers.append(HostTier(config.kv_host_cache_bytes, sealer=sealer, shares=config.shares()))
    if config.kv_disk_cache_dir:
        capacity = config.kv_disk_cache_bytes or DEFAULT_DISK_CACHE_BYTES
        tiers.append(
            DiskTier(
                config.kv_disk_cache_dir, capacity, expect_scope=scope_digest, sealer=sealer, shares=config.shares()
            )
        )
    if config.kv_remote_url:
        from ..tiers.redis import RedisTier  # imports redis only when a remote tier is configured

        if sealer is None:
            logger.warning(
                "remote tier: no --kv-tier-secret-file (--kv-remote-insecure): records are not sealed, "
                "so anyone who can write %s can change this replica's answers",
                config.kv_remote_url.rsplit("@", 1)[-1],
            )
        tiers.append(
            RedisTier(
                config.kv_remote_url,
                scope_digest=scope_digest,
                ttl_seconds=config.kv_remote_ttl,
                max_write_bytes_per_second=config.kv_remote_write_bytes_per_second,
                read_timeout=config.kv_remote_timeout,
                sealer=sealer,
            )
        )
    return tiers

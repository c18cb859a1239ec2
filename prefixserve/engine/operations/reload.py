"""Hot reload: swap a new model version into a running engine, between requests, never mixing versions.

    load the new version (a worker thread; the engine keeps serving the old one)
       -> the engine drains: requests already queued finish on the old version
       -> swap, on the engine thread with no request in flight:
            the engine's one version reference (weights, tokenizer, eos ids, scope, scoper,
            max_model_len: model_version.py) -> the new version, in one assignment
            every pooled block is the old scope's and unreachable now: freed at once
            host and disk tiers: the old scope's records deleted (they could never load again)
            remote tier: this replica reads and writes the new scope's keys; the old scope's
                         records stay for replicas still serving it (a rolling deploy) and age
                         out with Redis's TTL or eviction, or go at once when the operator says
                         no replica serves the old version any more (purge_previous_remote)
       -> requests made before the swap (tokenized by the old tokenizer) are refused, not run

The KV pool is kept, so the new version must have the old one's KV layout (layers, KV heads,
head size); anything else (weights, vocabulary, tokenizer, chat template) may change.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..model_version import ModelVersion

logger = logging.getLogger("prefixserve")


class IncompatibleModelError(ValueError):
    """The new version's KV layout differs from the pool's: a restart is needed, not a reload."""


@dataclass(frozen=True)
class ReloadReport:
    model: str
    previous_fingerprint: str
    model_fingerprint: str
    num_reclaimed_blocks: int  # pooled blocks of the old scope, freed
    num_reclaimed_records: dict  # tier name -> records of the old scope deleted
    num_restored_pins: int  # operator pins warmed and pinned again on the new version
    swap_seconds: float
    previous_scope_digest: bytes = b""

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "previous_fingerprint": self.previous_fingerprint,
            "model_fingerprint": self.model_fingerprint,
            "reclaimed_blocks": self.num_reclaimed_blocks,
            "reclaimed_records": dict(self.num_reclaimed_records),
            "restored_pins": self.num_restored_pins,
            "swap_seconds": self.swap_seconds,
        }


def kv_layout(config) -> tuple[int, int, int]:
    return config.num_hidden_layers, config.num_key_value_heads, config.head_dim


def _windows(config) -> tuple:
    return tuple(config.window_of(i) for i in range(config.num_hidden_layers))


def check_swappable(engine, version: ModelVersion) -> None:
    """Raise IncompatibleModelError naming the difference when the pool cannot hold the new version's KV."""
    old, new = kv_layout(engine.version.config), kv_layout(version.loaded.config)
    if engine.window_slots is not None:  # the window layers' pool is theirs: the same layers, the same window
        old, new = (*old, _windows(engine.version.config)), (*new, _windows(version.loaded.config))
    if old != new:
        raise IncompatibleModelError(
            f"{version.name} has a different KV layout (layers, KV heads, head size, sliding windows) "
            f"{new} from the served "
            f"model's {old}; a hot reload keeps the KV pool, so restart the server with the new model instead"
        )


def purge_previous_remote(engine, report: ReloadReport) -> int:
    """Delete the previous version's records from the fleet's remote tier: for the operator to ask once
    no replica serves that version any more (the last step of a rolling deploy). Returns how many."""
    remote = engine.tiers.shared
    if remote is None:
        raise ValueError("this server has no remote tier (--kv-remote-url): there is nothing to purge")
    return remote.purge_scope(report.previous_scope_digest)


def swap_model(engine, version: ModelVersion) -> ReloadReport:
    """Make `version` the engine's model. Call on the engine's thread with no unfinished request."""
    if engine.has_unfinished_requests():
        raise RuntimeError("swap_model needs an idle engine: drain it first (AsyncLLMEngine.reload does)")
    check_swappable(engine, version)
    began = time.perf_counter()
    successor = version.succeeding(engine.version)
    engine.runner.prepare(successor.model)  # may raise: before the swap, so a failure changes nothing
    previous = engine.current.swap(successor).scope  # the one swap: every reader sees the new version now
    engine.scheduler.long_rope_after = successor.config.long_rope_after
    num_blocks = engine.cache.clear()  # every pooled block is the old scope's: none can match again
    records = engine.tiers.rescope(engine.scope.digest)
    engine.num_reloads += 1
    if engine.hot_prefixes is not None:
        engine.hot_prefixes.reset()  # the clear dropped its pins with the blocks
    engine.pins.on_cleared(version.tokenizer.fingerprint)
    num_pins = engine.restore_pins()  # operator pins are warmed again on the new version
    report = ReloadReport(
        model=version.name,
        previous_fingerprint=previous.model_fingerprint,
        model_fingerprint=engine.scope.model_fingerprint,
        num_reclaimed_blocks=num_blocks,
        num_reclaimed_records=records,
        num_restored_pins=num_pins,
        swap_seconds=time.perf_counter() - began,
        previous_scope_digest=previous.digest,
    )
    logger.info(
        "reloaded %s (model %s, was %s): %d pooled blocks and %s tier records of the old scope reclaimed",
        version.name,
        report.model_fingerprint[:12],
        report.previous_fingerprint[:12],
        num_blocks,
        records or "no",
    )
    return report

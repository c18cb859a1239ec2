"""The router's configuration, built and validated once (`prefixserve route` flags map onto it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from ..http_body import DEFAULT_MAX_REQUEST_BYTES
from ..http_keys import is_valid_tenant_id
from .costs import CostModel
from .replicas import parse_replica


@dataclass(frozen=True)
class RouterSettings:
    replicas: tuple[str, ...]  # each `URL` or `NAME=URL`; unnamed ones are replica-0, replica-1, ...
    # Prefill/decode disaggregation (forward.py): replicas started with --role prefill and --role decode
    prefill_replicas: tuple[str, ...] = ()
    decode_replicas: tuple[str, ...] = ()
    # A prompt of which the chosen decode replica lacks at most this many tokens is prefilled there, not handed
    # over (conditional disaggregation, as Dynamo's max local prefill length); 0: every prompt is handed over
    local_prefill_tokens: int = 0
    # ... and so is every prompt while each prefill replica has more than this many seconds of work outstanding
    max_prefill_queue_seconds: Optional[float] = None
    policy: str = "kv_aware"
    model: Optional[str] = None  # checkpoint directory whose tokenizer the replicas use; None: built-in
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant, as the replicas have it
    admin_api_key: Optional[str] = None  # sent on the router's own calls (KV events, cache keys and info)
    metrics_api_key: Optional[str] = None  # a scraper's key for the router's /metrics (needed with api_keys)
    cost: CostModel = field(default_factory=CostModel)
    health_interval: float = 1.0
    sync_interval: float = 0.2
    request_timeout: float = 600.0
    control_timeout: float = 2.0
    progress_timeout: Optional[float] = None  # seconds a started stream may send nothing; None: learned (progress.py)
    health_failure_threshold: int = 3  # /health timeouts in a row that mark a replica down (refused: at once)
    kv_remote_url: Optional[str] = None  # the replicas' --kv-remote-url: requests are priced with what it holds
    kv_remote_timeout: float = 0.2  # a slower lookup routes as if the remote tier held nothing
    max_attempts: int = 3  # distinct replicas one request (or one stream, continuations included) may try
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # Seconds of outstanding work by which a prompt_cache_key's replica may exceed the least loaded one
    # before the key's requests overflow to the policy (cache_key.py).
    cache_key_slack: float = 5.0

    def __post_init__(self) -> None:
        if not self.replicas and not self.decode_replicas:
            raise ValueError("the router needs at least one --replica URL (or --decode-replica URL)")
        if self.prefill_replicas and self.kv_remote_url is None:
            raise ValueError(
                "--prefill-replica hands KV to the decode replicas over the remote tier: give the "
                "replicas' --kv-remote-url to the router too"
            )
        named = self.named_replicas()
        for kind, values in (("name", [n for n, _ in named]), ("URL", [u for _, u in named])):
            duplicates = sorted({v for v in values if values.count(v) > 1})
            if duplicates:
                raise ValueError(f"replica {kind}s must differ; {', '.join(duplicates)} appears twice")
        bad = [tenant for tenant in self.api_keys.values() if not is_valid_tenant_id(tenant)]
        if bad:
            raise ValueError(f"tenant ids must be 1 to 256 printable characters; {bad[0]!r} is not")
        if self.metrics_api_key is not None and self.metrics_api_key in self.api_keys:
            raise ValueError("the --metrics-api-key is also a tenant key; give the scraper a key of its own")
        if self.progress_timeout is not None and not self.progress_timeout > 0:
            raise ValueError("--progress-timeout must be positive seconds")
        if self.health_failure_threshold < 1:
            raise ValueError("--health-failure-threshold must be at least 1")
        if self.max_attempts < 1:
            raise ValueError("--max-attempts must be at least 1")
        if self.max_request_bytes < 1:
            raise ValueError("--max-request-bytes must be positive")
        if self.max_prefill_queue_seconds is not None and not self.max_prefill_queue_seconds >= 0:
            raise ValueError("--max-prefill-queue-seconds must be 0 or more seconds")
        if self.local_prefill_tokens < 0:
            raise ValueError("--local-prefill-tokens must be 0 (hand every prompt over) or more")
        if not self.cache_key_slack >= 0:
            raise ValueError("--cache-key-slack must be 0 or more seconds")

    def named_replicas(self) -> list[tuple[str, str]]:
        return [(name, url) for name, url, _ in self.replica_roles()]

    def replica_roles(self) -> list[tuple[str, str, str]]:
        """(name, url, role) of every replica: "both", "prefill" or "decode"."""
        specs = (
            [(spec, "both") for spec in self.replicas]
            + [(spec, "prefill") for spec in self.prefill_replicas]
            + [(spec, "decode") for spec in self.decode_replicas]
        )
        return [(*parse_replica(spec, i), role) for i, (spec, role) in enumerate(specs)]

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_replicas)

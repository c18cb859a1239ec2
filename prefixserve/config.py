"""Engine configuration: one dataclass, validated once, never mutated afterwards.

Option names follow vLLM's where one exists, so a vLLM user's flags carry over.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from .cache.keys import HASH_FUNCTIONS

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "lpm")
CACHE_RETENTIONS = ("device", "none")  # a request's or tenant's cache_retention; absent: cached as usual
FETCH_POLICIES = ("cost", "always")  # how lower-tier hits are fetched: see kv_fetch_policy
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
DEFAULT_MAX_CACHE_TTL = 3600.0  # seconds: the server's cap on a requested cache_ttl (Anthropic's longest, 1 hour)
DEFAULT_DISK_CACHE_BYTES = 16 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: Optional[str] = None  # a Hugging Face checkpoint directory; None = built-in prefixserve-tiny
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with bf16 instructions, else float32 (engine/device.py)
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_hash: str = "sha256"  # or "xxh3_128" (faster, not collision resistant)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    kv_cache_memory_bytes: Optional[int] = None  # None: 2 GiB on CPU, a fraction of free memory on CUDA
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"  # or "lpm": longest cached prefix first, within a window
    max_pinned_blocks: Optional[int] = None  # None: half the pool
    prefix_ttl: Optional[float] = None  # seconds an unused cached prefix lives; None: until evicted
    # The background policy pinning hot shared prefixes (cache/hot_prefixes.py): a prefix reused by at
    # least this many requests within the window stays pinned (within half of max_pinned_blocks)
    # until it cools; 0 turns it off.
    hot_prefix_min_requests: int = 4
    hot_prefix_window: float = 60.0  # seconds
    enable_kv_events: bool = False
    # Compute every token the same way whatever else is in the batch, so a cache hit never changes an
    # output: linear layers are called only with row counts measured to round each row alike
    # (model/row_calls.py). False makes every matmul one call of its own rows (a lone decode up to 10%
    # faster in bf16; on AMX CPUs a prefill's bf16 matmuls up to 2x faster) and, on the pure-PyTorch
    # path (no compiled kernel), drops the invariant attention (model/invariant_attention.py); greedy
    # outputs may then depend on batching and cache hits.
    batch_invariant: bool = True
    # The KV hierarchy under the pool (engine/kv_tiers.py); all off by default.
    kv_host_cache_bytes: Optional[int] = None  # host RAM for blocks evicted from the pool
    kv_disk_cache_dir: Optional[str] = None  # every computed block is also written here; survives restarts
    kv_disk_cache_bytes: Optional[int] = None  # None: DEFAULT_DISK_CACHE_BYTES when a directory is given
    kv_remote_url: Optional[str] = None  # redis://host:port/db shared by the fleet (rediss:// and passwords work)
    kv_remote_ttl: Optional[float] = None  # seconds a remote record lives; None: until Redis evicts it
    kv_remote_write_bytes_per_second: Optional[int] = None  # cap on what one replica writes; None: no cap
    kv_remote_timeout: float = 1.0  # seconds a remote read may take before it counts as a miss
    # The tiers are a trust boundary (tiers/seal.py). With a secret file every record is sealed (AES-256-GMAC)
    # and only records sealed under one of its secrets are read back; the remote tier needs one, or
    # kv_remote_insecure=True (then anyone who can write Redis can change this replica's answers).
    kv_tier_secret_file: Optional[str] = None
    kv_tier_encrypt: bool = False  # AES-256-GCM: token ids and KV encrypted at rest, a key per tenant scope
    kv_remote_insecure: bool = False
    # Seconds a request waits for a disk or remote read before it recomputes (the tier counted slow).
    kv_tier_deadline: float = 0.5
    # "cost": fetch a lower-tier run only where reading it is measured to beat recomputing it (tiers/policy.py);
    # "always": fetch every block a tier holds, as LMCache does (predictable hits, whatever the timings).
    kv_fetch_policy: str = "cost"
    seed: int = 0
    log_stats: bool = True

    def __post_init__(self) -> None:
        def require(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), f"block_size must be a power of two up to 128, got {self.block_size}")
        require(self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        require(
            self.max_num_batched_tokens >= self.block_size,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least block_size ({self.block_size})",
        )
        require(self.max_model_len is None or self.max_model_len >= 2, f"max_model_len must be at least 2, got {self.max_model_len}")
        require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}",
        )
        require(0.0 < self.gpu_memory_utilization <= 1.0, f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        require(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}",
        )
        require(self.prefix_hash in HASH_FUNCTIONS,
                f"prefix_hash must be one of {sorted(HASH_FUNCTIONS)}, got {self.prefix_hash!r}")
        require(self.prefix_ttl is None or self.prefix_ttl > 0, f"prefix_ttl must be positive seconds, got {self.prefix_ttl}")
        require(self.hot_prefix_min_requests == 0 or self.hot_prefix_min_requests >= 2,
                f"hot_prefix_min_requests must be 0 (off) or at least 2, got {self.hot_prefix_min_requests}")
        require(self.hot_prefix_window > 0, f"hot_prefix_window must be positive seconds, got {self.hot_prefix_window}")
        require(self.kv_host_cache_bytes is None or self.kv_host_cache_bytes > 0,
                f"kv_host_cache_bytes must be positive, got {self.kv_host_cache_bytes}")
        require(self.kv_disk_cache_bytes is None or self.kv_disk_cache_bytes > 0,
                f"kv_disk_cache_bytes must be positive, got {self.kv_disk_cache_bytes}")
        require(self.kv_remote_url is None or self.kv_remote_url.startswith(("redis://", "rediss://", "unix://")),
                f"kv_remote_url must be a redis:// or rediss:// URL, got {self.kv_remote_url!r}")
        require(self.kv_remote_ttl is None or self.kv_remote_ttl > 0, f"kv_remote_ttl must be positive, got {self.kv_remote_ttl}")
        require(self.kv_remote_write_bytes_per_second is None or self.kv_remote_write_bytes_per_second > 0,
                f"kv_remote_write_bytes_per_second must be positive, got {self.kv_remote_write_bytes_per_second}")
        require(self.kv_remote_timeout > 0, f"kv_remote_timeout must be positive, got {self.kv_remote_timeout}")
        require(not self.kv_tier_encrypt or self.kv_tier_secret_file is not None,
                "kv_tier_encrypt needs kv_tier_secret_file: the keys are derived from the fleet's secret")
        require(self.kv_remote_url is None or self.kv_tier_secret_file is not None or self.kv_remote_insecure,
                "kv_remote_url needs kv_tier_secret_file (--kv-tier-secret-file), the fleet's secret that seals "
                "every record, or else anyone who can write that Redis can change this replica's answers; "
                "kv_remote_insecure=True (--kv-remote-insecure) runs without one")
        require(self.kv_tier_deadline > 0, f"kv_tier_deadline must be positive, got {self.kv_tier_deadline}")
        require(self.kv_fetch_policy in FETCH_POLICIES,
                f"kv_fetch_policy must be one of {FETCH_POLICIES}, got {self.kv_fetch_policy!r}")
        require(self.kv_disk_cache_bytes is None or self.kv_disk_cache_dir is not None,
                "kv_disk_cache_bytes needs kv_disk_cache_dir (the directory the disk tier writes to)")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword options, naming any unknown one and the valid names."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options are {sorted(known)}")
        return cls(**kwargs)

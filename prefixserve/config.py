"""Engine configuration: one dataclass, validated once, never mutated (one concept over 400 lines: every flag).

Option names follow vLLM's where one exists, so a vLLM user's flags carry over.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Union

from .cache.keys import HASH_FUNCTIONS
from .cache.tenant_shares import (
    DEFAULT_PIN_SHARE,
    Share,
    TenantShares,
    parse_tenant_shares,
    share_from,
    tenant_shares_of,
)
from .json_options import parse_option
from .speculative_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "lpm")
CACHE_RETENTIONS = ("device", "none")  # a request's or tenant's cache_retention; absent: cached as usual
FETCH_POLICIES = ("cost", "always")  # how lower-tier hits are fetched: see kv_fetch_policy
ROLES = ("both", "prefill", "decode")  # a replica's part in prefill/decode disaggregation: see role
QUANTIZE = ("int8", "int4")  # --quantize: model/weights/quantized.py
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
DEFAULT_MAX_CACHE_TTL = 3600.0  # seconds: the server's cap on a requested cache_ttl (Anthropic's longest, 1 hour)
DEFAULT_DISK_CACHE_BYTES = 16 << 30


CHECKPOINT_LAYOUT = (
    "a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), a .gguf file "
    "or a directory holding one, or a model name (smollm2-135m-instruct)"
)


KV_EVENT_PUBLISHERS = ("null", "zmq")
KV_EVENT_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: the same fields, meanings and defaults, but one. The endpoint defaults to
    loopback (vLLM's tcp://*:5557 puts every prompt's token ids on every interface; that is the operator's
    explicit choice here). A loopback, wildcard, ipc:// or inproc:// endpoint is bound (subscribers such as
    vllm-router and llm-d's indexer connect to it); any other host is connected to, as vLLM does. Port 0
    binds a free port (the publisher reports which)."""

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # None: "zmq" when events are enabled, else "null" (vLLM's rule)
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: Optional[str] = None  # a ROUTER socket answering "every batch from sequence number N on"
    buffer_steps: int = 10_000  # batches (one per engine step) kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: messages queued per slow subscriber before dropping
    max_queue_size: int = 100_000  # events held for the publisher before the oldest are dropped
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        where = "kv_events_config"
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"{where}.enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"{where}.publisher must be one of {KV_EVENT_PUBLISHERS}, got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(KV_EVENT_ENDPOINT_SCHEMES):
                raise ValueError(
                    f"{where}.{name} must be a ZMQ endpoint starting with one of "
                    f"{KV_EVENT_ENDPOINT_SCHEMES} (e.g. tcp://127.0.0.1:5557), got {value!r}"
                )
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{where}.{name} must be an integer of at least {least}, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"{where}.topic must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        """Events are kept and sent over ZMQ (enabled, publisher "zmq")."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: Union[None, str, dict, "KVEventsConfig"]) -> Optional["KVEventsConfig"]:
        """From what a user gives: JSON text (the --kv-events-config flag), a dict, or the config itself."""
        return parse_option(cls, value, "kv_events_config", '{"enable_kv_cache_events": true}')


def option(default, help: str, **flag):
    """A config field with its command-line flag: `help`, and argparse's metavar or choices, or
    flag="--name" where the flag is not the field's name with dashes (a True default reads inverted:
    the flag turns it off). `prefixserve serve` builds every flag from these (server/engine_flags.py)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class EngineConfig:
    model: Optional[str] = option(
        None,
        f"{CHECKPOINT_LAYOUT} (default: the built-in prefixserve-tiny, generated on first use)",
        metavar="DIR|FILE|NAME",
    )
    dtype: str = option(
        "auto",
        "weights and KV cache; auto is the fastest exact dtype: bfloat16 on CUDA and on CPUs "
        "with bf16 instructions, else float32 (bfloat16 is served exactly on every CPU; "
        "engine/device.py)",
        choices=DTYPES,
    )
    device: str = option("auto", "auto: cuda when available, else cpu", choices=DEVICES)
    quantize: Optional[str] = option(
        None,
        "keep a float checkpoint's weights quantized in memory (CPU): int8 as "
        "GGUF's Q8_0, int4 as Q4_1 (embedding and lm_head int8); a GGUF is "
        "quantized again from its decoded weights (default: none: a float "
        "checkpoint stays float, a GGUF keeps its own blocks)",
        choices=QUANTIZE,
    )
    dequantize: bool = option(
        False,
        "serve a GGUF's weights decoded to float (exact to transformers on those "
        "weights, 4-8x the bytes per decode step) instead of quantized as the file "
        "holds them",
    )
    block_size: int = option(16, "tokens per KV block, the unit of cache reuse", metavar="N")
    enable_prefix_caching: bool = option(True, "disable prefix caching (a baseline)", flag="--no-prefix-caching")
    prefix_hash: str = option(
        "sha256",
        "the block-key hash: sha256, or xxh3_128 (faster, not collision resistant: only where every prompt is trusted)",
        choices=tuple(sorted(HASH_FUNCTIONS)),
    )
    window_kv_release: bool = option(
        True,
        "keep every layer's K/V for every cached block: the sliding-window "
        "layers then use no smaller pool of their own (a baseline)",
        flag="--no-window-kv-release",
    )
    max_num_seqs: int = option(64, "requests running at once", metavar="N")
    max_num_batched_tokens: int = option(
        2048, "tokens one engine step computes (longer prefills are chunked)", metavar="N"
    )
    max_model_len: Optional[int] = option(
        None,
        "longest prompt + output in tokens (default: the model's limit, capped to what the KV pool holds)",
        metavar="N",
    )
    kv_cache_memory_bytes: Optional[int] = option(
        None,
        "KV pool budget (default: 2 GiB on CPU; on CUDA the free "
        "memory measured after loading the model x "
        "--gpu-memory-utilization)",
        metavar="N",
    )
    gpu_memory_utilization: float = option(
        0.9,
        "on CUDA, the share of free memory the KV pool may take when --kv-cache-memory-bytes is not given",
        metavar="FRACTION",
    )
    scheduling_policy: str = option(
        "fcfs", "fcfs: arrival order; lpm: longest cached prefix first, within a window", choices=SCHEDULING_POLICIES
    )
    max_pinned_blocks: Optional[int] = option(
        None, "blocks operator and hot-prefix pins may hold (default: half the pool)", metavar="N"
    )
    prefix_ttl: Optional[float] = option(
        None, "seconds an unused cached prefix lives (default: until evicted)", metavar="SECONDS"
    )
    # The background policy pinning hot shared prefixes (cache/hot_prefixes.py): a prefix reused by at
    # least this many requests within the window stays pinned (within half of max_pinned_blocks)
    # until it cools; 0 turns it off.
    hot_prefix_min_requests: int = option(
        4,
        "pin a cached prefix reused by at least K requests within "
        "--hot-prefix-window, until it cools (0: off; pins stay within half "
        "of the pin cap)",
        metavar="K",
    )
    hot_prefix_window: float = option(
        60.0, "the window in which --hot-prefix-min-requests reuses make a prefix hot", metavar="SECONDS"
    )
    # Fair shares between tenants (cache/tenant_shares.py): the server-wide default for a tenant that sets none,
    # and per-tenant shares (the server adds its keys file's).
    tenant_pin_share: float = option(
        DEFAULT_PIN_SHARE,
        "the fraction of the pin cap one tenant's pins (cache_control, hot prefixes) may hold, for tenants "
        "whose keys-file entry sets no pin_share",
        metavar="FRACTION",
    )
    tenant_min_kv_share: float = option(
        0.0,
        "the fraction of the KV pool (and of each host/disk tier) a tenant keeps against other tenants' "
        "traffic, for tenants whose keys-file entry sets no min_kv_share",
        metavar="FRACTION",
    )
    tenant_max_kv_share: float = option(
        1.0,
        "the most of the KV pool (and of each host/disk tier) one tenant's cached blocks may hold, for tenants "
        "whose keys-file entry sets no max_kv_share (past it: served, not cached)",
        metavar="FRACTION",
    )
    tenant_shares: Optional[dict] = option(
        None,
        'per-tenant shares as JSON, e.g. {"acme": {"pin_share": 0.5, "min_kv_share": 0.2, "max_kv_share": 0.6}} '
        "(default: none; serve reads them from --api-keys-file entries too, and the --tenant-*-share flags fill "
        "what a tenant leaves out)",
        metavar="JSON",
        parse=parse_tenant_shares,
    )
    # LoRA adapters on the base model (prefixserve/lora/): vLLM's options
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT directories) on the base model")
    max_loras: int = option(4, "the most LoRA adapters one step runs (requests of others wait)", metavar="N")
    max_lora_rank: int = option(
        16, "the highest LoRA rank an adapter may have (a higher one is refused at load)", metavar="R"
    )
    max_cpu_loras: Optional[int] = option(
        None, "LoRA adapters kept loaded, least recently used dropped first (default: --max-loras)", metavar="N"
    )
    # Speculative decoding (engine/speculation.py): vLLM's speculative_config, kept as the SpeculativeConfig
    speculative_config: Optional[SpeculativeConfig] = option(
        None,
        'speculative decoding as JSON with vLLM\'s fields, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 5, "prompt_lookup_min": 2} (prompt lookup; greedy outputs are the same token for '
        "token; default: off)",
        metavar="JSON",
        parse=SpeculativeConfig.parse,
    )
    enable_kv_events: bool = option(False, "keep KV events for GET /v1/kv_events (for a router; needs --admin-api-key)")
    # vLLM's KV events over ZMQ (engine/kv_event_publisher.py), for vllm-router, llm-d, Dynamo: JSON text,
    # a dict or a KVEventsConfig, kept as the KVEventsConfig.
    kv_events_config: Optional[KVEventsConfig] = option(
        None,
        "vLLM's KV events over ZMQ, as JSON with vLLM's fields, e.g. {\"enable_kv_cache_events\": true, "
        '"endpoint": "tcp://127.0.0.1:5557"} (the endpoint defaults to loopback; the messages carry prompts\' '
        "token ids; needs pyzmq and msgspec: pip install 'prefixserve[kv-events]')",
        metavar="JSON",
        parse=KVEventsConfig.parse,
    )
    # Compute every token the same way whatever else is in the batch, so a cache hit never changes an
    # output: linear layers are called only with row counts measured to round each row alike
    # (model/row_calls.py). False makes every matmul one call of its own rows and, on the pure-PyTorch
    # path (no compiled kernel), drops the invariant attention (model/attention/invariant.py); greedy
    # outputs may then depend on batching and cache hits.
    batch_invariant: bool = option(
        True,
        "let outputs depend on batching and cache hits for speed: each matmul one "
        "call of its rows (a lone bf16 decode up to 10%% faster, AMX bf16 prefill "
        "matmuls up to 2x); without the compiled kernel, the faster attention",
        flag="--no-batch-invariant",
    )
    # The KV hierarchy under the pool (engine/kv_tiers.py); all off by default.
    kv_host_cache_bytes: Optional[int] = option(
        None,
        "host RAM for KV blocks evicted from the pool; fetched back instead of recomputed (default: off)",
        metavar="BYTES",
    )
    kv_disk_cache_dir: Optional[str] = option(
        None,
        "write every computed KV block here too; served after eviction and after a restart (default: off)",
        metavar="DIR",
    )
    kv_disk_cache_bytes: Optional[int] = option(
        None, "size of the disk tier (default: 16 GiB when --kv-disk-cache-dir is given)", metavar="BYTES"
    )
    kv_remote_url: Optional[str] = option(
        None,
        "redis://host:port/db shared by the fleet: every replica writes the "
        "blocks it computes and reads what others computed (rediss:// and a "
        "password in the URL work; default: off)",
        metavar="URL",
    )
    kv_remote_ttl: Optional[float] = option(
        None, "seconds a remote record lives (default: until Redis evicts it)", metavar="SECONDS"
    )
    kv_remote_write_bytes_per_second: Optional[int] = option(
        None, "cap on the bytes this replica writes to the remote tier per second (default: no cap)", metavar="BYTES"
    )
    kv_remote_timeout: float = option(
        1.0, "a remote read slower than this counts as a miss (the request recomputes)", metavar="SECONDS"
    )
    # The tiers are a trust boundary (tiers/seal.py): with a secret file every record is sealed (AES-256-GMAC)
    # and only records sealed under one of its secrets are read back.
    kv_tier_secret_file: Optional[str] = option(
        None,
        "the fleet's secret(s), one per line (the first seals; later "
        "ones are accepted until the until= each states): every tier "
        "record is sealed and only records sealed under one of them "
        "are read back (needed with --kv-remote-url; default: "
        "unsealed)",
        metavar="FILE",
    )
    kv_tier_encrypt: bool = option(
        False,
        "encrypt token ids and KV in every tier (AES-256-GCM, a key per tenant "
        "scope derived from the secret), so a Redis dump or a copied disk reveals "
        "no prompt",
    )
    kv_remote_insecure: bool = option(
        False,
        "run --kv-remote-url without --kv-tier-secret-file: anyone who can "
        "write that Redis can change this replica's answers (a warning at "
        "every start)",
    )
    kv_tier_deadline: float = option(
        0.5, "a request waits at most this long for a disk or remote read, then recomputes", metavar="SECONDS"
    )
    # "cost": tiers/policy.py's planner; "always": every block a tier holds, as LMCache does (predictable
    # hits, whatever the timings).
    kv_fetch_policy: str = option(
        "cost",
        "cost: fetch a run from host, disk or remote only where reading it is "
        "measured to be faster than recomputing it; always: fetch every block a "
        "tier holds",
        choices=FETCH_POLICIES,
    )
    role: str = option(
        "both",
        "prefill: a router's prefill replica, its prompts' KV written to the remote tier before "
        "it answers; decode: a router's decode replica, which fetches what the remote tier "
        "holds (pair with --kv-fetch-policy always); both: a whole replica. prefill and "
        "decode need --kv-remote-url",
        choices=ROLES,
    )
    seed: int = option(0, "the seed of unseeded sampling (seeded requests draw from their own seed)", metavar="N")
    log_stats: bool = option(True, "no start-up summary or progress lines from the engine", flag="--disable-log-stats")

    def __post_init__(self) -> None:
        def require(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "tenant_shares", parse_tenant_shares(self.tenant_shares))
        self.shares()  # raises ValueError naming a share that cannot hold
        require(self.max_loras >= 1, f"max_loras must be at least 1, got {self.max_loras}")
        require(self.max_lora_rank >= 1, f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})",
        )
        require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        require(
            self.quantize is None or self.quantize in QUANTIZE,
            f"quantize must be one of {QUANTIZE}, got {self.quantize!r}",
        )
        require(
            self.quantize is None or not self.dequantize,
            "quantize and dequantize contradict each other: give one (--quantize int8|int4 or --dequantize)",
        )
        require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of two up to 128, got {self.block_size}",
        )
        require(self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        require(
            self.max_num_batched_tokens >= self.block_size,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least block_size ({self.block_size})",
        )
        require(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be at least 2, got {self.max_model_len}",
        )
        require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}",
        )
        require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        require(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}",
        )
        require(
            self.prefix_hash in HASH_FUNCTIONS,
            f"prefix_hash must be one of {sorted(HASH_FUNCTIONS)}, got {self.prefix_hash!r}",
        )
        require(
            self.prefix_ttl is None or self.prefix_ttl > 0,
            f"prefix_ttl must be positive seconds, got {self.prefix_ttl}",
        )
        require(
            self.hot_prefix_min_requests == 0 or self.hot_prefix_min_requests >= 2,
            f"hot_prefix_min_requests must be 0 (off) or at least 2, got {self.hot_prefix_min_requests}",
        )
        require(self.hot_prefix_window > 0, f"hot_prefix_window must be positive seconds, got {self.hot_prefix_window}")
        require(
            self.kv_host_cache_bytes is None or self.kv_host_cache_bytes > 0,
            f"kv_host_cache_bytes must be positive, got {self.kv_host_cache_bytes}",
        )
        require(
            self.kv_disk_cache_bytes is None or self.kv_disk_cache_bytes > 0,
            f"kv_disk_cache_bytes must be positive, got {self.kv_disk_cache_bytes}",
        )
        require(
            self.kv_remote_url is None or self.kv_remote_url.startswith(("redis://", "rediss://", "unix://")),
            f"kv_remote_url must be a redis:// or rediss:// URL, got {self.kv_remote_url!r}",
        )
        require(
            self.kv_remote_ttl is None or self.kv_remote_ttl > 0,
            f"kv_remote_ttl must be positive, got {self.kv_remote_ttl}",
        )
        require(
            self.kv_remote_write_bytes_per_second is None or self.kv_remote_write_bytes_per_second > 0,
            f"kv_remote_write_bytes_per_second must be positive, got {self.kv_remote_write_bytes_per_second}",
        )
        require(self.kv_remote_timeout > 0, f"kv_remote_timeout must be positive, got {self.kv_remote_timeout}")
        require(
            not self.kv_tier_encrypt or self.kv_tier_secret_file is not None,
            "kv_tier_encrypt needs kv_tier_secret_file: the keys are derived from the fleet's secret",
        )
        require(
            self.kv_remote_url is None or self.kv_tier_secret_file is not None or self.kv_remote_insecure,
            "kv_remote_url needs kv_tier_secret_file (--kv-tier-secret-file), the fleet's secret that seals "
            "every record, or else anyone who can write that Redis can change this replica's answers; "
            "kv_remote_insecure=True (--kv-remote-insecure) runs without one",
        )
        require(self.kv_tier_deadline > 0, f"kv_tier_deadline must be positive, got {self.kv_tier_deadline}")
        require(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r}")
        require(
            self.role == "both" or self.kv_remote_url is not None,
            f"role {self.role!r} hands KV over the fleet's remote tier: give kv_remote_url (--kv-remote-url)",
        )
        require(
            self.kv_fetch_policy in FETCH_POLICIES,
            f"kv_fetch_policy must be one of {FETCH_POLICIES}, got {self.kv_fetch_policy!r}",
        )
        require(
            self.kv_disk_cache_bytes is None or self.kv_disk_cache_dir is not None,
            "kv_disk_cache_bytes needs kv_disk_cache_dir (the directory the disk tier writes to)",
        )

    def shares(self) -> TenantShares:
        """The tenants' shares: tenant_shares over the tenant_*_share defaults."""
        default = share_from(
            {
                "pin_share": self.tenant_pin_share,
                "min_kv_share": self.tenant_min_kv_share,
                "max_kv_share": self.tenant_max_kv_share,
            },
            Share(),
            "tenant_pin_share / tenant_min_kv_share / tenant_max_kv_share",
        )
        return tenant_shares_of(self.tenant_shares, default)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword options, naming any unknown one and the valid names."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options are {sorted(known)}")
        return cls(**kwargs)

"""What a prefix hit is worth in money and in time to first token, at a hit rate and prompt length.

    price per request = (cached tokens x cached read price + fresh tokens x fresh price) / 1e6
        cached tokens = hit rate x prompt tokens
        fresh tokens  = the rest; a vendor that charges for writing the cache charges its write
                        price on the share of fresh tokens written (`write_fraction`: 1 here, since
                        this server caches every full block; a client choosing breakpoints writes less)
    TTFT              = fixed seconds + fresh tokens x prefill seconds per token

The vendors' list prices sit in one table, VENDOR_PRICES, each with its source and the date
the figures are as published on: update an entry there, nothing else reads a price.
Pure computation (no torch, no network): the command line and the dashboard pass numbers in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional


@dataclass(frozen=True)
class VendorPrice:
    """List prices in USD per million input tokens."""

    name: str  # short id: `--vendor`, `?vendor=`
    model: str
    fresh: float  # an input token not served from the vendor's cache
    cached_read: float  # an input token served from it
    cache_write: Optional[float]  # an input token written to it; None: no surcharge (the fresh price)
    source: str  # the page the figures come from
    as_of: str  # "as published on" this date (ISO); check the source before relying on it
    notes: str = ""

    def __post_init__(self) -> None:
        prices = [self.fresh, self.cached_read] + ([] if self.cache_write is None else [self.cache_write])
        if any(price < 0 for price in prices):
            raise ValueError(f"{self.name}: prices must be non-negative USD per million tokens, got {prices}")

    @property
    def cached_ratio(self) -> float:
        """Cached read price / fresh price (0.1 = cache reads at a tenth)."""
        return self.cached_read / self.fresh if self.fresh else 0.0


# ------------------------------------------------------------------------------------------------
# THE PRICE TABLE. List prices change: each row says where it was read and as published on which date.
# Figures are the vendors' standard (non-batch, short-context) input prices, USD per million tokens.
# ------------------------------------------------------------------------------------------------
VENDOR_PRICES: tuple[VendorPrice, ...] = (
    VendorPrice(
        "deepseek-v3",
        "DeepSeek-V3 (deepseek-chat, standard hours)",
        fresh=0.27,
        cached_read=0.07,
        cache_write=None,
        source="https://api-docs.deepseek.com/quick_start/pricing",
        as_of="2025-09-05",
        notes="cache miss 0.27, cache hit 0.07; the list in effect until 2025-09-05 16:00 UTC; the cache "
        "is automatic and writes cost the miss price",
    ),
    VendorPrice(
        "deepseek-v3.1",
        "DeepSeek-V3.1 (deepseek-chat)",
        fresh=0.56,
        cached_read=0.07,
        cache_write=None,
        source="https://api-docs.deepseek.com/quick_start/pricing",
        as_of="2025-09-05",
        notes="the list from 2025-09-05 16:00 UTC: cache miss 0.56, cache hit 0.07, no night discount",
    ),
    VendorPrice(
        "anthropic-sonnet",
        "Claude Sonnet 4",
        fresh=3.00,
        cached_read=0.30,
        cache_write=3.75,
        source="https://docs.anthropic.com/en/docs/build-with-claude/prompt-caching",
        as_of="2025-05-22",
        notes="cache reads 0.1x base input, 5-minute cache writes 1.25x (1-hour writes 2x)",
    ),
    VendorPrice(
        "openai-gpt-4o",
        "GPT-4o",
        fresh=2.50,
        cached_read=1.25,
        cache_write=None,
        source="https://openai.com/api/pricing/",
        as_of="2024-10-01",
        notes="cached input 0.5x, automatic for prompts of 1,024 tokens or more, no write charge",
    ),
    VendorPrice(
        "openai-gpt-4.1",
        "GPT-4.1",
        fresh=2.00,
        cached_read=0.50,
        cache_write=None,
        source="https://openai.com/api/pricing/",
        as_of="2025-04-14",
        notes="cached input 0.25x, automatic, no write charge",
    ),
    VendorPrice(
        "gemini-2.5-pro",
        "Gemini 2.5 Pro (prompts up to 200k tokens)",
        fresh=1.25,
        cached_read=0.31,
        cache_write=None,
        source="https://ai.google.dev/gemini-api/docs/pricing",
        as_of="2025-06-17",
        notes="cached input 0.25x (0.3125, listed rounded to 0.31); explicit caches also pay storage, 4.50 "
        "per million tokens per hour, not modelled here",
    ),
)
PRICE_TABLE_NOTE = (
    "vendors' list prices as published on the date beside each; check the source before relying "
    "on them (prefixserve/plan/price.py, VENDOR_PRICES)"
)


def vendor(name: str) -> VendorPrice:
    for entry in VENDOR_PRICES:
        if entry.name == name:
            return entry
    raise ValueError(f"unknown vendor {name!r}; one of {', '.join(entry.name for entry in VENDOR_PRICES)}")


class BlendedPrice(NamedTuple):
    vendor: str
    hit_rate: float
    prompt_tokens: float
    cached_tokens: float  # per request
    fresh_tokens: float
    usd_per_request: float
    usd_per_million_input_tokens: float  # the blended rate
    usd_per_request_uncached: float  # every token at the fresh price
    saving_fraction: float  # 1 - blended / uncached; negative when writes cost more than the hits save


def check_inputs(hit_rate: float, prompt_tokens: float) -> None:
    """Raise ValueError naming the bad input and the range it must lie in."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be a fraction in [0, 1], got {hit_rate}")
    if not prompt_tokens > 0:
        raise ValueError(f"prompt_tokens must be positive, got {prompt_tokens}")


def blended_price(
    hit_rate: float, prompt_tokens: float, price: VendorPrice | str, write_fraction: float = 1.0
) -> BlendedPrice:
    """Input price of one request of `prompt_tokens` tokens, `hit_rate` of them (token-weighted) cached."""
    check_inputs(hit_rate, prompt_tokens)
    if not 0.0 <= write_fraction <= 1.0:
        raise ValueError(f"write_fraction must be a fraction in [0, 1], got {write_fraction}")
    price = vendor(price) if isinstance(price, str) else price
    cached = hit_rate * prompt_tokens
    fresh = prompt_tokens - cached
    write = price.fresh if price.cache_write is None else price.cache_write
    fresh_rate = write_fraction * write + (1.0 - write_fraction) * price.fresh
    per_request = (cached * price.cached_read + fresh * fresh_rate) / 1e6
    uncached = prompt_tokens * price.fresh / 1e6
    return BlendedPrice(
        price.name,
        hit_rate,
        prompt_tokens,
        cached,
        fresh,
        per_request,
        per_request / prompt_tokens * 1e6,
        uncached,
        1.0 - per_request / uncached if uncached else 0.0,
    )


def price_table(hit_rate: float, prompt_tokens: float, write_fraction: float = 1.0) -> list[BlendedPrice]:
    """One row per vendor of VENDOR_PRICES, in its order."""
    return [blended_price(hit_rate, prompt_tokens, entry, write_fraction) for entry in VENDOR_PRICES]


# --------------------------------------------------------------------------------------- TTFT
class TtftEstimate(NamedTuple):
    hit_rate: float
    prompt_tokens: float
    seconds: float  # estimated time to first token
    miss_seconds: float  # the same prompt with nothing cached
    fixed_seconds: float  # per request: queueing, scheduling, the first sampling step
    prefill_seconds_per_token: float


def estimated_ttft(
    hit_rate: float, prompt_tokens: float, prefill_seconds_per_token: float, fixed_seconds: float = 0.0
) -> TtftEstimate:
    """TTFT = fixed + uncached tokens x prefill per token (a hit costs nothing to prefill; the engine
    recomputes the last token, which the fixed part covers)."""
    check_inputs(hit_rate, prompt_tokens)
    if not prefill_seconds_per_token > 0:
        raise ValueError(f"prefill_seconds_per_token must be positive, got {prefill_seconds_per_token}")
    if fixed_seconds < 0:
        raise ValueError(f"fixed_seconds must be non-negative, got {fixed_seconds}")
    fresh = (1.0 - hit_rate) * prompt_tokens
    return TtftEstimate(
        hit_rate,
        prompt_tokens,
        fixed_seconds + fresh * prefill_seconds_per_token,
        fixed_seconds + prompt_tokens * prefill_seconds_per_token,
        fixed_seconds,
        prefill_seconds_per_token,
    )


def fixed_seconds_from_measured(
    mean_ttft: float, hit_rate: float, mean_prompt_tokens: float, prefill_seconds_per_token: float
) -> float:
    """The fixed part that makes the model reproduce a measured mean TTFT at the measured hit rate and
    prompt length (never negative: a prefill cost that already explains all of it leaves none)."""
    return max(0.0, mean_ttft - (1.0 - hit_rate) * mean_prompt_tokens * prefill_seconds_per_token)


# --------------------------------------------------------------------------------------- output
def price_json(rows: list[BlendedPrice], ttft: Optional[TtftEstimate] = None) -> dict:
    """The rows with each vendor's list prices, source and date, as JSON-safe data."""
    by_name = {entry.name: entry for entry in VENDOR_PRICES}
    vendors = []
    for row in rows:
        entry = by_name[row.vendor]
        vendors.append(
            {
                **row._asdict(),
                "model": entry.model,
                "fresh_usd_per_million": entry.fresh,
                "cached_read_usd_per_million": entry.cached_read,
                "cache_write_usd_per_million": entry.cache_write,
                "cached_ratio": entry.cached_ratio,
                "source": entry.source,
                "as_of": entry.as_of,
                "notes": entry.notes,
            }
        )
    return {"vendors": vendors, "note": PRICE_TABLE_NOTE, "ttft": None if ttft is None else ttft._asdict()}


def format_price_table(rows: list[BlendedPrice], ttft: Optional[TtftEstimate] = None) -> list[str]:
    first = rows[0]
    lines = [
        f"Input price at a {first.hit_rate:.1%} token hit rate, {first.prompt_tokens:,.0f}-token prompts "
        f"(USD; list prices per million tokens)",
        "",
        f"{'vendor':<18}{'fresh':>7}{'cached':>8}{'write':>7}  {'per request':>12}{'per M input':>13}"
        f"{'uncached':>12}{'saving':>8}",
    ]
    by_name = {entry.name: entry for entry in VENDOR_PRICES}
    for row in rows:
        entry = by_name[row.vendor]
        write = "-" if entry.cache_write is None else f"{entry.cache_write:g}"
        lines.append(
            f"{row.vendor:<18}{entry.fresh:>7g}{entry.cached_read:>8g}{write:>7}  "
            f"{row.usd_per_request:>12.6f}{row.usd_per_million_input_tokens:>13.4f}"
            f"{row.usd_per_request_uncached:>12.6f}{row.saving_fraction:>8.1%}"
        )
    if ttft is not None:
        lines += [
            "",
            f"TTFT: {ttft.seconds * 1e3:.1f} ms at this hit rate, {ttft.miss_seconds * 1e3:.1f} ms with "
            f"nothing cached ({ttft.fixed_seconds * 1e3:.1f} ms fixed + "
            f"{ttft.prefill_seconds_per_token * 1e6:.3g} us per uncached token)",
        ]
    lines += ["", "Sources (" + PRICE_TABLE_NOTE + "):"]
    lines += [
        f"  {row.vendor}: {by_name[row.vendor].source}, as published on {by_name[row.vendor].as_of}; "
        f"{by_name[row.vendor].notes}"
        for row in rows
    ]
    return lines

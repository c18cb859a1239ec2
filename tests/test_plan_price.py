"""plan/price.py and `prefixserve plan price`: blended prices and TTFT on given inputs (exact), the vendor table's
provenance, and the command line on given and measured (a fake /metrics) inputs."""

import json

import httpx
import pytest

from prefixserve.cli import main
from prefixserve.commands.plan_price import fetch_measured, parse_metrics
from prefixserve.plan.price import (
    VENDOR_PRICES,
    VendorPrice,
    blended_price,
    estimated_ttft,
    fixed_seconds_from_measured,
    price_json,
    price_table,
    vendor,
)


def test_every_vendor_row_names_its_source_and_date_and_the_issue_ratios_hold():
    for entry in VENDOR_PRICES:
        assert entry.source.startswith("https://") and len(entry.as_of) == 10 and entry.as_of[4] == "-"
        assert 0 < entry.cached_read < entry.fresh
    assert (vendor("deepseek-v3").cached_read, vendor("deepseek-v3").fresh) == (0.07, 0.27)
    sonnet = vendor("anthropic-sonnet")
    assert sonnet.cached_read == pytest.approx(0.1 * sonnet.fresh)
    assert sonnet.cache_write == pytest.approx(1.25 * sonnet.fresh)
    assert vendor("gemini-2.5-pro").cached_ratio == pytest.approx(0.25, abs=0.005)
    assert vendor("openai-gpt-4o").cached_ratio == 0.5
    with pytest.raises(ValueError, match="unknown vendor 'acme'; one of deepseek-v3"):
        vendor("acme")


def test_blended_price_without_a_write_surcharge():
    row = blended_price(0.5, 1000, "deepseek-v3")
    assert (row.cached_tokens, row.fresh_tokens) == (500, 500)
    assert row.usd_per_request == pytest.approx((500 * 0.07 + 500 * 0.27) / 1e6)
    assert row.usd_per_million_input_tokens == pytest.approx(0.17)
    assert row.usd_per_request_uncached == pytest.approx(270 / 1e6)
    assert row.saving_fraction == pytest.approx(1 - 0.17 / 0.27)
    assert blended_price(0.0, 1000, "deepseek-v3").saving_fraction == pytest.approx(0.0)


def test_a_cache_write_price_is_paid_on_the_written_misses():
    written = blended_price(0.5, 1000, "anthropic-sonnet")
    assert written.usd_per_request == pytest.approx((500 * 0.30 + 500 * 3.75) / 1e6)
    assert written.saving_fraction == pytest.approx(1 - 2.025 / 3.0)
    half = blended_price(0.5, 1000, "anthropic-sonnet", write_fraction=0.5)
    assert half.usd_per_request == pytest.approx((500 * 0.30 + 250 * 3.75 + 250 * 3.0) / 1e6)
    # With nothing reused, writing everything costs more than not caching: the saving is negative.
    assert blended_price(0.0, 1000, "anthropic-sonnet").saving_fraction == pytest.approx(-0.25)


def test_bad_inputs_name_the_range():
    with pytest.raises(ValueError, match=r"hit_rate must be a fraction in \[0, 1\], got 1.5"):
        blended_price(1.5, 1000, "deepseek-v3")
    with pytest.raises(ValueError, match="prompt_tokens must be positive, got 0"):
        blended_price(0.5, 0, "deepseek-v3")
    with pytest.raises(ValueError, match="write_fraction"):
        blended_price(0.5, 10, "deepseek-v3", write_fraction=2)
    with pytest.raises(ValueError, match="non-negative"):
        VendorPrice("x", "x", -1, 0, None, "https://x", "2025-01-01")
    with pytest.raises(ValueError, match="prefill_seconds_per_token must be positive"):
        estimated_ttft(0.5, 100, 0)


def test_ttft_model_and_its_fit_to_a_measured_mean():
    prefill = 2.0**-10
    estimate = estimated_ttft(0.75, 1024, prefill, fixed_seconds=0.0625)
    assert estimate.seconds == 0.0625 + 256 * prefill
    assert estimate.miss_seconds == 0.0625 + 1024 * prefill
    # A measured mean of 0.5 s at a 50% hit rate on 512-token prompts leaves 0.25 s fixed.
    assert fixed_seconds_from_measured(0.5, 0.5, 512, prefill) == 0.25
    assert fixed_seconds_from_measured(0.01, 0.0, 512, prefill) == 0.0  # never negative


def test_price_json_carries_each_rows_provenance():
    body = price_json(price_table(0.25, 4000), estimated_ttft(0.25, 4000, 1e-4))
    assert [row["vendor"] for row in body["vendors"]] == [entry.name for entry in VENDOR_PRICES]
    first = body["vendors"][0]
    assert first["source"] and first["as_of"] and first["fresh_usd_per_million"] == 0.27
    assert body["ttft"]["seconds"] == pytest.approx(3000 * 1e-4)
    json.dumps(body)


METRICS = """# TYPE prefixserve:prefix_cache_queries counter
prefixserve:prefix_cache_queries_total 4000.0
# TYPE prefixserve:prefix_cache_hits counter
prefixserve:prefix_cache_hits_total 3000.0
# TYPE prefixserve:prefix_cache_requests counter
prefixserve:prefix_cache_requests_total 8.0
# TYPE prefixserve:time_to_first_token_seconds histogram
prefixserve:time_to_first_token_seconds_bucket{le="+Inf"} 8.0
prefixserve:time_to_first_token_seconds_count 8.0
prefixserve:time_to_first_token_seconds_sum 2.0
"""


def test_measured_inputs_from_a_servers_metrics():
    measured = parse_metrics(METRICS)
    assert measured == (0.75, 500.0, 8.0, 0.25)
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"], seen["auth"] = request.url.path, request.headers.get("authorization")
        return httpx.Response(200, text=METRICS)

    assert fetch_measured("http://server:8000/", "k", httpx.MockTransport(handler)) == measured
    assert seen == {"path": "/metrics", "auth": "Bearer k"}
    with pytest.raises(ValueError, match="is it a prefixserve server"):
        parse_metrics("# TYPE other counter\nother_total 1.0\n")
    failing = httpx.MockTransport(lambda request: httpx.Response(503, text="down"))
    with pytest.raises(ValueError, match="answered 503: down"):
        fetch_measured("http://server:8000", None, failing)


def test_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "price.json"
    assert (
        main(
            [
                "plan",
                "price",
                "--hit-rate",
                "0.5",
                "--prompt-tokens",
                "1000",
                "--prefill-seconds-per-token",
                "0.001",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "deepseek-v3" in printed and "https://api-docs.deepseek.com" in printed and "as published on" in printed
    assert "TTFT: 500.0 ms at this hit rate, 1000.0 ms with nothing cached" in printed
    body = json.loads(out.read_text())
    assert body["vendors"][0]["usd_per_million_input_tokens"] == pytest.approx(0.17)
    assert body["measured"] is None


def test_command_rejects_bad_input_with_one_line(capsys):
    assert main(["plan", "price", "--hit-rate", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "prefixserve plan price: error: hit_rate must be a fraction in [0, 1], got 2.0"
    )
    assert main(["plan", "price", "--url", "http://127.0.0.1:9"]) == 2
    assert "could not fetch http://127.0.0.1:9/metrics" in capsys.readouterr().err
